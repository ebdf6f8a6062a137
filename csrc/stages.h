// Stages: the GPU work of one batch between its doorbell and its publication.
#pragma once

#include <cstdint>

#include "runtime.h"

namespace fabric {

// The protocol tests' engine: a checksum kernel reads the whole slot (proving the GPU saw every
// published byte), then `spec.hooks` fill kernels write the batch's output in pieces of random
// size derived from that checksum, each piece a hook output with its publish point.
class SelfTestStage final : public Stage {
 public:
  void warm_up(Gpu& gpu) override;
  void enqueue(Context& ctx) override;
  ~SelfTestStage() override;

 private:
  static constexpr std::uint64_t kScratchSlots = 4096;  // > max_in_flight
  Gpu* gpu_ = nullptr;
  DevPtr scratch_ = 0;  // one checksum per in-flight batch
};

}  // namespace fabric
