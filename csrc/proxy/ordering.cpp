#include "proxy/ordering.h"

#include <algorithm>

#include "common/check.h"

namespace uccl {

OrderingEmulator::OrderingEmulator(int world, SignalBlock signals, AtomicFn apply_atomic, uint32_t seq_bits)
    : world_(world), sig_(signals), apply_atomic_(std::move(apply_atomic)),
      expected_(size_t(world) * kMaxChannels, 0), pending_(size_t(world) * kMaxChannels) {
  if (seq_bits < 8 || seq_bits > kSeqBits) UCCL_THROW("ordering: " << seq_bits << " sequence bits outside [8, " << kSeqBits << "]");
  seq_mask_ = (1u << seq_bits) - 1;
  // An arrival more than half the sequence space ahead reads as one from the past: hold fewer than that.
  max_held_ = std::min(kMaxHeld, size_t(1) << (seq_bits - 1));
}

void OrderingEmulator::apply(int src, uint32_t ch, const Completion& c) {
  const size_t idx = size_t(src) * kMaxChannels + ch;
  if (c.kind == Completion::kAtomic && c.region != kNoRegion) apply_atomic_(c.region, c.offset, c.value, src);
  if (c.kind == Completion::kMarker) __atomic_fetch_add(&sig_.barrier_count[src], 1ull, __ATOMIC_RELEASE);
  if (c.kind == Completion::kArrival && imm_signal(c.imm)) __atomic_fetch_add(&sig_.imm_count[idx], 1ull, __ATOMIC_RELEASE);
  // The tail moves last: a reader that sees seq_tail >= k sees every effect of operations < k.
  __atomic_fetch_add(&sig_.seq_tail[idx], 1ull, __ATOMIC_RELEASE);
  ++applied_;
}

void OrderingEmulator::on_arrival(const Completion& c) {
  const uint32_t ch = imm_channel(c.imm);
  const uint32_t seq = imm_seq(c.imm) & seq_mask_;
  if (c.peer < 0 || c.peer >= world_) UCCL_THROW("ordering: arrival from unknown peer " << c.peer);
  if (ch >= uint32_t(kMaxChannels)) UCCL_THROW("ordering: arrival on channel " << ch << " >= " << kMaxChannels);
  const size_t idx = size_t(c.peer) * kMaxChannels + ch;
  uint64_t& exp = expected_[idx];
  const uint32_t dist = (seq - uint32_t(exp)) & seq_mask_;
  if (dist > (seq_mask_ >> 1))
    UCCL_THROW("ordering: duplicate or stale arrival from peer " << c.peer << " channel " << ch << " seq " << seq
               << " (next expected " << (exp & seq_mask_) << ")");
  auto& pend = pending_[idx];
  if (dist != 0) {
    if (pend.size() >= max_held_)
      UCCL_THROW("ordering: " << pend.size() << " arrivals from peer " << c.peer << " channel " << ch
                 << " wait for seq " << (exp & seq_mask_) << ", which never came (lost in the transport?)");
    if (!pend.emplace(exp + dist, c).second)
      UCCL_THROW("ordering: duplicate arrival from peer " << c.peer << " channel " << ch << " seq " << seq);
    ++out_of_order_;
    ++held_;
    return;
  }
  apply(c.peer, ch, c);
  ++exp;
  while (!pend.empty() && pend.begin()->first == exp) {
    Completion next = pend.begin()->second;
    pend.erase(pend.begin());
    --held_;
    apply(c.peer, ch, next);
    ++exp;
  }
}

}  // namespace uccl
