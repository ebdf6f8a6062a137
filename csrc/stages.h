// Stages: the GPU work of one batch between its doorbell and its publication.
#pragma once

#include <cstdint>

#include "runtime.h"

namespace fabric {

// The protocol tests' engine: a checksum kernel reads the whole slot (proving the GPU saw every
// published byte), then `spec.hooks` fill kernels write the batch's output in pieces of random
// size derived from that checksum, each piece a hook output with its publish point. For batches
// whose output size is resolved on the GPU it writes selftest_output_words() words and reports
// that size; `oversize_batch` (a batch id) reports more than its reservation instead.
class SelfTestStage final : public Stage {
 public:
  explicit SelfTestStage(std::uint64_t oversize_batch = 0) : oversize_batch_(oversize_batch) {}
  void warm_up(Gpu& gpu) override;
  void enqueue(Context& ctx) override;
  ~SelfTestStage() override;

 private:
  static constexpr std::uint64_t kScratchSlots = 4096;  // > max_in_flight
  std::uint64_t oversize_batch_;
  Gpu* gpu_ = nullptr;
  DevPtr scratch_ = 0;  // one checksum per in-flight batch
};

// Words the self-test stage writes for a batch whose size the GPU resolves: fewer than reserved.
inline std::uint64_t selftest_output_words(std::uint64_t batch_id, std::uint64_t reserved_words) {
  return reserved_words - (batch_id * 2654435761ull) % (reserved_words / 2 + 1);
}

}  // namespace fabric
