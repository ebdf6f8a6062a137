// Device kernels of the runtime. Compiled to a fatbin by CMake where nvcc exists, embedded into
// the module, and loaded through the driver API at warm-up (never lazily: see ARCHITECTURE.md).
#include <cstdint>

#include "kernel_abi.h"

extern "C" __global__ void fabric_selftest_write(unsigned long long* flag, unsigned long long value) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    // Release at system scope: order every earlier write of this thread before the flag, as seen
    // by the host.
    __threadfence_system();
    atomicExch(flag, value);
  }
}

extern "C" __global__ void fabric_gather_padded(const std::int32_t* __restrict__ tokens,
                                                const std::int64_t* __restrict__ offsets,
                                                int items, int seq_len, std::int64_t pad_id,
                                                std::int64_t* __restrict__ ids,
                                                std::int64_t* __restrict__ mask) {
  const int item = blockIdx.y;
  if (item >= items) return;
  const std::int64_t begin = offsets[item];
  const int length = static_cast<int>(offsets[item + 1] - begin);
  for (int pos = blockIdx.x * blockDim.x + threadIdx.x; pos < seq_len;
       pos += gridDim.x * blockDim.x) {
    const bool real = pos < length;
    const std::int64_t out = static_cast<std::int64_t>(item) * seq_len + pos;
    ids[out] = real ? static_cast<std::int64_t>(tokens[begin + pos]) : pad_id;
    mask[out] = real ? 1 : 0;
  }
}
