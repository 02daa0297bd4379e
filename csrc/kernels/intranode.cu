// Intranode (NVLink / xGMI) high-throughput kernels: notify (counts exchange), push dispatch, push combine.
//
// Every rank's buffer (see device_utils.cuh for the header) is mapped into every other rank through IPC.
// Each op (notify, dispatch, combine) follows one protocol, per block:
//   1. wait until every peer has finished reading its buffer in the previous op (free_ counters)
//   2. push: write each token once per destination rank straight into its final row of the receiver's
//      buffer (rows from rank s land after the rows of ranks < s, in source token order: DeepEP's order)
//   3. signal arrival to every peer, wait for the arrivals of every peer's blocks
//   4. copy out (dispatch) / reduce (combine) from the own buffer, then signal "free" to every peer.
// No queues, no atomics on data, deterministic order. Rows for the own rank skip the buffer entirely.
#include <type_traits>

#include "common/check.h"
#include "kernels/launch.cuh"

#if defined(UCCL_EP_WITH_HIP)
#include <hip/hip_fp16.h>
#else
#include <cuda_fp16.h>
#endif

namespace uccl_ep::intranode {

__device__ __forceinline__ void warp_sync() {
#if defined(UCCL_EP_WITH_HIP)
  __builtin_amdgcn_wave_barrier();
#else
  __syncwarp();
#endif
}

template <typename V>
__device__ __forceinline__ V load_stream(const V* p) {
  return *p;
}
template <>
__device__ __forceinline__ int4 load_stream<int4>(const int4* p) {
  return ld_nc_v4(p);
}

// One warp copies a row of `nbytes` (a multiple of sizeof(V)) from `src` to each of `dsts[0..ndst)`:
// the row is read once, stored ndst times.
template <typename V>
__device__ __forceinline__ void warp_push_row(const char* src, int64_t nbytes, char* const* dsts, int ndst,
                                              int lane) {
  constexpr int U = 16 / sizeof(V) >= 4 ? 4 : 4;  // vectors in flight per lane
  const int n = (int)(nbytes / (int64_t)sizeof(V));
  const V* s = reinterpret_cast<const V*>(src);
  for (int base = lane; base < n; base += kWarpSize * U) {
    V v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + u * kWarpSize;
      if (i < n) v[u] = load_stream<V>(s + i);
    }
    for (int j = 0; j < ndst; ++j) {
      V* d = reinterpret_cast<V*>(dsts[j]);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * kWarpSize;
        if (i < n) d[i] = v[u];
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------ notify
__global__ void __launch_bounds__(kNotifyThreads) notify_kernel(NotifyArgs a) {
  const int R = a.num_ranks, me = a.rank, tid = threadIdx.x, N = a.num_tokens;
  const int epr = a.num_experts / R;
  char* my = a.peers.p[me];
  uint64_t* arrive = reinterpret_cast<uint64_t*>(my + kArriveOffset);
  uint64_t* free_ = reinterpret_cast<uint64_t*>(my + kFreeOffset);
  __shared__ int s_scan[kMaxRanks][kNotifyThreads];
  __shared__ int s_lane[kMaxRanks][kWarpSize];
  __shared__ int s_counts[kMaxRanks][kMaxRanks];

  if (tid < R && tid != me) wait_geq(&free_[tid], a.sig.base, a.sig.timeout_cycles, a.sig.err, a.sig.claim, me, tid, kPhaseNotify);
  __syncthreads();

  // Push this rank's counts into slot [me] of every rank (own included): per-rank counts, then the
  // destination's local experts.
  for (int r = 0; r < R; ++r) {
    int* slot = reinterpret_cast<int*>(a.peers.p[r] + kCountsOffset) + (int64_t)me * kCountsSlotInts;
    for (int i = tid; i < R + epr; i += blockDim.x) slot[i] = i < R ? a.per_rank[i] : a.per_expert[r * epr + i - R];
  }

  // send_pos[t][r]: exclusive prefix over tokens of is_token_in_rank[:, r]; each thread owns a token chunk.
  const int chunk = (N + (int)blockDim.x - 1) / (int)blockDim.x;
  const int t0 = min(N, tid * chunk), t1 = min(N, t0 + chunk);
  int run[kMaxRanks];
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) run[r] = 0;
  for (int t = t0; t < t1; ++t) {
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r)
      if (r < R) run[r] += a.in_rank[(int64_t)t * R + r] ? 1 : 0;
  }
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r)
    if (r < R) s_scan[r][tid] = run[r];
  __syncthreads();
  {
    constexpr int kPerLane = kNotifyThreads / kWarpSize;
    const int w = tid / kWarpSize, lane = tid % kWarpSize;
    if (w < R) {
      int s = 0;
      for (int i = 0; i < kPerLane; ++i) s += s_scan[w][lane * kPerLane + i];
      s_lane[w][lane] = s;
    }
    __syncthreads();
    if (tid < R) {
      int acc = 0;
      for (int l = 0; l < kWarpSize; ++l) {
        const int v = s_lane[tid][l];
        s_lane[tid][l] = acc;
        acc += v;
      }
    }
    __syncthreads();
    if (w < R) {
      int acc = s_lane[w][lane];
      for (int i = 0; i < kPerLane; ++i) {
        const int v = s_scan[w][lane * kPerLane + i];
        s_scan[w][lane * kPerLane + i] = acc;
        acc += v;
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r)
    if (r < R) run[r] = s_scan[r][tid];
  for (int t = t0; t < t1; ++t) {
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r)
      if (r < R) a.send_pos[(int64_t)t * R + r] = a.in_rank[(int64_t)t * R + r] ? run[r]++ : -1;
  }

  __threadfence_system();
  __syncthreads();
  if (tid == 0)
    for (int r = 0; r < R; ++r)
      if (r != me) signal_add(reinterpret_cast<uint64_t*>(a.peers.p[r] + kArriveOffset) + me);
  if (tid < R && tid != me)
    wait_geq(&arrive[tid], a.sig.base + 1, a.sig.timeout_cycles, a.sig.err, a.sig.claim, me, tid, kPhaseNotify);
  __syncthreads();

  const volatile int* slots = reinterpret_cast<const volatile int*>(my + kCountsOffset);
  if (tid < R * R) s_counts[tid / R][tid % R] = slots[(int64_t)(tid / R) * kCountsSlotInts + tid % R];
  __syncthreads();
  if (tid < R) {
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      acc += s_counts[s][tid];
      a.info[s * R + tid] = acc;
    }
    if (tid == me && a.num_worst_tokens > 0 && acc > a.num_worst_tokens)
      report_error(a.sig.err, a.sig.claim, kErrWorstTokens, me, -1, kPhaseNotify, acc, a.num_worst_tokens);
  }
  for (int e = tid; e < epr; e += blockDim.x) {
    int acc = 0;
    for (int s = 0; s < R; ++s) acc += slots[(int64_t)s * kCountsSlotInts + R + e];
    a.info[R * R + e] = acc;
  }
  __syncthreads();
  if (tid == 0)
    for (int r = 0; r < R; ++r)
      if (r != me) signal_add(reinterpret_cast<uint64_t*>(a.peers.p[r] + kFreeOffset) + me);
}

