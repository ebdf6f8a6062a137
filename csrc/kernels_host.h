// Host twins of the kernels (kernels.cu), for the emulated GPU: same arguments, same results.
#pragma once

#include "kernel_abi.h"

namespace fabric::kernels {

// Runs kernel `id` on the calling thread; `args` points at its argument struct.
void run_on_host(KernelId id, const void* args);

}  // namespace fabric::kernels
