// A non-owning reference to a callable, for callbacks that live only for the duration of a call.
// std::function may allocate to hold a lambda's captures; FunctionRef never does.
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

namespace fabric {

template <class Signature>
class FunctionRef;

template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  // Refers to `f`, which must outlive this reference (lvalues only, so no temporary can dangle).
  template <class F, class = std::enable_if_t<!std::is_same_v<std::remove_cv_t<F>, FunctionRef>>>
  FunctionRef(F& f) noexcept  // NOLINT(google-explicit-constructor): used like std::function
      : object_(static_cast<void*>(std::addressof(f))),
        call_([](void* object, Args... args) -> R {
          return (*static_cast<F*>(object))(std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  R (*call_)(void*, Args...);
};

}  // namespace fabric
