// The caller's hand-offs to the filler and to the drain: single-producer single-consumer queues
// of fixed capacity. Indices grow forever; entry i lives at i % capacity. The producer never
// overruns the consumer because the runtime admits at most max_in_flight batches (the queues'
// capacity) between submit and drain, so push never waits.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "atomics.h"

namespace fabric {

template <class T>
class SpscQueue {
 public:
  void resize(std::size_t capacity) { entries_.resize(capacity); }
  std::vector<T>& entries() { return entries_; }  // set-up only (e.g. reserving capacity)

  // Producer: the entry the next push() publishes, filled in place.
  T& next() { return entries_[load_relaxed(head_) % entries_.size()]; }  // only we write head_
  // Producer: publish the entry next() returned.
  void push() {
    // Release: order the entry's contents before its index.
    store_release(head_, load_relaxed(head_) + 1);
  }

  // Consumer: how many entries were ever published; entries below it are readable.
  std::uint64_t published() const {
    // Acquire: pairs with push()'s release: the contents of entries below it are visible.
    return load_acquire(head_);
  }
  const T& at(std::uint64_t index) const { return entries_[index % entries_.size()]; }
  T& at(std::uint64_t index) { return entries_[index % entries_.size()]; }

 private:
  std::vector<T> entries_;
  std::atomic<std::uint64_t> head_{0};
};

}  // namespace fabric
