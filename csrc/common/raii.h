// RAII helpers: a move-only owner for C handles (verbs, libfabric, CUDA) and a scope guard.
#pragma once

#include <cstdio>
#include <exception>
#include <utility>

namespace uccl {

// Owns a handle `T` and releases it with `Release` (a callable taking T, returning anything).
// Release errors are reported to stderr, never thrown: destructors run during error unwinding.
template <typename T, typename Release>
class Owned {
 public:
  Owned() = default;
  Owned(T h, Release r) : h_(h), r_(std::move(r)), live_(true) {}
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  Owned(Owned&& o) noexcept : h_(o.h_), r_(std::move(o.r_)), live_(o.live_) { o.live_ = false; }
  Owned& operator=(Owned&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = o.h_;
      r_ = std::move(o.r_);
      live_ = o.live_;
      o.live_ = false;
    }
    return *this;
  }
  ~Owned() { reset(); }
  void reset() {
    if (live_) {
      live_ = false;
      r_(h_);
    }
  }
  T get() const { return h_; }
  explicit operator bool() const { return live_; }

 private:
  T h_{};
  Release r_{};
  bool live_ = false;
};

template <typename T, typename Release>
Owned<T, Release> own(T h, Release r) {
  return Owned<T, Release>(h, std::move(r));
}

// Runs a callable at scope exit unless dismissed.
template <typename F>
class ScopeGuard {
 public:
  explicit ScopeGuard(F f) : f_(std::move(f)) {}
  ScopeGuard(const ScopeGuard&) = delete;
  ScopeGuard& operator=(const ScopeGuard&) = delete;
  ~ScopeGuard() {
    if (armed_) f_();
  }
  void dismiss() { armed_ = false; }

 private:
  F f_;
  bool armed_ = true;
};

// Report (not throw) a failed release during teardown.
inline void warn_release(const char* what, int rc) {
  if (rc != 0) std::fprintf(stderr, "uccl_ep_train native: %s failed during teardown (rc=%d)\n", what, rc);
}

}  // namespace uccl

#include "common/portability.h"
#if UCCL_EP_WITH_GPU
namespace uccl {
inline void warn_release_gpu(gpuError_t e) {
  std::fprintf(stderr, "uccl_ep_train native: GPU release failed during teardown: %s\n", gpuGetErrorString(e));
}
}  // namespace uccl
#endif