// ---------------------------------------------------------------------------------------------- dispatch
template <typename V>
__global__ void __launch_bounds__(kDispatchThreads) dispatch_kernel(DispatchArgs a) {
  constexpr int kWarps = kDispatchThreads / kWarpSize;
  const int R = a.num_ranks, me = a.rank, tid = threadIdx.x, w = tid / kWarpSize, lane = tid % kWarpSize;
  const int K = a.num_topk, epr = a.experts_per_rank;
  char* my = a.peers.p[me];
  uint64_t* arrive = reinterpret_cast<uint64_t*>(my + kArriveOffset);
  uint64_t* free_ = reinterpret_cast<uint64_t*>(my + kFreeOffset);
  __shared__ int s_P[kMaxRanks * kMaxRanks];
  __shared__ int s_lo[kMaxRanks], s_hi[kMaxRanks], s_dstlo[kMaxRanks];
  __shared__ int s_skip;
  __shared__ char* s_dx[kWarps][kMaxRanks];
  __shared__ int s_dr[kWarps][kMaxRanks], s_ds[kWarps][kMaxRanks], s_nd[kWarps];

  if (tid < R * R) s_P[tid] = a.rank_prefix[tid];
  __syncthreads();
  if (tid < R) {
    s_lo[tid] = tid > 0 ? s_P[(tid - 1) * R + me] : 0;  // rows from rank tid in my receive order
    s_hi[tid] = s_P[tid * R + me];
    s_dstlo[tid] = me > 0 ? s_P[(me - 1) * R + tid] : 0;  // my first row on rank tid
  }
  if (tid == 0) {
    int skip = 0;
    for (int r = 0; r < R; ++r) {
      const int total = s_P[(R - 1) * R + r];
      if (total > a.lay.cap_rows) {
        skip = 1;
        if (blockIdx.x == 0) report_error(a.sig.err, a.sig.claim, kErrCapacity, me, r, kPhaseDispatch, total, (int)a.lay.cap_rows);
      }
    }
    s_skip = skip;
  }
  if (tid < R && tid != me) wait_geq(&free_[tid], a.sig.base, a.sig.timeout_cycles, a.sig.err, a.sig.claim, me, tid, kPhaseDispatch);
  __syncthreads();

  const bool has_scales = a.scale_bytes > 0;
  if (!s_skip) {
    for (int t = blockIdx.x * kWarps + w; t < a.num_tokens; t += gridDim.x * kWarps) {
      if (lane == 0) {
        int nd = 0;
        for (int r = 0; r < R; ++r) {
          const int pos = a.send_pos[(int64_t)t * R + r];
          if (pos < 0) continue;
          const int64_t slot = s_dstlo[r] + pos;
          char* dx;
          if (r == me) {
            if (slot >= a.out_rows) continue;
            dx = a.recv_x + slot * a.x_bytes;
          } else {
            dx = a.peers.p[r] + kHeaderBytes + a.lay.off_x + slot * a.x_bytes;
          }
          s_dx[w][nd] = dx;
          s_dr[w][nd] = r;
          s_ds[w][nd] = (int)slot;
          ++nd;
        }
        s_nd[w] = nd;
      }
      warp_sync();
      const int nd = s_nd[w];
      warp_push_row<V>(a.x + (int64_t)t * a.x_bytes, a.x_bytes, s_dx[w], nd, lane);
      for (int j = 0; j < nd; ++j) {
        const int r = s_dr[w][j];
        const int64_t slot = s_ds[w][j];
        char* data = a.peers.p[r] + kHeaderBytes;
        if (has_scales) {
          const int* src = reinterpret_cast<const int*>(a.scales + (int64_t)t * a.scale_bytes);
          int* dst = reinterpret_cast<int*>(r == me ? a.recv_scales + slot * a.scale_bytes
                                                    : data + a.lay.off_scales + slot * a.scale_bytes);
          for (int i = lane; i < a.scale_bytes / 4; i += kWarpSize) dst[i] = src[i];
        }
        if (a.with_topk) {
          int64_t* di = r == me ? a.recv_idx : reinterpret_cast<int64_t*>(data + a.lay.off_topk_idx);
          float* dw = r == me ? a.recv_w : reinterpret_cast<float*>(data + a.lay.off_topk_w);
          for (int k = lane; k < K; k += kWarpSize) {
            const int64_t e = a.topk_idx[(int64_t)t * K + k];
            const int64_t local = (e >= (int64_t)r * epr && e < (int64_t)(r + 1) * epr) ? e - (int64_t)r * epr : -1;
            di[slot * K + k] = local;
            dw[slot * K + k] = (local >= 0 && a.with_weights) ? a.topk_w[(int64_t)t * K + k] : 0.f;
          }
        }
        if (a.with_src && lane == 0) {
          int* ds = r == me ? a.recv_src : reinterpret_cast<int*>(data + a.lay.off_src);
          ds[slot] = t;
        }
      }
      warp_sync();
    }
  }

  __threadfence_system();
  __syncthreads();
  if (tid == 0)
    for (int r = 0; r < R; ++r)
      if (r != me) signal_add(reinterpret_cast<uint64_t*>(a.peers.p[r] + kArriveOffset) + me);
  if (tid < R && tid != me)
    wait_geq(&arrive[tid], a.sig.base + gridDim.x, a.sig.timeout_cycles, a.sig.err, a.sig.claim, me, tid, kPhaseDispatch);
  __syncthreads();

  if (!s_skip) {
    const int64_t gtid = (int64_t)blockIdx.x * blockDim.x + tid, gthreads = (int64_t)gridDim.x * blockDim.x;
    const char* data = my + kHeaderBytes;
    for (int s = 0; s < R; ++s) {
      if (s == me) continue;
      const int64_t lo = s_lo[s], hi = min((int64_t)s_hi[s], a.out_rows);
      if (hi <= lo) continue;
      grid_copy_bytes(a.recv_x + lo * a.x_bytes, data + a.lay.off_x + lo * a.x_bytes, (hi - lo) * a.x_bytes, gtid,
                      gthreads);
      if (has_scales)
        grid_copy_bytes(a.recv_scales + lo * a.scale_bytes, data + a.lay.off_scales + lo * a.scale_bytes,
                        (hi - lo) * a.scale_bytes, gtid, gthreads);
      if (a.with_topk) {
        grid_copy_bytes(a.recv_idx + lo * K, data + a.lay.off_topk_idx + lo * K * 8, (hi - lo) * K * 8, gtid, gthreads);
        grid_copy_bytes(a.recv_w + lo * K, data + a.lay.off_topk_w + lo * K * 4, (hi - lo) * K * 4, gtid, gthreads);
      }
      if (a.with_src) grid_copy_bytes(a.recv_src + lo, data + a.lay.off_src + lo * 4, (hi - lo) * 4, gtid, gthreads);
    }
    // Padding rows (num_worst_tokens): x and scales 0, top-k ids -1, weights 0, source index -1.
    const int64_t total = s_hi[R - 1];
    if (total < a.out_rows) {
      const int64_t pad = a.out_rows - total;
      grid_zero_bytes(a.recv_x + total * a.x_bytes, pad * a.x_bytes, gtid, gthreads);
      if (has_scales) grid_zero_bytes(a.recv_scales + total * a.scale_bytes, pad * a.scale_bytes, gtid, gthreads);
      if (a.with_topk)
        for (int64_t i = gtid; i < pad * K; i += gthreads) {
          a.recv_idx[total * K + i] = -1;
          a.recv_w[total * K + i] = 0.f;
        }
      if (a.with_src)
        for (int64_t i = gtid; i < pad; i += gthreads) a.recv_src[total + i] = -1;
    }
  }
  __syncthreads();
  if (tid == 0)
    for (int r = 0; r < R; ++r)
      if (r != me) signal_add(reinterpret_cast<uint64_t*>(a.peers.p[r] + kFreeOffset) + me);
}

