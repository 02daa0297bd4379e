// NVLink push probe (sm_90, 2 GPUs with peer access): what bounds a row push, independent of our kernels.
// Both GPUs push 8192 rows of 14336 B (the DeepSeek-V3 row) into each other at once; best / worst of 10
// timed rounds (CUDA events, the slower GPU). Modes:
//   vec  blocks=B a=W        W warps per block push 16-byte vectors through registers (12 per lane in flight)
//   tma  blocks=B a=T b=S    T threads per block move rows via S shared-memory stages (bulk load + bulk store)
//   tmaF ... c=F             as tma, releasing a flag every F rows (wait for the batch's completion, then a
//                            system-scope fence and a flag store: the combine's per-batch flag cost)
// Build and run: nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/probes/nvlink_push_probe.cu -o /tmp/probe && /tmp/probe
// Results: docs/intranode.md (combine variant 3).
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

constexpr int ROWS = 8192, RB = 14336;

__device__ __forceinline__ uint32_t su(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__global__ void vec_push(const int4* src, int4* dst, int warps) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (w >= warps) return;
  const int gw = blockIdx.x * warps + w, nw = gridDim.x * warps;
  constexpr int NV = RB / 16, U = 12;
  for (int r = gw; r < ROWS; r += nw) {
    const int4* s = src + (int64_t)r * NV;
    int4* d = dst + (int64_t)r * NV;
    for (int i0 = lane; i0 < NV; i0 += 32 * U) {
      int4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) if (i0 + u * 32 < NV) v[u] = s[i0 + u * 32];
#pragma unroll
      for (int u = 0; u < U; ++u) if (i0 + u * 32 < NV) d[i0 + u * 32] = v[u];
    }
  }
}

// T issuing threads per block (one per warp), S stages each; flag_batch > 0: after every flag_batch rows wait for
// completion of all but the latest batch, fence.acq_rel.sys, store a flag (mimics the combine's per-batch flags).
__global__ void tma_push(const char* src, char* dst, uint32_t* flags, int T, int S, int flag_batch) {
  extern __shared__ __align__(128) char stage[];
  __shared__ __align__(8) uint64_t bar[4][16];
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (w >= T || lane != 0) return;
  char* st = stage + (int64_t)w * S * RB;
  for (int k = 0; k < S; ++k)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(su(&bar[w][k])));
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const int gw = blockIdx.x * T + w, nw = gridDim.x * T;
  const int n = (ROWS - gw + nw - 1) / nw;
  const int L = S > 4 ? S - 4 : S / 2;
  auto load = [&](int j) {
    const int k = j % S;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su(&bar[w][k])), "r"(RB) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(su(st + k * RB)), "l"(src + (int64_t)(gw + j * nw) * RB), "r"(RB), "r"(su(&bar[w][k])) : "memory");
  };
  int loaded = 0;
  for (; loaded < n && loaded < L; ++loaded) load(loaded);
  for (int j = 0; j < n; ++j) {
    const int k = j % S;
    uint32_t ok = 0;
    const uint32_t par = (j / S) & 1;
    while (!ok)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(ok) : "r"(su(&bar[w][k])), "r"(par) : "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(dst + (int64_t)(gw + j * nw) * RB), "r"(su(st + k * RB)), "r"(RB) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (flag_batch > 0 && (j + 1) % flag_batch == 0) {
      if (flag_batch == 1) asm volatile("cp.async.bulk.wait_group 1;" ::: "memory");
      else if (flag_batch == 4) asm volatile("cp.async.bulk.wait_group 4;" ::: "memory");
      else if (flag_batch == 16) asm volatile("cp.async.bulk.wait_group 16;" ::: "memory");
      else asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
      asm volatile("fence.acq_rel.sys;" ::: "memory");
      asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(flags + gw), "r"(j) : "memory");
    }
    if (loaded < n) {
      // the stage reused by the next load was stored S - L rows ago
      if (S - L >= 4) asm volatile("cp.async.bulk.wait_group.read 3;" ::: "memory");
      else if (S - L == 2) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      else asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      load(loaded++);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int main() {
  char *src[2], *dst[2];
  uint32_t* flags[2];
  for (int g = 0; g < 2; ++g) {
    CK(cudaSetDevice(g));
    CK(cudaDeviceEnablePeerAccess(1 - g, 0));
    CK(cudaMalloc(&src[g], (size_t)ROWS * RB));
    CK(cudaMalloc(&dst[g], (size_t)ROWS * RB));
    CK(cudaMalloc(&flags[g], 1 << 16));
    CK(cudaMemset(src[g], 1, (size_t)ROWS * RB));
    CK(cudaFuncSetAttribute(tma_push, cudaFuncAttributeMaxDynamicSharedMemorySize, 226 * 1024));
  }
  cudaStream_t s[2];
  cudaEvent_t e0[2], e1[2];
  for (int g = 0; g < 2; ++g) {
    CK(cudaSetDevice(g));
    CK(cudaStreamCreate(&s[g]));
    CK(cudaEventCreate(&e0[g]));
    CK(cudaEventCreate(&e1[g]));
  }
  auto run = [&](const char* name, int blocks, int a, int b, int c, bool tma) {
    float best = 1e9, worst = 0;
    for (int it = 0; it < 12; ++it) {
      for (int g = 0; g < 2; ++g) { CK(cudaSetDevice(g)); CK(cudaDeviceSynchronize()); }
      for (int g = 0; g < 2; ++g) {
        CK(cudaSetDevice(g));
        CK(cudaEventRecord(e0[g], s[g]));
        if (tma) tma_push<<<blocks, 128, (size_t)a * b * RB, s[g]>>>(src[g], dst[1 - g], flags[1 - g], a, b, c);
        else vec_push<<<blocks, 512, 0, s[g]>>>((const int4*)src[g], (int4*)dst[1 - g], a);
        CK(cudaGetLastError());
        CK(cudaEventRecord(e1[g], s[g]));
      }
      float ms[2];
      for (int g = 0; g < 2; ++g) { CK(cudaSetDevice(g)); CK(cudaEventSynchronize(e1[g])); CK(cudaEventElapsedTime(&ms[g], e0[g], e1[g])); }
      if (it >= 2) { float m = ms[0] > ms[1] ? ms[0] : ms[1]; best = m < best ? m : best; worst = m > worst ? m : worst; }
    }
    printf("%-4s blocks=%3d a=%2d b=%2d c=%3d  best %7.1f us  %6.1f GB/s  (worst %7.1f us)\n", name, blocks, a, b, c,
           best * 1e3, (double)ROWS * RB / (best * 1e-3) / 1e9, worst * 1e3);
  };
  for (int blocks : {16, 24, 32}) {
    for (int w : {4, 8, 12}) run("vec", blocks, w, 0, 0, false);
    for (int T : {1, 2, 4})
      for (int S : {2, 4, 8, 15}) {
        if (T * S * RB > 226 * 1024 || (S == 15 && T > 1)) continue;
        run("tma", blocks, T, S, 0, true);
      }
    for (int fb : {1, 4, 16}) run("tmaF", blocks, 2, 7, fb, true);
    for (int fb : {1, 4, 16}) run("tmaF", blocks, 1, 15, fb, true);
  }
  return 0;
}
