// Row moves of the high-throughput kernels (intranode and internode): a row copied to several destinations,
// and the float32 sum of m rows rounded once. What makes them fast is how many 16-byte loads each lane keeps
// in flight: one load per round trip (a plain copy loop) leaves a warp at ~0.5 KiB per memory latency,
// tens of GB/s for a whole 16-SM kernel.
#pragma once

#include <cstring>

#include "kernels/device_utils.cuh"

namespace uccl_ep::intranode {

template <typename V>
__device__ __forceinline__ V load_stream(const V* p) {
  return *p;
}
template <>
__device__ __forceinline__ int4 load_stream<int4>(const int4* p) {
  return ld_nc_v4(p);
}

// One warp copies a row of `nbytes` (a multiple of sizeof(V)) from `src` to each of `dsts[0..ndst)`:
// the row is read once, stored ndst times. U vectors per lane in flight; full rounds carry no per-vector
// predicates (a predicate per vector splits a round into two load waits once the 7 predicate registers
// run out), and the tail goes 4 vectors at a time.
// kNc: read through the non-coherent path (sources nobody writes during the kernel); false for rows that
// peers pushed into this rank's buffer during the kernel.
template <typename V, int U = (sizeof(V) == 16 ? 8 : 4), bool kNc = true>
__device__ __forceinline__ void warp_push_row(const char* src, int64_t nbytes, char* const* dsts, int ndst,
                                              int lane) {
  const int n = (int)(nbytes / (int64_t)sizeof(V));
  const V* s = reinterpret_cast<const V*>(src);
  int i = lane;
  for (; i + (U - 1) * kWarpSize < n; i += kWarpSize * U) {
    V v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = kNc ? load_stream<V>(s + i + u * kWarpSize) : s[i + u * kWarpSize];
    for (int j = 0; j < ndst; ++j) {
      V* d = reinterpret_cast<V*>(dsts[j]);
#pragma unroll
      for (int u = 0; u < U; ++u) d[i + u * kWarpSize] = v[u];
    }
  }
  for (; i < n; i += kWarpSize * 4) {
    V v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (i + u * kWarpSize < n) v[u] = kNc ? load_stream<V>(s + i + u * kWarpSize) : s[i + u * kWarpSize];
    for (int j = 0; j < ndst; ++j) {
      V* d = reinterpret_cast<V*>(dsts[j]);
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (i + u * kWarpSize < n) d[i + u * kWarpSize] = v[u];
    }
  }
}

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

constexpr int kStageSlots = 24;  // 16-byte vectors per lane staged in shared memory by the kMode 2 reduce

// The sum of m rows of T (kVec elements per vector: 16 bytes, or 1 element when rows are not 16-byte
// multiples): every source's loads of a round are issued together (12-14 vectors per lane for 1-4 sources;
// more spills at 128 registers), from the global state space (explicit ld.global, no generic loads), then
// summed in source order, so the result does not depend on the variant.
template <typename T, int kVec>
struct CombineRow {
  using Vec = ElemVec<T, kVec>;

  __device__ __forceinline__ static Vec load(const Vec* p) {
    if constexpr (sizeof(Vec) == 16) {
      const int4 v = ld_global_v4(reinterpret_cast<const int4*>(p));
      Vec r;
      memcpy(&r, &v, sizeof(r));
      return r;
    } else {
      return *p;
    }
  }

