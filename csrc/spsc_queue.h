// The caller's hand-offs to the filler and to the drain: single-producer single-consumer queues
// of fixed capacity. Indices grow forever; entry i lives at i % capacity. The producer never
// overruns the consumer because the runtime admits at most max_in_flight batches (the queues'
// capacity) between submit and drain, so push never waits.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

namespace fabric {

template <class T>
class SpscQueue {
 public:
  void resize(std::size_t capacity) { entries_.resize(capacity); }
  std::vector<T>& entries() { return entries_; }  // set-up only (e.g. reserving capacity)

  // Producer: the entry the next push() publishes, filled in place.
  T& next() { return entries_[head_.load(std::memory_order_relaxed) % entries_.size()]; }
  // Producer: publish the entry next() returned.
  void push() {
    // Release: order the entry's contents before its index.
    head_.store(head_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  }

  // Consumer: how many entries were ever published; entries below it are readable.
  std::uint64_t published() const {
    return head_.load(std::memory_order_acquire);  // acquire: pairs with push(): contents visible
  }
  const T& at(std::uint64_t index) const { return entries_[index % entries_.size()]; }
  T& at(std::uint64_t index) { return entries_[index % entries_.size()]; }

 private:
  std::vector<T> entries_;
  std::atomic<std::uint64_t> head_{0};
};

}  // namespace fabric
