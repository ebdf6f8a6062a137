// Memory-ordering helpers of the runtime, in one place: no other file spells a memory order or a
// __atomic builtin. Every use site says in one line what it orders. The host writes payloads into
// write-combined (WC) mapped memory that the GPU reads over PCIe, and reads counters that the GPU
// writes into ordinary mapped memory; between host threads the same helpers take std::atomic.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace fabric {

namespace detail {
template <class T>
struct NoDeduce {
  using type = T;
};
}  // namespace detail

// Drains the write-combining buffers: every store before it (WC included) becomes globally
// visible before any store after it. A release store alone does not cover WC memory.
inline void store_fence() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_sfence();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

// ---- words shared with the device (mapped memory), or plain words shared between threads ----

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

// ---- std::atomic between host threads: the same three orders, and relaxed counting ----------

// Publishes `value` to another thread: every earlier write is visible to whoever acquires it.
template <class T>
inline void store_release(std::atomic<T>& where, typename detail::NoDeduce<T>::type value) {
  where.store(value, std::memory_order_release);
}

// Reads a value another thread published with store_release, and everything written before it.
template <class T>
inline T load_acquire(const std::atomic<T>& where) {
  return where.load(std::memory_order_acquire);
}

// No ordering: a statistic, or a value only this thread writes.
template <class T>
inline T load_relaxed(const std::atomic<T>& where) {
  return where.load(std::memory_order_relaxed);
}
template <class T>
inline void store_relaxed(std::atomic<T>& where, typename detail::NoDeduce<T>::type value) {
  where.store(value, std::memory_order_relaxed);
}
// A counter nobody synchronises on; returns the value before the addition.
template <class T>
inline T add_relaxed(std::atomic<T>& counter, typename detail::NoDeduce<T>::type delta) {
  return counter.fetch_add(delta, std::memory_order_relaxed);
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
