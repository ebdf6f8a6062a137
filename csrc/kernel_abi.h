// Kernels shared by the CUDA build (kernels.cu) and the host emulation (kernels_host.cpp): their
// ids, their argument structs (passed by value as the one kernel parameter), and the arithmetic
// both sides must agree on bit for bit.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FABRIC_HD __host__ __device__ __forceinline__
#else
#define FABRIC_HD inline
#endif

namespace fabric::kernels {

enum class KernelId : int {
  kSelfTestWrite = 0,
  kSelfTestChecksum = 1,
  kSelfTestFill = 2,
  kGatherPadded = 3,
  kHookCopy = 4,
  kGatherPacked = 5,
  kCopyBytes = 6,
  kCount = 7,
};

// extern "C" names in the fatbin, indexed by KernelId.
constexpr const char* kNames[] = {
    "fabric_selftest_write", "fabric_selftest_checksum", "fabric_selftest_fill",
    "fabric_gather_padded", "fabric_hook_copy", "fabric_gather_packed", "fabric_copy_bytes",
};

// Writes `value` to `flag` with a system-scope release (the warm-up self test).
struct SelfTestWriteArgs {
  std::uint64_t flag;  // device address of a uint64
  std::uint64_t value;
};

// Reads one payload slot (descriptor, offsets, tokens) and writes a checksum of its tokens:
// the stand-in "engine" of the protocol tests, which proves the GPU saw the bytes published.
struct SelfTestChecksumArgs {
  std::uint64_t slot;      // device address of the slot in the pinned ring
  std::uint64_t checksum;  // device address of a uint64 scratch value
};

// Fills `words` uint64 words at `out` with the self-test pattern of `checksum`, starting at word
// `first_word` of the batch's output: the stand-in for hook-copy kernels.
struct SelfTestFillArgs {
  std::uint64_t out;
  std::uint64_t words;
  std::uint64_t first_word;
  std::uint64_t checksum;  // device address of the value SelfTestChecksum wrote
};

// Scatters a slot's tokens into padded static inputs: ids[items, seq_len] (int64) and
// mask[items, seq_len] (int64: 1 real, 0 pad).
struct GatherPaddedArgs {
  std::uint64_t slot;
  std::uint64_t ids;
  std::uint64_t mask;
  std::uint32_t seq_len;
  std::uint32_t items;
  std::int64_t pad_id;
};

// Copies the hidden states of real tokens only, items back to back, from a padded
// [items, seq_len, row_bytes] buffer to `out`; item lengths come from the slot's offsets.
struct HookCopyArgs {
  std::uint64_t slot;
  std::uint64_t src;
  std::uint64_t out;
  std::uint32_t seq_len;
  std::uint32_t items;
  std::uint32_t row_bytes;  // hidden x element size; a multiple of 16
  std::uint32_t reserved;
};

// Lays a slot's tokens out for a packed engine (all tokens of the batch in one sequence axis):
// ids[capacity] (int64; pad_id past the real tokens), positions[capacity] (int64: position
// inside the item), seq_ids[capacity] (int64: the item of each token; `max_items` for the padded
// tail), cu_seqlens[max_items + 2] (int32 prefix sums; the padded tail is one more sequence, and
// unused entries repeat `capacity`, i.e. empty sequences). Grid: (blocks, item_count + 1).
struct GatherPackedArgs {
  std::uint64_t slot;
  std::uint64_t ids;
  std::uint64_t positions;
  std::uint64_t seq_ids;
  std::uint64_t cu_seqlens;
  std::uint32_t capacity;
  std::uint32_t max_items;
  std::int64_t pad_id;
};

// Copies `bytes` (a multiple of 16) from src to out: contiguous outputs (pooled rows, packed
// hook layers whose real tokens are the first rows).
struct CopyBytesArgs {
  std::uint64_t src;
  std::uint64_t out;
  std::uint64_t bytes;
};

// splitmix64: the mixing function of the checksum and of the fill pattern.
FABRIC_HD std::uint64_t mix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// One token's contribution; the checksum is the wrapping sum over all tokens, so any order of
// summation (GPU reduction, host loop) gives the same value, and a torn or stale token changes it.
FABRIC_HD std::uint64_t token_term(std::uint64_t index, std::uint32_t token) {
  return mix64((index << 32) ^ token);
}

FABRIC_HD std::uint64_t fill_word(std::uint64_t checksum, std::uint64_t word) {
  return mix64(checksum ^ (word * 0xD6E8FEB86659FD93ull));
}

}  // namespace fabric::kernels
