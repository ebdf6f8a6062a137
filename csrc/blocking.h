// How threads wait for each other: a Gate that a waiter blocks on until a condition holds or the
// runtime shuts down, and the two waiting policies the runtime uses.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "atomics.h"

namespace fabric {

class Gate {
 public:
  // Wake every waiter so it re-checks its condition.
  void notify() {
    std::lock_guard<std::mutex> lock(mutex_);  // no lost wake-up: waiters check under the lock
    cv_.notify_all();
  }
  // Wake every waiter for good: waits return false from now on.
  void close() {
    // Release: order what the closer wrote first (e.g. the runtime's failure) before `closed`.
    store_release(closed_, true);
    notify();
  }
  // Acquire: a waiter that sees `closed` also sees what the closer wrote before closing.
  bool closed() const { return load_acquire(closed_); }

  // Blocks until `ready()` or close(); polls every `recheck` in case a notify is not coming
  // (conditions that the GPU changes by writing memory).
  template <typename Ready>
  bool block_until(Ready ready, std::chrono::microseconds recheck = std::chrono::milliseconds(1)) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!closed() && !ready()) cv_.wait_for(lock, recheck);
    return !closed();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<bool> closed_{false};
};

// The producer's policy on a full ring: 10 retries of 1 ms, then block. Returns false only on
// shutdown; `retried`/`blocked` count what happened, for statistics.
template <typename Ready>
bool wait_retry_then_block(Gate& gate, Ready ready, std::uint64_t& retried, std::uint64_t& blocked) {
  if (ready()) return true;
  for (int i = 0; i < 10; ++i) {
    if (gate.closed()) return false;
    ++retried;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (ready()) return true;
  }
  ++blocked;
  return gate.block_until(ready);
}

// The decode loop's backoff ladder when the drain falls behind: spin, yield, short sleeps,
// then block. It never gives up on data; it returns false only on shutdown.
template <typename Ready>
bool wait_ladder(Gate& gate, Ready ready, std::uint64_t& blocked,
                 std::chrono::microseconds recheck = std::chrono::microseconds(50)) {
  for (int i = 0; i < 256; ++i) {
    if (ready()) return true;
    cpu_relax();
  }
  for (int i = 0; i < 64; ++i) {
    if (ready()) return true;
    std::this_thread::yield();
  }
  for (int i = 0; i < 20; ++i) {
    if (gate.closed()) return false;
    if (ready()) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  ++blocked;
  return gate.block_until(ready, recheck);
}

}  // namespace fabric
