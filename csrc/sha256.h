// SHA-256 (FIPS 180-4) of byte runs, for content keys: the same digests as Python's hashlib,
// computed on every core without the interpreter (fabric_gpu._content_keys). Blocks are
// compressed with the CPU's SHA extensions where it has them (x86 SHA-NI), else portably.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace fabric::sha256 {

using Digest = std::array<std::uint8_t, 32>;

// How blocks are compressed: kAuto picks the SHA extensions when the CPU has them.
enum class Implementation { kAuto, kPortable, kShaExtensions };

// Whether this CPU has the SHA extensions (and SSE4.1, which their use needs).
bool has_sha_extensions();

// Compresses `count` 64-byte blocks into `state` (eight words, FIPS 180-4's H0..H7).
using CompressFn = void (*)(std::uint32_t* state, const std::uint8_t* blocks, std::size_t count);

// A running hash: update with bytes, in order; digest once.
class Hasher {
 public:
  explicit Hasher(Implementation implementation = Implementation::kAuto);
  void update(const std::uint8_t* data, std::size_t size);
  Digest digest();  // pads and finishes: the hasher is spent after it

 private:
  CompressFn compress_;
  std::array<std::uint32_t, 8> state_;
  std::array<std::uint8_t, 64> pending_{};  // bytes of a block not yet full
  std::size_t pending_size_ = 0;
  std::uint64_t total_ = 0;  // bytes hashed so far
};

// For each i < n: the digest of prefix followed by data[offsets[i], offsets[i + 1]), into
// out[32 * i, 32 * i + 32). The prefix's state is computed once and copied per run. Offsets are
// trusted (the binding checks them); `threads` split the runs into contiguous ranges.
// kShaExtensions on a CPU without them throws std::invalid_argument.
void digest_runs(const std::uint8_t* prefix, std::size_t prefix_size, const std::uint8_t* data,
                 const std::int64_t* offsets, std::size_t n, std::uint8_t* out, unsigned threads,
                 Implementation implementation = Implementation::kAuto);

}  // namespace fabric::sha256
