// GPU-side producers: warps claim ring slots and publish each 16-byte command the way the ring says
// (RingDesc::publish: one 16-byte store, or body + system-scope release store of the header; proxy/ring.h).
// Used by the GPU tests and `uccl-ep-train bench proxy`.
#include "common/check.h"
#include "proxy/ring_gpu.h"

namespace uccl {
namespace {

constexpr int kWarp = UCCL_WARP_SIZE;  // lanes that claim ring slots together (ring_push_warp)

__device__ __forceinline__ unsigned long long now_ns() {
#if defined(__HIP_PLATFORM_AMD__)
#if defined(__HIP_DEVICE_COMPILE__)
  return __builtin_amdgcn_s_memrealtime() * 10ull;  // 100 MHz constant clock on CDNA
#else
  return 0;  // host pass: never called
#endif
#else
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : : "memory");  // not moved across ring accesses
  return t;
#endif
}

__global__ void push_commands_kernel(const RingDesc* rings, const Command* cmds, const int* offsets, int warps_per_ring) {
  const int r = blockIdx.x;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const RingDesc ring = rings[r];
  const int begin = offsets[r], end = offsets[r + 1];
  // The commands reference region data: make it visible to the proxy (and its copy engine / NIC) before
  // any command is published, once per thread for the whole batch (vector rings order nothing themselves).
  // Here the payload was written before the launch; a kernel that writes it itself does the same after
  // its payload stores (and a __syncwarp/__syncthreads when other threads wrote it).
  ring_release_data();
  // Warp w takes batches w, w + W, w + 2W, ... of kWarp commands.
  for (int base = begin + warp * kWarp; base < end; base += warps_per_ring * kWarp) {
    const int i = base + lane;
    const bool has = i < end;
    Command c{};
    if (has) c = cmds[i];
    ring_push_warp(ring, c, has);
  }
}

__global__ void push_nops_kernel(const RingDesc* rings, int num_rings, int num_warps, int per_warp) {
  const int gwarp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  if (gwarp >= num_warps) return;  // whole warps only: the grid may be rounded up
  const RingDesc ring = rings[gwarp % num_rings];
  Command c{};
  c.op = OP_NOP;
  c.channel = uint8_t(gwarp % num_rings);
  for (int i = 0; i < per_warp; i += kWarp) {
    c.length = uint32_t(i);
    ring_push_warp(ring, c, true);
  }
}

// Pickup probe, one thread, `iters` round trips. Iteration i pushes OP_NOP(cookie_base + i) carrying its
// start time (local_off = low, remote_off = high 32 bits of the globaltimer) and spins until the proxy
// echoes the cookie. Stamps per iteration (out[4 i + k]):
//   k=0 start    globaltimer before the claim (the pickup latency counts from here)
//   k=1 publish  globaltimer after the body and the release fence, right before the header store (mode 4:
//                right before the one 16-byte store)
//   k=2 seen     globaltimer when the echo was seen (before any acquire fence)
//   k=3 pickup   the proxy's clock (ticks) when it picked the command up (echo[1], read after the acquire)
// [publish, seen] is the ping-pong used to calibrate the proxy's clock against the globaltimer: the
// fence is kept out of it so that both legs are one PCIe crossing plus a poll.
// mode 0: claim, fill, fence.acq_rel.sys, relaxed header store; poll with ld.acquire.sys
// mode 1: as 0, poll with ld.relaxed.sys and one acquire fence after the echo was seen
// mode 2: as 1 with the slot claimed before the start stamp (claim cost excluded)
// mode 3: claim, fill, st.release.sys header (the fenced ring_push's single-command path; the fence is
//         inside the store, so [publish, seen] carries it); poll with ld.acquire.sys
// mode 4: claim, the whole command (header with lap bit + body) in ONE 16-byte st.relaxed.sys.v4 store,
//         no fence (the vector publish, ring_push's path on vector rings); poll with ld.acquire.sys
// mode 5: a RingProducer that owns the ring for the whole probe: no claim atomic (head in a register),
//         the slot written as the ring is configured (vector: one 16-byte store); poll with ld.acquire.sys
__global__ void pickup_latency_kernel(RingDesc ring, int iters, unsigned cookie_base, unsigned long long* out, int mode) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  RingProducer owner;
  if (mode == 5) owner.open(ring);
  for (int i = 0; i < iters; ++i) {
    const unsigned cookie = cookie_base + unsigned(i);
    unsigned long long idx = 0;
    if (mode == 2) idx = ring_claim(ring, 1);
    const unsigned long long t0 = now_ns();
    if (mode != 2 && mode != 5) idx = ring_claim(ring, 1);
    Command c{};
    c.op = OP_NOP;
    c.length = cookie;
    c.local_off = uint32_t(t0);
    c.remote_off = uint32_t(t0 >> 32);
    unsigned long long tp;
    if (mode == 5) {
      tp = now_ns();
      owner.push(c);
    } else if (mode == 4) {
      tp = now_ns();
      ring_publish_vector(ring, idx, c);
    } else if (mode == 3) {
      ring_fill(ring, idx, c);
      tp = now_ns();
      ring_publish_release(ring, idx, c);
    } else {
      ring_fill(ring, idx, c);
      ring_fence_sys();
      tp = now_ns();
      ring_publish(ring, idx, c);
    }
    if (mode == 0 || mode >= 3) {
      while (ring_load_acquire_sys(ring.echo) != (unsigned long long)cookie) {
      }
    } else {
      while (ring_load_relaxed_sys(ring.echo) != (unsigned long long)cookie) {
      }
    }
    const unsigned long long ts = now_ns();
    if (mode == 1 || mode == 2) ring_fence_sys();  // acquire side of the relaxed poll
    const unsigned long long cpu = ring_load_relaxed_sys(ring.echo + 1);
    out[4 * i + 0] = t0;
    out[4 * i + 1] = tp;
    out[4 * i + 2] = ts;
    out[4 * i + 3] = cpu;
  }
  if (mode == 5) owner.close();
}

