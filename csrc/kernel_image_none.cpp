// Used when nvcc was not found at build time: the runtime carries no kernels and reports so.
#include "kernel_image.h"

namespace fabric {
const KernelImage kKernelImage = {nullptr, 0, ""};
}  // namespace fabric
