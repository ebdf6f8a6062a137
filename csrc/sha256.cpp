// SHA-256 as FIPS 180-4 specifies it; checked against hashlib in tests/test_content_keys.py,
// each compression (portable, SHA extensions) on its own.
#include "sha256.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace fabric::sha256 {
namespace {

constexpr std::array<std::uint32_t, 64> kRound = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

constexpr std::uint32_t rotr(std::uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

// One block at a time, in plain C++: any CPU.
void compress_portable(std::uint32_t* state, const std::uint8_t* data, std::size_t count) {
  for (; count > 0; --count, data += 64) {
    std::uint32_t w[64];
    for (int i = 0; i < 16; ++i) {  // big-endian words
      w[i] = (std::uint32_t{data[4 * i]} << 24) | (std::uint32_t{data[4 * i + 1]} << 16) |
             (std::uint32_t{data[4 * i + 2]} << 8) | std::uint32_t{data[4 * i + 3]};
    }
    for (int i = 16; i < 64; ++i) {
      const std::uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const std::uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    std::uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
    std::uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
    for (int i = 0; i < 64; ++i) {
      const std::uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) +
                               kRound[i] + w[i];
      const std::uint32_t t2 =
          (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state[0] += a;
    state[1] += b;
    state[2] += c;
    state[3] += d;
    state[4] += e;
    state[5] += f;
    state[6] += g;
    state[7] += h;
  }
}

#if defined(__x86_64__)
// The x86 SHA extensions: sha256rnds2 does two rounds on the state held as ABEF and CDGH;
// sha256msg1/msg2 extend the message schedule four words at a time (Intel's SHA extensions
// white paper, the same dataflow written as a loop over the 16 groups of four rounds).
__attribute__((target("sha,sse4.1"))) void compress_sha_extensions(std::uint32_t* state,
                                                                    const std::uint8_t* data,
                                                                    std::size_t count) {
  const __m128i byte_swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
  __m128i cdab = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(state)), 0xB1);
  __m128i efgh = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(state + 4)), 0x1B);
  __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
  __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
  for (; count > 0; --count, data += 64) {
    const __m128i abef_before = abef, cdgh_before = cdgh;
    __m128i w[4];  // the schedule's words of groups g, g + 1, g + 2, g + 3 (index g % 4)
    for (int i = 0; i < 4; ++i) {
      w[i] = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 16 * i)),
                              byte_swap);
    }
    for (int g = 0; g < 16; ++g) {
      const __m128i k = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kRound.data() + 4 * g));
      __m128i wk = _mm_add_epi32(w[g & 3], k);
      cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);
      wk = _mm_shuffle_epi32(wk, 0x0E);  // rounds 4g+2, 4g+3
      abef = _mm_sha256rnds2_epu32(abef, cdgh, wk);
      if (g < 12) {  // W[4g+16 .. 4g+19] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16]
        __m128i next = _mm_sha256msg1_epu32(w[g & 3], w[(g + 1) & 3]);
        next = _mm_add_epi32(next, _mm_alignr_epi8(w[(g + 3) & 3], w[(g + 2) & 3], 4));
        w[g & 3] = _mm_sha256msg2_epu32(next, w[(g + 3) & 3]);
      }
    }
    abef = _mm_add_epi32(abef, abef_before);
    cdgh = _mm_add_epi32(cdgh, cdgh_before);
  }
  const __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
  const __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state), _mm_blend_epi16(feba, dchg, 0xF0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state + 4), _mm_alignr_epi8(dchg, feba, 8));
}
#endif

}  // namespace

bool has_sha_extensions() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool sse41 = (c & bit_SSE4_1) != 0, ssse3 = (c & bit_SSSE3) != 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return sse41 && ssse3 && (b & bit_SHA) != 0;
#else
  return false;
#endif
}

namespace {

CompressFn chosen_compress(Implementation implementation) {
  static const bool available = has_sha_extensions();  // asked once per process
  switch (implementation) {
    case Implementation::kPortable:
      return compress_portable;
    case Implementation::kShaExtensions:
      if (!available) throw std::invalid_argument("sha256: this CPU has no SHA extensions");
      break;
    case Implementation::kAuto:
      if (!available) return compress_portable;
      break;
  }
#if defined(__x86_64__)
  return compress_sha_extensions;
#else
  return compress_portable;
#endif
}

}  // namespace

Hasher::Hasher(Implementation implementation)
    : compress_(chosen_compress(implementation)),
      state_{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
             0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19} {}

void Hasher::update(const std::uint8_t* data, std::size_t size) {
  total_ += size;
  if (pending_size_ > 0) {  // top up the pending block first
    const std::size_t take = std::min(size, pending_.size() - pending_size_);
    std::memcpy(pending_.data() + pending_size_, data, take);
    pending_size_ += take;
    data += take;
    size -= take;
    if (pending_size_ < pending_.size()) return;
    compress_(state_.data(), pending_.data(), 1);
    pending_size_ = 0;
  }
  const std::size_t whole = size / 64;
  compress_(state_.data(), data, whole);
  data += 64 * whole;
  size -= 64 * whole;
  std::memcpy(pending_.data(), data, size);
  pending_size_ = size;
}

Digest Hasher::digest() {
  // The padding in one or two blocks: 0x80, zeros up to 56 mod 64, the length in bits
  // (big-endian), after the pending bytes.
  const std::uint64_t bits = total_ * 8;
  std::array<std::uint8_t, 128> tail{};
  std::memcpy(tail.data(), pending_.data(), pending_size_);
  tail[pending_size_] = 0x80;
  const std::size_t blocks = pending_size_ < 56 ? 1 : 2;
  for (int i = 0; i < 8; ++i) tail[64 * blocks - 1 - i] = static_cast<std::uint8_t>(bits >> (8 * i));
  compress_(state_.data(), tail.data(), blocks);
  Digest out;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<std::uint8_t>(state_[i] >> (24 - 8 * j));
  }
  return out;
}

void digest_runs(const std::uint8_t* prefix, std::size_t prefix_size, const std::uint8_t* data,
                 const std::int64_t* offsets, std::size_t n, std::uint8_t* out, unsigned threads,
                 Implementation implementation) {
  Hasher head(implementation);
  head.update(prefix, prefix_size);
  auto range = [&](std::size_t first, std::size_t last) {
    for (std::size_t i = first; i < last; ++i) {
      Hasher run = head;
      run.update(data + offsets[i], static_cast<std::size_t>(offsets[i + 1] - offsets[i]));
      const Digest d = run.digest();
      std::memcpy(out + 32 * i, d.data(), d.size());
    }
  };
  const std::size_t workers = std::max<std::size_t>(1, std::min<std::size_t>(threads, n / 4096 + 1));
  if (workers == 1) {
    range(0, n);
    return;
  }
  std::vector<std::thread> pool;
  const std::size_t step = (n + workers - 1) / workers;
  for (std::size_t first = 0; first < n; first += step) {
    pool.emplace_back(range, first, std::min(n, first + step));
  }
  for (auto& t : pool) t.join();
}

}  // namespace fabric::sha256