// ----------------------------------------------------------------------------------------------- combine
// Element types combine reduces (float32 accumulation): bf16 (raw bits), fp16, fp32.
struct Bf16 {
  uint16_t bits;
  __device__ __forceinline__ float to_float() const { return bf16_to_float(bits); }
  __device__ __forceinline__ static Bf16 from_float(float f) { return Bf16{float_to_bf16(f)}; }
};
struct Fp16 {
  __half h;
  __device__ __forceinline__ float to_float() const { return __half2float(h); }
  __device__ __forceinline__ static Fp16 from_float(float f) { return Fp16{__float2half_rn(f)}; }
};
struct Fp32 {
  float f;
  __device__ __forceinline__ float to_float() const { return f; }
  __device__ __forceinline__ static Fp32 from_float(float v) { return Fp32{v}; }
};

template <typename T, int N>
struct alignas(sizeof(T) * N) ElemVec {
  T v[N];
};

template <typename T, int kVec>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(CombineArgs a) {
  constexpr int kWarps = kCombineThreads / kWarpSize;
  constexpr int U = kVec * sizeof(T) == 16 ? 2 : 4;
  using Vec = ElemVec<T, kVec>;
  using PushV = typename std::conditional<
      kVec * sizeof(T) == 16, int4,
      typename std::conditional<kVec * sizeof(T) == 4, int, typename std::conditional<kVec * sizeof(T) == 8, int2, short>::type>::type>::type;
  const int R = a.num_ranks, me = a.rank, tid = threadIdx.x, w = tid / kWarpSize, lane = tid % kWarpSize;
  const int K = a.num_topk, H = a.hidden;
  const int64_t row_bytes = (int64_t)H * sizeof(T);
  const T* x = reinterpret_cast<const T*>(a.x);
  char* my = a.peers.p[me];
  uint64_t* arrive = reinterpret_cast<uint64_t*>(my + kArriveOffset);
  uint64_t* free_ = reinterpret_cast<uint64_t*>(my + kFreeOffset);
  __shared__ int s_P[kMaxRanks * kMaxRanks];
  __shared__ int s_lo[kMaxRanks], s_hi[kMaxRanks], s_sendbase[kMaxRanks], s_recvbase[kMaxRanks];
  __shared__ int s_skip;
  __shared__ const T* s_src[kWarps][kMaxRanks];
  __shared__ const float* s_wsrc[kWarps][kMaxRanks];
  __shared__ int s_n[kWarps];

  if (tid < R * R) s_P[tid] = a.rank_prefix[tid];
  __syncthreads();
  auto count = [&](int s, int r) { return s_P[s * R + r] - (s > 0 ? s_P[(s - 1) * R + r] : 0); };
  if (tid < R) {
    s_lo[tid] = tid > 0 ? s_P[(tid - 1) * R + me] : 0;
    s_hi[tid] = s_P[tid * R + me];
    int sb = 0, rb = 0;
    for (int r = 0; r < me; ++r) sb += count(tid, r);  // my rows in rank tid's combine buffer start here
    for (int r = 0; r < tid; ++r) rb += count(me, r);  // rows from rank tid in my combine buffer start here
    s_sendbase[tid] = sb;
    s_recvbase[tid] = rb;
  }
  if (tid == 0) {
    int skip = 0;
    for (int s = 0; s < R; ++s) {
      int total = 0;
      for (int r = 0; r < R; ++r) total += count(s, r);
      if (total > a.lay.cap_rows) {
        skip = 1;
        if (blockIdx.x == 0) report_error(a.sig.err, a.sig.claim, kErrCapacity, me, s, kPhaseCombine, total, (int)a.lay.cap_rows);
      }
    }
    s_skip = skip;
  }
  if (tid < R && tid != me) wait_geq(&free_[tid], a.sig.base, a.sig.timeout_cycles, a.sig.err, a.sig.claim, me, tid, kPhaseCombine);
  __syncthreads();

  const int gw = blockIdx.x * kWarps + w, nw = gridDim.x * kWarps;
  if (!s_skip) {
    for (int s = 0; s < R; ++s) {
      if (s == me) continue;
      char* data = a.peers.p[s] + kHeaderBytes;
      for (int i = s_lo[s] + gw; i < s_hi[s]; i += nw) {
        const int64_t slot = s_sendbase[s] + (i - s_lo[s]);
        char* dst = data + a.lay.off_x + slot * row_bytes;
        warp_push_row<PushV>(reinterpret_cast<const char*>(x) + (int64_t)i * row_bytes, row_bytes, &dst, 1, lane);
        if (a.with_weights) {
          float* dw = reinterpret_cast<float*>(data + a.lay.off_topk_w) + slot * K;
          for (int k = lane; k < K; k += kWarpSize) dw[k] = a.topk_w[(int64_t)i * K + k];
        }
      }
    }
  }

  __threadfence_system();
  __syncthreads();
  if (tid == 0)
    for (int r = 0; r < R; ++r)
      if (r != me) signal_add(reinterpret_cast<uint64_t*>(a.peers.p[r] + kArriveOffset) + me);
  if (tid < R && tid != me)
    wait_geq(&arrive[tid], a.sig.base + gridDim.x, a.sig.timeout_cycles, a.sig.err, a.sig.claim, me, tid, kPhaseCombine);
  __syncthreads();

  if (!s_skip) {
    const char* data = my + kHeaderBytes;
    const int nv = H / kVec;
    for (int t = gw; t < a.num_tokens; t += nw) {
      if (lane == 0) {
        int n = 0;
        for (int r = 0; r < R; ++r) {
          const int pos = a.send_pos[(int64_t)t * R + r];
          if (pos < 0) continue;
          if (r == me) {
            const int64_t row = s_lo[me] + pos;
            s_src[w][n] = x + row * H;
            s_wsrc[w][n] = a.topk_w + row * K;
          } else {
            const int64_t row = s_recvbase[r] + pos;
            s_src[w][n] = reinterpret_cast<const T*>(data + a.lay.off_x) + row * H;
            s_wsrc[w][n] = reinterpret_cast<const float*>(data + a.lay.off_topk_w) + row * K;
          }
          ++n;
        }
        s_n[w] = n;
      }
      warp_sync();
      const int n = s_n[w];
      for (int v0 = lane; v0 < nv; v0 += kWarpSize * U) {
        float acc[U][kVec];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[u][e] = 0.f;
        for (int j = 0; j < n; ++j) {
          const Vec* src = reinterpret_cast<const Vec*>(s_src[w][j]);
          Vec in[U];
#pragma unroll
          for (int u = 0; u < U; ++u)
            if (v0 + u * kWarpSize < nv) in[u] = src[v0 + u * kWarpSize];
#pragma unroll
          for (int u = 0; u < U; ++u)
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[u][e] += in[u].v[e].to_float();
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int idx = v0 + u * kWarpSize;
          if (idx >= nv) continue;
          if (a.bias0 != nullptr) {
            const Vec b = reinterpret_cast<const Vec*>(reinterpret_cast<const T*>(a.bias0) + (int64_t)t * H)[idx];
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[u][e] += b.v[e].to_float();
          }
          if (a.bias1 != nullptr) {
            const Vec b = reinterpret_cast<const Vec*>(reinterpret_cast<const T*>(a.bias1) + (int64_t)t * H)[idx];
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[u][e] += b.v[e].to_float();
          }
          Vec o;
#pragma unroll
          for (int e = 0; e < kVec; ++e) o.v[e] = T::from_float(acc[u][e]);
          reinterpret_cast<Vec*>(reinterpret_cast<T*>(a.out) + (int64_t)t * H)[idx] = o;
        }
      }
      if (a.with_weights) {
        for (int k = lane; k < K; k += kWarpSize) {
          float acc = 0.f;
          for (int j = 0; j < n; ++j) acc += s_wsrc[w][j][k];
          a.out_w[(int64_t)t * K + k] = acc;
        }
      }
      warp_sync();
    }
  }
  __syncthreads();
  if (tid == 0)
    for (int r = 0; r < R; ++r)
      if (r != me) signal_add(reinterpret_cast<uint64_t*>(a.peers.p[r] + kFreeOffset) + me);
}

