// GPU-side producers: warps claim ring slots, write 16-byte commands and publish them with one system
// fence per warp batch (proxy/ring.h). Used by the GPU tests and `uccl-ep-train bench proxy`.
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
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

__global__ void push_commands_kernel(const RingDesc* rings, const Command* cmds, const int* offsets, int warps_per_ring) {
  const int r = blockIdx.x;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const RingDesc ring = rings[r];
  const int begin = offsets[r], end = offsets[r + 1];
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

__device__ __forceinline__ unsigned long long load_volatile(const unsigned long long* p) {
  return *reinterpret_cast<const volatile unsigned long long*>(p);
}

// mode 0: ring_push (claim atomic + fence + header), poll the echo with acquire loads
// mode 1: ring_push, poll with volatile loads (fence once after)
// mode 2: slot claimed before the clock starts; fill + fence + header, volatile polling
__global__ void pickup_latency_kernel(RingDesc ring, int iters, unsigned long long* out, int mode) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  for (int i = 0; i < iters; ++i) {
    Command c{};
    c.op = OP_NOP;
    c.length = uint32_t(i + 1);
    const unsigned long long want = (unsigned long long)(i + 1);
    unsigned long long idx = 0;
    if (mode == 2) idx = ring_claim(ring, 1);
    const unsigned long long t0 = now_ns();
    if (mode == 2) {
      ring_fill(ring, idx, c);
      ring_fence_sys();
      ring_publish(ring, idx, c);
    } else {
      ring_push(ring, &c, 1);
    }
    if (mode == 0) {
      while (ring_load_acquire_sys(ring.echo) != want) {
      }
    } else {
      while (load_volatile(ring.echo) != want) {
      }
      __threadfence_system();
    }
    out[i] = now_ns() - t0;
  }
}

__global__ void visibility_latency_kernel(RingDesc ring, Command cmd, const unsigned long long* counter, int iters,
                                          unsigned long long* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
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

void launch_pickup_latency(RingDesc ring, int iters, unsigned long long* d_out_ns, void* stream, int mode) {
  pickup_latency_kernel<<<1, kWarp, 0, static_cast<gpuStream_t>(stream)>>>(ring, iters, d_out_ns, mode);
  UCCL_CHECK_GPU(gpuGetLastError());
}

void launch_visibility_latency(RingDesc ring, Command cmd, const unsigned long long* counter, int iters,
                               unsigned long long* d_out_ns, void* stream) {
  visibility_latency_kernel<<<1, kWarp, 0, static_cast<gpuStream_t>(stream)>>>(ring, cmd, counter, iters, d_out_ns);
  UCCL_CHECK_GPU(gpuGetLastError());
}

}  // namespace uccl