  // One round over vectors i0 + u*W (u < U) of NS sources: all loads first, then the sums in source order.
  template <int NS, int U, bool kPred>
  __device__ __forceinline__ static void step(const Vec* const (&src)[NS], Vec* out, int i0, int nv) {
    Vec in[NS][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * kWarpSize;
      if (!kPred || i < nv) {
#pragma unroll
        for (int q = 0; q < NS; ++q) in[q][u] = load(src[q] + i);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * kWarpSize;
      if (kPred && i >= nv) continue;
      float acc[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
#pragma unroll
      for (int q = 0; q < NS; ++q)
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] += in[q][u].v[e].to_float();
      Vec o;
#pragma unroll
      for (int e = 0; e < kVec; ++e) o.v[e] = T::from_float(acc[e]);
      out[i] = o;
    }
  }

  // A row with exactly NS inputs (pointers in shared memory): rounds of U vectors per lane, then a tail of
  // UT at a time (NS * U vectors of 16 B per lane in flight: at most 64 registers of loads).
  template <int NS, int U, int UT>
  __device__ __forceinline__ static void fixed(const T* const* s_src, T* out_row, int nv, int lane) {
    const Vec* src[NS];
#pragma unroll
    for (int q = 0; q < NS; ++q) src[q] = reinterpret_cast<const Vec*>(s_src[q]);
    Vec* out = reinterpret_cast<Vec*>(out_row);
    int i = lane;
#pragma unroll 1
    for (; i + (U - 1) * kWarpSize < nv; i += U * kWarpSize) step<NS, U, false>(src, out, i, nv);
#pragma unroll 1
    for (; i < nv; i += UT * kWarpSize) step<NS, UT, true>(src, out, i, nv);
  }

  // Any number (1..kStageSlots) of inputs through shared memory (16-byte vectors only): each lane copies
  // kStageSlots / m vectors of every input into its own slots with cp.async (nothing held in registers
  // while they fly), waits for its own copies, then sums its slots in input order. A lane only reads
  // the slots it filled itself, so no barrier is needed.
  __device__ __forceinline__ static void staged(const T* const* s_src, int m, T* out_row, int nv, int lane,
                                                int4* stage) {
    static_assert(sizeof(Vec) == 16, "staged reduce moves 16-byte vectors");
    const int U = kStageSlots / m;
    Vec* out = reinterpret_cast<Vec*>(out_row);
    for (int i0 = 0; i0 < nv; i0 += U * kWarpSize) {
      for (int j = 0; j < m; ++j) {
        const int4* src = reinterpret_cast<const int4*>(s_src[j]);
        for (int u = 0; u < U; ++u) {
          const int i = i0 + u * kWarpSize + lane;
          if (i < nv) cp_async_16(&stage[(j * U + u) * kWarpSize + lane], src + i);
        }
      }
      cp_async_wait_all();
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * kWarpSize + lane;
        if (i >= nv) break;
        float acc[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
        for (int j = 0; j < m; ++j) {
          Vec v;
          memcpy(&v, &stage[(j * U + u) * kWarpSize + lane], sizeof(v));
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[e] += v.v[e].to_float();
        }
        Vec o;
#pragma unroll
        for (int e = 0; e < kVec; ++e) o.v[e] = T::from_float(acc[e]);
        out[i] = o;
      }
    }
  }

  // out_row = sum of the m rows s_src[0..m) (m == 0: zeros), the register variant fitted to m.
  __device__ __forceinline__ static void sum_rows(const T* const* s_src, int m, T* out_row, int nv, int lane) {
    switch (m) {
      case 0:
        for (int i = lane; i < nv; i += kWarpSize) {
          Vec o;
#pragma unroll
          for (int e = 0; e < kVec; ++e) o.v[e] = T::from_float(0.f);
          reinterpret_cast<Vec*>(out_row)[i] = o;
        }
        break;
      case 1: fixed<1, 12, 2>(s_src, out_row, nv, lane); break;
      case 2: fixed<2, 7, 1>(s_src, out_row, nv, lane); break;
      case 3: fixed<3, 4, 1>(s_src, out_row, nv, lane); break;
      case 4: fixed<4, 3, 1>(s_src, out_row, nv, lane); break;
      default: generic(s_src, m, out_row, nv, lane); break;
    }
  }

  // Any number of inputs: groups of 4 sources, float accumulators carried between groups.
  __device__ __forceinline__ static void generic(const T* const* s_src, int m, T* out_row, int nv, int lane) {
    constexpr int U = 2;
    Vec* out = reinterpret_cast<Vec*>(out_row);
    for (int i0 = lane; i0 < nv; i0 += U * kWarpSize) {
      float acc[U][kVec];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[u][e] = 0.f;
      for (int j = 0; j < m; j += 4) {
        Vec in[4][U];
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (j + q < m)
#pragma unroll
            for (int u = 0; u < U; ++u)
              if (i0 + u * kWarpSize < nv) in[q][u] = load(reinterpret_cast<const Vec*>(s_src[j + q]) + i0 + u * kWarpSize);
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (j + q < m)
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
              for (int e = 0; e < kVec; ++e) acc[u][e] += in[q][u].v[e].to_float();
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * kWarpSize;
        if (i >= nv) continue;
        Vec o;
#pragma unroll
        for (int e = 0; e < kVec; ++e) o.v[e] = T::from_float(acc[u][e]);
        out[i] = o;
      }
    }
  }
};

}  // namespace uccl_ep::intranode