// ------------------------------------------------------------------------------------------------ launch
void launch_notify(const NotifyArgs& a, gpuStream_t stream) {
  notify_kernel<<<1, kNotifyThreads, 0, stream>>>(a);
  UCCL_CHECK_GPU(gpuGetLastError());
}

void launch_dispatch(const DispatchArgs& a, int num_blocks, gpuStream_t stream) {
  if (a.x_bytes % 16 == 0)
    dispatch_kernel<int4><<<num_blocks, kDispatchThreads, 0, stream>>>(a);
  else if (a.x_bytes % 4 == 0)
    dispatch_kernel<int><<<num_blocks, kDispatchThreads, 0, stream>>>(a);
  else if (a.x_bytes % 2 == 0)
    dispatch_kernel<short><<<num_blocks, kDispatchThreads, 0, stream>>>(a);
  else
    dispatch_kernel<char><<<num_blocks, kDispatchThreads, 0, stream>>>(a);
  UCCL_CHECK_GPU(gpuGetLastError());
}

template <typename T>
static void launch_combine_typed(const CombineArgs& a, int num_blocks, gpuStream_t stream) {
  constexpr int kFull = 16 / sizeof(T);
  if (a.hidden % kFull == 0)
    combine_kernel<T, kFull><<<num_blocks, kCombineThreads, 0, stream>>>(a);
  else
    combine_kernel<T, 1><<<num_blocks, kCombineThreads, 0, stream>>>(a);
}

void launch_combine(const CombineArgs& a, int num_blocks, gpuStream_t stream) {
  switch (a.dtype) {
    case kDtypeBf16: launch_combine_typed<Bf16>(a, num_blocks, stream); break;
    case kDtypeFp16: launch_combine_typed<Fp16>(a, num_blocks, stream); break;
    case kDtypeFp32: launch_combine_typed<Fp32>(a, num_blocks, stream); break;
    default: UCCL_THROW("combine: unsupported dtype code " << a.dtype);
  }
  UCCL_CHECK_GPU(gpuGetLastError());
}

}  // namespace uccl_ep::intranode
