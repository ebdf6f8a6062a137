// Exact byte accounting of a ring: one producer reserves, one consumer releases, in FIFO order.
//
// Positions are absolute byte counters (they never wrap); the offset inside the ring is the
// counter modulo the capacity. A reservation never splits across the end: when it would, the
// bytes up to the end are skipped and charged to that reservation (its `span`), and are freed
// with it. No byte is ever owned by nobody, which is how rings deadlock ("ghost bytes").
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "atomics.h"

namespace fabric {

struct Reservation {
  std::uint64_t begin = 0;   // absolute position where this reservation's span starts
  std::uint64_t span = 0;    // bytes charged: wrap padding + length rounded to the alignment
  std::uint64_t offset = 0;  // where the payload starts inside the ring
  std::uint64_t length = 0;  // payload bytes asked for
  std::uint64_t end() const { return begin + span; }
};

class ByteRing {
 public:
  ByteRing(std::uint64_t capacity, std::uint64_t alignment, std::string name = "ring");

  // Producer: the next reservation, or nothing if it does not fit now. Throws if it could never
  // fit (longer than the ring).
  std::optional<Reservation> try_reserve(std::uint64_t length);
  // Consumer: frees `r`; reservations must be released in the order they were made.
  void release(const Reservation& r);

  std::uint64_t capacity() const { return capacity_; }
  std::uint64_t alignment() const { return alignment_; }
  // Acquire: a reservation's bytes are recorded before its head is seen (either side may ask).
  std::uint64_t head() const { return load_acquire(head_); }
  // Acquire: the consumer's last use of released bytes comes before the tail that frees them.
  std::uint64_t tail() const { return load_acquire(tail_); }
  std::uint64_t used() const { return head() - tail(); }
  // Bytes a reservation of `length` would take, ignoring wrap padding.
  std::uint64_t rounded(std::uint64_t length) const {
    return (length + alignment_ - 1) / alignment_ * alignment_;
  }

 private:
  std::uint64_t capacity_;
  std::uint64_t alignment_;
  std::string name_;
  std::atomic<std::uint64_t> head_{0};  // written by the producer only
  std::atomic<std::uint64_t> tail_{0};  // written by the consumer only
};

}  // namespace fabric
