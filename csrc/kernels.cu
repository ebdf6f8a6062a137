// Device kernels of the runtime. CMake compiles this file to a fatbin (sm_80, sm_90, PTX) that is
// embedded in the module and loaded through the driver API at warm-up; every kernel is launched
// once there, never for the first time behind a doorbell wait (see docs/runtime.md: with lazy
// module loading that first launch deadlocks). kernels_host.cpp holds the host twins used in
// emulation; both implement kernel_abi.h.
#include <cstdint>

#include "kernel_abi.h"
#include "protocol.h"

using namespace fabric;
using namespace fabric::kernels;

namespace {

__device__ const BatchDescriptor& descriptor_of(std::uint64_t slot) {
  return *reinterpret_cast<const BatchDescriptor*>(slot);
}

__device__ const std::int64_t* offsets_of(std::uint64_t slot) {
  return reinterpret_cast<const std::int64_t*>(slot + descriptor_of(slot).offsets_at);
}

__device__ const std::int32_t* tokens_of(std::uint64_t slot) {
  return reinterpret_cast<const std::int32_t*>(slot + descriptor_of(slot).tokens_at);
}

}  // namespace

extern "C" __global__ void fabric_selftest_write(SelfTestWriteArgs a) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    // Release at system scope: order this thread's earlier writes before the flag, for the host.
    __threadfence_system();
    atomicExch(reinterpret_cast<unsigned long long*>(a.flag), a.value);
  }
}

// One block of 256 threads.
extern "C" __global__ void fabric_selftest_checksum(SelfTestChecksumArgs a) {
  const BatchDescriptor& d = descriptor_of(a.slot);
  const std::int32_t* tokens = tokens_of(a.slot);
  const std::int64_t* offsets = offsets_of(a.slot);
  std::uint64_t sum = 0;
  for (std::uint64_t i = threadIdx.x; i < d.real_tokens; i += blockDim.x) {
    sum += token_term(i, static_cast<std::uint32_t>(tokens[i]));
  }
  for (std::uint32_t i = threadIdx.x; i <= d.item_count; i += blockDim.x) {
    sum += token_term((1ull << 40) + i, static_cast<std::uint32_t>(offsets[i]));
  }
  for (int step = 16; step > 0; step >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, step);
  __shared__ std::uint64_t warp_sums[32];
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    std::uint64_t total = mix64(d.batch_id) + mix64(d.publish_seq << 1);
    for (unsigned w = 0; w < (blockDim.x + 31) / 32; ++w) total += warp_sums[w];
    *reinterpret_cast<std::uint64_t*>(a.checksum) = total;
  }
}

extern "C" __global__ void fabric_selftest_fill(SelfTestFillArgs a) {
  const std::uint64_t checksum = *reinterpret_cast<const std::uint64_t*>(a.checksum);
  auto* out = reinterpret_cast<std::uint64_t*>(a.out);
  for (std::uint64_t w = blockIdx.x * blockDim.x + threadIdx.x; w < a.words;
       w += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    out[w] = fill_word(checksum, a.first_word + w);
  }
}

// Grid: (ceil(seq_len / blockDim.x), items).
extern "C" __global__ void fabric_gather_padded(GatherPaddedArgs a) {
  const unsigned item = blockIdx.y;
  // The descriptor bounds the items too: a slot released empty at shutdown has none.
  if (item >= a.items || item >= descriptor_of(a.slot).item_count) return;
  const std::int64_t* offsets = offsets_of(a.slot);
  const std::int32_t* tokens = tokens_of(a.slot);
  const std::int64_t begin = offsets[item];
  const std::int64_t length = offsets[item + 1] - begin;
  auto* ids = reinterpret_cast<std::int64_t*>(a.ids);
  auto* mask = reinterpret_cast<std::int64_t*>(a.mask);
  for (unsigned pos = blockIdx.x * blockDim.x + threadIdx.x; pos < a.seq_len;
       pos += gridDim.x * blockDim.x) {
    const bool real = pos < length;
    const std::uint64_t out = static_cast<std::uint64_t>(item) * a.seq_len + pos;
    ids[out] = real ? static_cast<std::int64_t>(tokens[begin + pos]) : a.pad_id;
    mask[out] = real ? 1 : 0;
  }
}

// Grid: (blocks per item, items). 16-byte vectors; row_bytes is a multiple of 16.
extern "C" __global__ void fabric_hook_copy(HookCopyArgs a) {
  const unsigned item = blockIdx.y;
  if (item >= a.items || item >= descriptor_of(a.slot).item_count) return;
  const std::int64_t* offsets = offsets_of(a.slot);
  const std::uint64_t first = static_cast<std::uint64_t>(offsets[item]);
  const std::uint64_t length = static_cast<std::uint64_t>(offsets[item + 1]) - first;
  const std::uint64_t vectors_per_row = a.row_bytes / 16;
  const std::uint64_t total = length * vectors_per_row;
  const auto* src = reinterpret_cast<const uint4*>(a.src) +
                    static_cast<std::uint64_t>(item) * a.seq_len * vectors_per_row;
  auto* out = reinterpret_cast<uint4*>(a.out) + first * vectors_per_row;
  for (std::uint64_t v = blockIdx.x * blockDim.x + threadIdx.x; v < total;
       v += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    out[v] = src[v];  // rows of one item are contiguous in both buffers
  }
}

// Grid: (blocks, item_count + 1): block row y < items writes item y's tokens; row y == items
// writes the padded tail and the unused cu_seqlens entries.
extern "C" __global__ void fabric_gather_packed(GatherPackedArgs a) {
  const BatchDescriptor& d = descriptor_of(a.slot);
  const unsigned items = d.item_count;
  const unsigned row = blockIdx.y;
  if (row > items || items > a.max_items) return;
  const std::int64_t* offsets = offsets_of(a.slot);
  const std::int32_t* tokens = tokens_of(a.slot);
  auto* ids = reinterpret_cast<std::int64_t*>(a.ids);
  auto* positions = reinterpret_cast<std::int64_t*>(a.positions);
  auto* seq_ids = reinterpret_cast<std::int64_t*>(a.seq_ids);
  auto* cu = reinterpret_cast<std::int32_t*>(a.cu_seqlens);
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  const std::uint64_t first = blockIdx.x * blockDim.x + threadIdx.x;
  if (row < items) {
    const std::int64_t begin = offsets[row];
    const std::int64_t length = offsets[row + 1] - begin;
    if (first == 0) cu[row] = static_cast<std::int32_t>(begin);
    for (std::uint64_t t = first; t < static_cast<std::uint64_t>(length); t += stride) {
      ids[begin + t] = tokens[begin + t];
      positions[begin + t] = static_cast<std::int64_t>(t);
      seq_ids[begin + t] = row;
    }
    return;
  }
  const std::uint64_t real = d.real_tokens;
  for (std::uint64_t t = real + first; t < a.capacity; t += stride) {
    ids[t] = a.pad_id;
    positions[t] = 0;
    seq_ids[t] = a.max_items;
  }
  for (std::uint64_t i = items + first; i <= a.max_items + 1; i += stride) {
    cu[i] = static_cast<std::int32_t>(i == items ? real : a.capacity);
  }
}

extern "C" __global__ void fabric_copy_bytes(CopyBytesArgs a) {
  const auto* src = reinterpret_cast<const uint4*>(a.src);
  auto* out = reinterpret_cast<uint4*>(a.out);
  const std::uint64_t n = a.bytes / 16;
  for (std::uint64_t v = blockIdx.x * blockDim.x + threadIdx.x; v < n;
       v += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    out[v] = src[v];
  }
}
