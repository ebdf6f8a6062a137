#include "allocations.h"

#include <atomic>
#include <cstdlib>
#include <new>

#include "atomics.h"

namespace fabric {
namespace {

std::atomic<std::uint64_t> g_allocations{0};
thread_local int t_uncounted = 0;

void* counted_malloc(std::size_t bytes) {
  if (t_uncounted == 0) add_relaxed(g_allocations, 1);  // a count: orders nothing
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}

}  // namespace

std::uint64_t allocations() { return load_relaxed(g_allocations); }
UncountedAllocations::UncountedAllocations() { ++t_uncounted; }
UncountedAllocations::~UncountedAllocations() { --t_uncounted; }

}  // namespace fabric

// The replaceable allocation functions, for this module's code (the extension is loaded with its
// own symbol scope). Over-aligned requests keep the standard library's versions.
void* operator new(std::size_t bytes) { return fabric::counted_malloc(bytes); }
void* operator new[](std::size_t bytes) { return fabric::counted_malloc(bytes); }
void* operator new(std::size_t bytes, const std::nothrow_t&) noexcept {
  try {
    return fabric::counted_malloc(bytes);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t bytes, const std::nothrow_t&) noexcept {
  try {
    return fabric::counted_malloc(bytes);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
