// OrderingEmulator: in-order application of remote arrivals for transports that deliver out of order
// (EFA SRD, fault injection) or have no atomics.
//
// Every operation from (source rank, channel) carries a sequence number in its immediate (24 bits, or the
// low 17 where the transport packs the writer's rank into 4-byte CQ data: Transport::imm_seq_bits). The
// receiver applies effects strictly in sequence order: arrivals ahead of the next expected number wait
// in a small per-(source, channel) window; each applied arrival advances seq_tail[src][channel] (release
// store into GPU-visible memory), a signalled write also advances imm_count[src][channel], an emulated
// atomic becomes an ordered local add, and a barrier marker advances barrier_count[src]. Duplicates and
// arrivals from the far past are errors, so "exactly once" is checked, not assumed.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "proxy/ring.h"
#include "transport/transport.h"

namespace uccl {

// GPU-visible arrival state (host memory, mapped for the GPU), one block per process.
//   seq_tail[src * kMaxChannels + ch], imm_count[...], barrier_count[src]
struct SignalBlock {
  unsigned long long* seq_tail = nullptr;
  unsigned long long* imm_count = nullptr;
  unsigned long long* barrier_count = nullptr;
  int world = 0;
};

class OrderingEmulator {
 public:
  // Arrivals one (source, channel) may hold while it waits for an earlier one: far more than a sender keeps
  // in flight on a channel (its ring, ProxyConfig::ring_capacity = 2048 commands by default), so a gap this
  // large means an arrival was lost; the emulator fails instead of growing without bound.
  static constexpr size_t kMaxHeld = size_t(1) << 16;

  // apply_atomic(region, offset, value) performs the local add; it runs in sequence order.
  using AtomicFn = std::function<void(uint32_t region, uint64_t offset, int64_t value, int src)>;

  // seq_bits: how many low bits of the sequence number the transport delivers (Transport::imm_seq_bits).
  OrderingEmulator(int world, SignalBlock signals, AtomicFn apply_atomic, uint32_t seq_bits = kSeqBits);

  // Feeds one remote completion (kArrival / kAtomic / kMarker). Throws on duplicates or bad channels.
  void on_arrival(const Completion& c);

  uint64_t applied() const { return applied_; }
  uint64_t out_of_order() const { return out_of_order_; }  // arrivals that had to wait
  size_t waiting() const { return held_; }               // arrivals held right now (read every proxy step)

 private:
  void apply(int src, uint32_t ch, const Completion& c);
  int world_;
  SignalBlock sig_;
  AtomicFn apply_atomic_;
  uint32_t seq_mask_;                                    // (1 << seq_bits) - 1
  size_t max_held_;                                      // kMaxHeld, below half the sequence space
  std::vector<uint64_t> expected_;                       // applied count per (src, ch); low bits = next seq
  std::vector<std::map<uint64_t, Completion>> pending_;  // held arrivals keyed by unwrapped sequence
  uint64_t applied_ = 0;
  uint64_t out_of_order_ = 0;
  size_t held_ = 0;  // the pending_ maps' sizes summed, kept as they change
};

}  // namespace uccl
