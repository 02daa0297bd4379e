#include "proxy/fault.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace uccl {

FaultSpec FaultSpec::parse(const std::string& s) {
  FaultSpec f;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    auto eq = item.find('=');
    if (eq == std::string::npos) throw std::invalid_argument("UCCL_EP_FAULT: expected key=value, got '" + item + "'");
    std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    try {
      if (k == "reorder") f.reorder = std::stod(v);
      else if (k == "delay_us") f.delay_us = std::stod(v);
      else if (k == "seed") f.seed = std::stoull(v);
      else if (k == "die_after") f.die_after = std::stoull(v);
      else throw std::invalid_argument("UCCL_EP_FAULT: unknown key '" + k +
                                       "' (known: reorder, delay_us, seed, die_after)");
    } catch (const std::invalid_argument& e) {
      if (std::string(e.what()).rfind("UCCL_EP_FAULT", 0) == 0) throw;
      throw std::invalid_argument("UCCL_EP_FAULT: bad value for " + k + ": '" + v + "'");
    }
  }
  if (f.reorder < 0.0 || f.reorder > 1.0) throw std::invalid_argument("UCCL_EP_FAULT: reorder must be in [0, 1]");
  if (f.delay_us < 0.0) throw std::invalid_argument("UCCL_EP_FAULT: delay_us must be >= 0");
  return f;
}

std::string FaultSpec::str() const {
  std::ostringstream os;
  os << "reorder=" << reorder << ",delay_us=" << delay_us << ",seed=" << seed;
  if (die_after) os << ",die_after=" << die_after;
  return os.str();
}

void FaultInjector::process(const Completion* in, int n, std::vector<Completion>& out) {
  ++round_;
  const auto now = std::chrono::steady_clock::now();
  std::uniform_real_distribution<double> u(0.0, 1.0);
  // Fresh completions first: each is either passed on or held back.
  for (int i = 0; i < n; ++i) {
    if (spec_.enabled() && u(rng_) < spec_.reorder) {
      const double d = spec_.delay_us * (0.5 + u(rng_));
      held_.push_back({in[i], now + std::chrono::nanoseconds(int64_t(d * 1000.0)), round_});
      ++held_total_;
    } else {
      out.push_back(in[i]);
    }
  }
  // Then held ones whose time has come (never in the round they were held), in shuffled order.
  std::vector<Completion> due;
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->round < round_ && it->release <= now) {
      due.push_back(it->c);
      it = held_.erase(it);
    } else {
      ++it;
    }
  }
  std::shuffle(due.begin(), due.end(), rng_);
  out.insert(out.end(), due.begin(), due.end());
}

}  // namespace uccl
