// GPU producers for the command rings (tests and the proxy benchmark). Host-callable launchers; the
// device side lives in ring_gpu.cu and uses only proxy/ring.h, as real kernels do.
#pragma once

#include "proxy/ring.h"

namespace uccl {

// Ring r receives cmds[offsets[r], offsets[r+1]) from `warps_per_ring` warps (32 commands per claim), after
// one ring_release_data() per thread (the commands reference region data).
void launch_push_commands(const RingDesc* d_rings, int num_rings, const Command* d_cmds, const int* d_offsets,
                          int warps_per_ring, void* stream);
// Every warp pushes `per_warp` OP_NOP commands (rounded up to 32) into ring (warp % num_rings).
void launch_push_nops(const RingDesc* d_rings, int num_rings, int warps_per_ring, int per_warp, void* stream);
constexpr int kPickupModes = 6;
// One thread: push OP_NOP(cookie_base + i) stamped with the globaltimer, spin until the proxy echoes it.
// d_out holds 4 words per iteration: start, publish, seen (globaltimer ns), pickup (proxy clock ticks).
// mode 0: fence + relaxed header, acquire polling; 1: relaxed polling; 2: slot claimed before the start
// stamp; 3: release-store header (the fenced ring_push's path); 4: the whole command in one 16-byte store,
// no fence (the vector publish); 5: an owned ring (RingProducer: no claim atomic, head in a register),
// published as the ring is configured. Details in ring_gpu.cu.
void launch_pickup_latency(RingDesc ring, int iters, unsigned cookie_base, unsigned long long* d_out, void* stream,
                           int mode = 0);
// globaltimer granularity probe: d_out[0] smallest step (ns), d_out[1] steps seen in `reads` reads, d_out[2] span.
void launch_timer_resolution(int reads, unsigned long long* d_out, void* stream);
// One thread: push `cmd` (a signalled write), spin until *counter reaches its next value; out_ns[i] in ns.
void launch_visibility_latency(RingDesc ring, Command cmd, const unsigned long long* counter, int iters,
                               unsigned long long* d_out_ns, void* stream);

}  // namespace uccl
