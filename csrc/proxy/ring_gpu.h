// GPU producers for the command rings (tests and the proxy benchmark). Host-callable launchers; the
// device side lives in ring_gpu.cu and uses only proxy/ring.h, as real kernels do.
#pragma once

#include "proxy/ring.h"

namespace uccl {

// Ring r receives cmds[offsets[r], offsets[r+1]) from `warps_per_ring` warps (32 commands per claim).
void launch_push_commands(const RingDesc* d_rings, int num_rings, const Command* d_cmds, const int* d_offsets,
                          int warps_per_ring, void* stream);
// Every warp pushes `per_warp` OP_NOP commands (rounded up to 32) into ring (warp % num_rings).
void launch_push_nops(const RingDesc* d_rings, int num_rings, int warps_per_ring, int per_warp, void* stream);
// One thread: push OP_NOP(cookie i+1), spin until the proxy echoes it; out_ns[i] = round trip in ns.
// mode 0: full push + acquire polling; 1: full push + volatile polling; 2: pre-claimed slot + volatile.
void launch_pickup_latency(RingDesc ring, int iters, unsigned long long* d_out_ns, void* stream, int mode = 0);
// One thread: push `cmd` (a signalled write), spin until *counter reaches its next value; out_ns[i] in ns.
void launch_visibility_latency(RingDesc ring, Command cmd, const unsigned long long* counter, int iters,
                               unsigned long long* d_out_ns, void* stream);

}  // namespace uccl
