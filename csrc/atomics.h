// Memory-ordering helpers of the runtime, in one place. Every use site says in one line what it
// orders. The host writes payloads into write-combined (WC) mapped memory that the GPU reads over
// PCIe, and reads counters that the GPU writes into ordinary mapped memory.
#pragma once

#include <cstdint>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace fabric {

// Drains the write-combining buffers: every store before it (WC included) becomes globally
// visible before any store after it. A release store alone does not cover WC memory.
inline void store_fence() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_sfence();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

// Publishes `value` to the other side (thread or device): no earlier store may pass it.
inline void store_release(volatile std::uint64_t* where, std::uint64_t value) {
  __atomic_store_n(where, value, __ATOMIC_RELEASE);
}

// Reads a counter the other side published: no later load may move before it.
inline std::uint64_t load_acquire(const volatile std::uint64_t* where) {
  return __atomic_load_n(where, __ATOMIC_ACQUIRE);
}

// Plain relaxed read, for counters only this thread writes or for statistics.
inline std::uint64_t load_relaxed(const volatile std::uint64_t* where) {
  return __atomic_load_n(where, __ATOMIC_RELAXED);
}

// A polite spin: tells the core we are waiting.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace fabric
