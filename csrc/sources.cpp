#include "sources.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "atomics.h"
#include "kernel_abi.h"

namespace fabric {

TokenTableSource::TokenTableSource(const std::int32_t* tokens, std::uint64_t n_tokens,
                                   const std::int64_t* offsets, std::uint64_t n_rows)
    : tokens_(tokens), n_tokens_(n_tokens), offsets_(offsets), n_rows_(n_rows) {}

void TokenTableSource::write(const BatchSpec& spec, const std::int64_t* rows,
                             std::int64_t* offsets, std::int32_t* tokens) {
  std::int64_t at = 0;
  for (std::uint32_t i = 0; i < spec.item_count; ++i) {
    const std::int64_t row = rows[i];
    if (row < 0 || static_cast<std::uint64_t>(row) >= n_rows_) {
      throw std::out_of_range("batch " + std::to_string(spec.batch_id) + ": row " +
                              std::to_string(row) + " is outside the task set (" +
                              std::to_string(n_rows_) + " rows)");
    }
    const std::int64_t begin = offsets_[row];
    const std::int64_t length = offsets_[row + 1] - begin;
    offsets[i] = at;
    if (static_cast<std::uint64_t>(at + length) > spec.real_tokens ||
        static_cast<std::uint64_t>(offsets_[row + 1]) > n_tokens_) {
      throw std::length_error("batch " + std::to_string(spec.batch_id) +
                              ": its rows hold more tokens than real_tokens says");
    }
    std::memcpy(tokens + at, tokens_ + begin, static_cast<std::size_t>(length) * 4);
    at += length;
  }
  offsets[spec.item_count] = at;
  if (static_cast<std::uint64_t>(at) != spec.real_tokens) {
    throw std::length_error("batch " + std::to_string(spec.batch_id) + ": rows hold " +
                            std::to_string(at) + " tokens, real_tokens says " +
                            std::to_string(spec.real_tokens));
  }
}

void SelfTestSource::write(const BatchSpec& spec, const std::int64_t*, std::int64_t* offsets,
                           std::int32_t* tokens) {
  using kernels::mix64;
  using kernels::token_term;
  // The checksum the GPU computes: descriptor identity, offsets and tokens (kernels.cu).
  // publish_seq is not known here; the verifier adds its term.
  std::uint64_t sum = mix64(spec.batch_id);
  const std::uint64_t base = spec.real_tokens / spec.item_count;
  const std::uint64_t extra = spec.real_tokens % spec.item_count;
  std::uint64_t at = 0;
  for (std::uint32_t i = 0; i < spec.item_count; ++i) {
    offsets[i] = static_cast<std::int64_t>(at);
    sum += token_term((1ull << 40) + i, static_cast<std::uint32_t>(at));
    at += base + (i < extra ? 1 : 0);
  }
  offsets[spec.item_count] = static_cast<std::int64_t>(at);
  sum += token_term((1ull << 40) + spec.item_count, static_cast<std::uint32_t>(at));
  std::uint64_t state = mix64(seed_ ^ (spec.batch_id * 0x9E3779B97F4A7C15ull));
  for (std::uint64_t t = 0; t < spec.real_tokens; ++t) {
    state = mix64(state);
    const auto token = static_cast<std::uint32_t>(state);
    tokens[t] = static_cast<std::int32_t>(token);
    sum += token_term(t, token);
  }
  Entry& entry = table_[spec.batch_id % kTable];
  entry.checksum = sum;
  // Release: order the checksum's store before the tag that says which batch it belongs to.
  store_release(entry.seq, spec.batch_id);
}

std::uint64_t SelfTestSource::expected(std::uint64_t batch_id) const {
  const Entry& entry = table_[batch_id % kTable];
  // Acquire: pairs with the tag's release above: the checksum is written once the tag is seen.
  while (load_acquire(entry.seq) != batch_id) cpu_relax();
  return entry.checksum;
}

}  // namespace fabric
