// Fault injection: UCCL_EP_FAULT="reorder=P,delay_us=D,seed=S" holds back each completion with
// probability P for about D microseconds (0.5..1.5 D; at least one poll round), so completions reach the
// proxy out of order and late. Applied to the completions of every transport, local and remote alike.
// "die_after=N" makes a proxy thread fail (an error, as a crashed thread would leave) once it has taken N
// commands from its ring: what the GPU side does when its proxy dies is then testable.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace uccl {

struct FaultSpec {
  double reorder = 0.0;
  double delay_us = 0.0;
  uint64_t seed = 0;
  uint64_t die_after = 0;  // 0: never
  bool enabled() const { return reorder > 0.0; }
  static FaultSpec parse(const std::string& s);  // throws std::invalid_argument naming the bad key
  std::string str() const;
};

class FaultInjector {
 public:
  explicit FaultInjector(const FaultSpec& spec, uint64_t stream = 0)
      : spec_(spec), rng_(spec.seed * 0x9E3779B97F4A7C15ull + stream + 1) {}

  bool enabled() const { return spec_.enabled(); }

  // Takes this round's fresh completions (in place) and returns, in `out`, what the proxy sees now.
  void process(const Completion* in, int n, std::vector<Completion>& out);
  bool holding() const { return !held_.empty(); }
  uint64_t held_total() const { return held_total_; }

 private:
  struct Held {
    Completion c;
    std::chrono::steady_clock::time_point release;
    uint64_t round;
  };
  FaultSpec spec_;
  std::mt19937_64 rng_;
  std::deque<Held> held_;
  uint64_t round_ = 0;
  uint64_t held_total_ = 0;
};

}  // namespace uccl
