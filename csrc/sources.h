// Payload sources: what the filler writes into a batch's slot.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "runtime.h"

namespace fabric {

// The product's source: items are rows of a tokenised task set held as one flat int32 token
// array with int64 offsets (the Arrow list layout, memory-mapped); the filler gathers the rows'
// tokens straight into the slot. The arrays must outlive the runtime.
class TokenTableSource final : public PayloadSource {
 public:
  TokenTableSource(const std::int32_t* tokens, std::uint64_t n_tokens, const std::int64_t* offsets,
                   std::uint64_t n_rows);
  void write(const BatchSpec& spec, const std::int64_t* rows, std::int64_t* offsets,
             std::int32_t* tokens) override;

 private:
  const std::int32_t* tokens_;
  std::uint64_t n_tokens_;
  const std::int64_t* offsets_;
  std::uint64_t n_rows_;
};

// The protocol tests' source: seeded random items and tokens, and for each batch the checksum
// the GPU must compute from what it reads, recorded for the verifier.
class SelfTestSource final : public PayloadSource {
 public:
  static constexpr std::size_t kTable = 1 << 14;  // > max_in_flight

  explicit SelfTestSource(std::uint64_t seed) : seed_(seed), table_(kTable) {}
  void write(const BatchSpec& spec, const std::int64_t* rows, std::int64_t* offsets,
             std::int32_t* tokens) override;
  // The checksum recorded for `seq`; spins until the filler has written it.
  std::uint64_t expected(std::uint64_t seq) const;

 private:
  struct Entry {
    std::atomic<std::uint64_t> seq{0};
    std::uint64_t checksum = 0;
  };
  std::uint64_t seed_;
  std::vector<Entry> table_;
};

}  // namespace fabric