// globaltimer granularity: out[0] smallest non-zero step, out[1] number of steps, out[2] span (ns).
__global__ void timer_resolution_kernel(int reads, unsigned long long* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  unsigned long long prev = now_ns(), first = prev, min_step = ~0ull, steps = 0;
  for (int i = 0; i < reads; ++i) {
    const unsigned long long t = now_ns();
    if (t != prev) {
      const unsigned long long d = t - prev;
      if (d < min_step) min_step = d;
      ++steps;
      prev = t;
    }
  }
  out[0] = steps ? min_step : 0;
  out[1] = steps;
  out[2] = prev - first;
}

__global__ void visibility_latency_kernel(RingDesc ring, Command cmd, const unsigned long long* counter, int iters,
                                          unsigned long long* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  ring_release_data();  // the write's payload (written before the launch) visible before the first command
  unsigned long long seen = ring_load_acquire_sys(counter);
  for (int i = 0; i < iters; ++i) {
    const unsigned long long t0 = now_ns();
    ring_push(ring, &cmd, 1);
    while (ring_load_acquire_sys(counter) <= seen) {
    }
    seen = ring_load_acquire_sys(counter);
    out[i] = now_ns() - t0;
  }
}

}  // namespace

void launch_push_commands(const RingDesc* d_rings, int num_rings, const Command* d_cmds, const int* d_offsets,
                          int warps_per_ring, void* stream) {
  push_commands_kernel<<<num_rings, kWarp * warps_per_ring, 0, static_cast<gpuStream_t>(stream)>>>(d_rings, d_cmds, d_offsets,
                                                                                                 warps_per_ring);
  UCCL_CHECK_GPU(gpuGetLastError());
}

void launch_push_nops(const RingDesc* d_rings, int num_rings, int warps_per_ring, int per_warp, void* stream) {
  const int warps = num_rings * warps_per_ring;
  const int threads = kWarp * (warps < 8 ? warps : 8);
  const int blocks = (warps * kWarp + threads - 1) / threads;
  push_nops_kernel<<<blocks, threads, 0, static_cast<gpuStream_t>(stream)>>>(d_rings, num_rings, warps, per_warp);
  UCCL_CHECK_GPU(gpuGetLastError());
}

void launch_pickup_latency(RingDesc ring, int iters, unsigned cookie_base, unsigned long long* d_out, void* stream, int mode) {
  pickup_latency_kernel<<<1, kWarp, 0, static_cast<gpuStream_t>(stream)>>>(ring, iters, cookie_base, d_out, mode);
  UCCL_CHECK_GPU(gpuGetLastError());
}

void launch_timer_resolution(int reads, unsigned long long* d_out, void* stream) {
  timer_resolution_kernel<<<1, kWarp, 0, static_cast<gpuStream_t>(stream)>>>(reads, d_out);
  UCCL_CHECK_GPU(gpuGetLastError());
}

void launch_visibility_latency(RingDesc ring, Command cmd, const unsigned long long* counter, int iters,
                               unsigned long long* d_out_ns, void* stream) {
  visibility_latency_kernel<<<1, kWarp, 0, static_cast<gpuStream_t>(stream)>>>(ring, cmd, counter, iters, d_out_ns);
  UCCL_CHECK_GPU(gpuGetLastError());
}

}  // namespace uccl
