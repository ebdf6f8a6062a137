// A callable held by value in fixed inline storage, for work that runs later, possibly on another
// thread (a host function in stream order on the emulated GPU), without a heap allocation per
// call. std::function may allocate to hold a lambda's captures (libstdc++ keeps only 16 bytes
// inline); FunctionRef refers to a callable that must outlive it, which work run later cannot
// promise. InlineFunction copies the captures into itself instead.
//
// Only callables that copy as bytes fit: trivially copyable and destructible, at most Capacity
// bytes (captures of pointers and numbers). A lambda capturing a std::string or a shared_ptr is a
// compile error, not a hidden allocation.
#pragma once

#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>

namespace fabric {

template <class Signature, std::size_t Capacity = 64>
class InlineFunction;

template <class R, class... Args, std::size_t Capacity>
class InlineFunction<R(Args...), Capacity> {
 public:
  InlineFunction() = default;

  template <class F, class D = std::decay_t<F>,
            class = std::enable_if_t<!std::is_same_v<D, InlineFunction>>>
  InlineFunction(F&& f) noexcept  // NOLINT(google-explicit-constructor): used like std::function
  {
    static_assert(sizeof(D) <= Capacity, "the callable's captures do not fit InlineFunction");
    static_assert(alignof(D) <= alignof(std::max_align_t), "the callable is over-aligned");
    static_assert(std::is_trivially_copyable_v<D> && std::is_trivially_destructible_v<D>,
                  "InlineFunction holds callables that copy as bytes: capture pointers and "
                  "numbers, not owning objects");
    ::new (static_cast<void*>(storage_)) D(std::forward<F>(f));
    call_ = [](const void* object, Args... args) -> R {
      return (*std::launder(static_cast<const D*>(object)))(std::forward<Args>(args)...);
    };
  }

  explicit operator bool() const { return call_ != nullptr; }
  R operator()(Args... args) const { return call_(storage_, std::forward<Args>(args)...); }

 private:
  alignas(std::max_align_t) unsigned char storage_[Capacity] = {};
  R (*call_)(const void*, Args...) = nullptr;
};

}  // namespace fabric
