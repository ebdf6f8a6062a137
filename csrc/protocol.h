// What crosses from the host to the GPU: batch payload slots in the pinned ring, the doorbell,
// and the counters the GPU writes back. Shared by the host code and (as plain layouts) the
// kernels; all little-endian, all fixed size.
#pragma once

#include <cstdint>

namespace fabric {

// The first bytes of every payload slot in the pinned ring. A slot is:
//   [BatchDescriptor][item offsets: int64 x (item_count + 1)][token ids: int32 x real_tokens]
// Offsets count tokens from the start of the token array, so item i is
// tokens[offsets[i] : offsets[i + 1]].
struct alignas(64) BatchDescriptor {
  std::uint64_t batch_id;       // the caller's id for the batch, handed back with its outputs
  std::uint64_t publish_seq;    // 1, 2, 3, ...: the doorbell value that releases this batch
  std::uint64_t real_tokens;    // tokens that are not padding
  std::uint64_t padded_tokens;  // item_count x bucket_max
  std::uint64_t output_limit;   // payload-ring bytes reserved for this batch's outputs
  std::uint32_t offsets_at;     // byte offset of the item offsets inside the slot
  std::uint32_t tokens_at;      // byte offset of the token ids inside the slot
  std::uint32_t lane;           // which worker lane submitted it
  std::uint32_t batch_class;    // caller-defined class (e.g. priority)
  std::uint32_t bucket_max;     // the batch's padded sequence length
  std::uint32_t item_count;
  std::uint32_t shape_epoch;    // which captured graph runs it
  std::uint32_t payload_bytes;  // bytes of the whole slot
  std::uint64_t reserved[7];
};
static_assert(sizeof(BatchDescriptor) == 128, "descriptor layout is part of the protocol");

inline std::uint64_t slot_bytes(std::uint32_t item_count, std::uint64_t real_tokens) {
  return sizeof(BatchDescriptor) + 8ull * (item_count + 1) + 4ull * real_tokens;
}

// The doorbell: one cache line of mapped pinned memory holding the sequence number the GPU
// stream waits on. Kernels get their slot's address as an argument (the decode loop knows it when
// it enqueues), so nothing else travels here.
struct alignas(64) Doorbell {
  volatile std::uint64_t seq;
  std::uint64_t pad[7];
};
static_assert(sizeof(Doorbell) == 64, "the doorbell is exactly one cache line");

// Counters the GPU writes (system-scope release by cuStreamWriteValue64) and the host reads
// (acquire): one cache line each so that writes of one never invalidate the line of another.
struct alignas(64) DeviceCounters {
  volatile std::uint64_t consumed_seq;  // last batch whose ring slot the GPU no longer reads
  std::uint64_t pad0[7];
  volatile std::uint64_t published_head;  // payload-ring bytes whose outputs are complete
  std::uint64_t pad1[7];
};
static_assert(sizeof(DeviceCounters) == 128, "two cache lines");

}  // namespace fabric
