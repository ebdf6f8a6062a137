// The CUDA kernels as an embedded fatbin (csrc/kernels.cu), or an empty image when the runtime
// was built without nvcc.
#pragma once

#include <cstddef>

namespace fabric {

struct KernelImage {
  const unsigned char* data;  // nullptr when built without kernels
  std::size_t size;
  const char* archs;  // e.g. "sm_80,sm_90,compute_90"
};

extern const KernelImage kKernelImage;

}  // namespace fabric
