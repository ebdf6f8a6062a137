#include "byte_ring.h"

#include <utility>

namespace fabric {

ByteRing::ByteRing(std::uint64_t capacity, std::uint64_t alignment, std::string name)
    : capacity_(capacity), alignment_(alignment), name_(std::move(name)) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    throw std::invalid_argument("ring alignment must be a power of two, got " +
                                std::to_string(alignment));
  }
  if (capacity == 0 || capacity % alignment != 0) {
    throw std::invalid_argument("ring capacity " + std::to_string(capacity) +
                                " must be a positive multiple of the alignment " +
                                std::to_string(alignment));
  }
}

std::optional<Reservation> ByteRing::try_reserve(std::uint64_t length) {
  const std::uint64_t need = rounded(length == 0 ? 1 : length);
  if (need > capacity_) {
    throw std::length_error(name_ + ": a reservation of " + std::to_string(length) +
                            " bytes can never fit its " + std::to_string(capacity_) + " bytes");
  }
  const std::uint64_t head = load_relaxed(head_);  // only this thread writes head_
  // Acquire: the consumer's last read of the freed bytes comes before our reuse of them.
  const std::uint64_t tail = load_acquire(tail_);
  const std::uint64_t pos = head % capacity_;
  const std::uint64_t pad = pos + need > capacity_ ? capacity_ - pos : 0;
  if (head + pad + need - tail > capacity_) return std::nullopt;
  Reservation r{head, pad + need, (pos + pad) % capacity_, length};
  // Release: order the reservation's bookkeeping before the new head anyone may read.
  store_release(head_, head + r.span);
  return r;
}

void ByteRing::release(const Reservation& r) {
  const std::uint64_t tail = load_relaxed(tail_);  // only this thread writes tail_
  if (r.begin != tail) {
    throw std::logic_error(name_ + ": release out of order: expected a reservation at " +
                           std::to_string(tail) + ", got one at " + std::to_string(r.begin));
  }
  // Release: order our reads of the freed bytes before the producer may overwrite them.
  store_release(tail_, tail + r.span);
}

}  // namespace fabric
