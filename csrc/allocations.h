// Counts the module's heap allocations (operator new), so a test can show that the hot loop
// allocates nothing per batch once warmed up.
#pragma once

#include <cstdint>

namespace fabric {

// operator new calls made by this module's code so far, outside UncountedAllocations scopes.
std::uint64_t allocations();

// Allocations in this scope (on this thread) are not counted: the emulated GPU stands in for the
// driver, whose own allocations are not ours to count either.
class UncountedAllocations {
 public:
  UncountedAllocations();
  ~UncountedAllocations();
  UncountedAllocations(const UncountedAllocations&) = delete;
  UncountedAllocations& operator=(const UncountedAllocations&) = delete;
};

}  // namespace fabric
