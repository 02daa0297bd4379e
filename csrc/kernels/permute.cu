// Expert-major expand / reduce kernels (see permute_api.h). One block per row (grid-stride): the block
// reads its row's destination list once, then every thread moves 16-byte vectors of the row, so both
// kernels run at HBM bandwidth and are deterministic (no atomics, fixed summation order).
#include "common/check.h"
#include "kernels/device_utils.cuh"
#include "kernels/permute_api.h"

namespace uccl_ep::permute {

constexpr int kThreads = 256;
constexpr int kMaxTopk = 64;
constexpr int kMaxBlocks = 4096;

using intranode::bf16_to_float;
using intranode::float_to_bf16;
using intranode::ld_nc_v4;

// Loads this row's destinations into shared memory, compacted (those in [0, limit) only: -1 means "none",
// and a map that names rows past the other side's end is skipped rather than written or read out of
// bounds); returns their count.
__device__ __forceinline__ int load_dsts(const int* dst, int64_t row, int num_topk, int64_t limit, int* s_dst,
                                         int* s_n) {
  if (threadIdx.x == 0) {
    int n = 0;
    for (int j = 0; j < num_topk; ++j) {
      const int d = dst[row * num_topk + j];
      if (d >= 0 && d < limit) s_dst[n++] = d;
    }
    *s_n = n;
  }
  __syncthreads();
  return *s_n;
}

template <typename V>
__global__ void __launch_bounds__(kThreads) expand_rows_kernel(const V* x, const int* dst, V* out, int64_t num_rows,
                                                               int num_topk, int64_t row_vecs, int64_t num_out) {
  __shared__ int s_dst[kMaxTopk];
  __shared__ int s_n;
  for (int64_t row = blockIdx.x; row < num_rows; row += gridDim.x) {
    const int n = load_dsts(dst, row, num_topk, num_out, s_dst, &s_n);
    const V* src = x + row * row_vecs;
    for (int64_t v = threadIdx.x; v < row_vecs; v += kThreads) {
      V val;
      if constexpr (sizeof(V) == 16)
        val = ld_nc_v4(src + v);
      else
        val = src[v];
      for (int j = 0; j < n; ++j) out[(int64_t)s_dst[j] * row_vecs + v] = val;
    }
    __syncthreads();  // s_dst is rewritten for the next row
  }
}

using Bf16 = intranode::ElemBf16;
using Fp16 = intranode::ElemFp16;
using Fp32 = intranode::ElemFp32;

// kVec: true when rows are 16-byte aligned: each thread then sums 16-byte vectors (16 / size elements).
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads) reduce_rows_kernel(const char* y, const int* dst, char* out,
                                                               int64_t num_rows, int num_topk, int64_t hidden,
                                                               int64_t num_in) {
  constexpr int kPer = kVec ? 16 / T::kSize : 1;
  __shared__ int s_dst[kMaxTopk];
  __shared__ int s_n;
  const int64_t row_bytes = hidden * T::kSize;
  const int64_t units = hidden / kPer;
  for (int64_t row = blockIdx.x; row < num_rows; row += gridDim.x) {
    const int n = load_dsts(dst, row, num_topk, num_in, s_dst, &s_n);
    char* o = out + row * row_bytes;
    for (int64_t u = threadIdx.x; u < units; u += kThreads) {
      float acc[kPer];
#pragma unroll
      for (int e = 0; e < kPer; ++e) acc[e] = 0.f;
      for (int j = 0; j < n; ++j) {
        const char* s = y + (int64_t)s_dst[j] * row_bytes + u * kPer * T::kSize;
        if constexpr (kVec) {
          const int4 v = ld_nc_v4(reinterpret_cast<const int4*>(s));
#pragma unroll
          for (int e = 0; e < kPer; ++e) acc[e] += T::load(&v, e);
        } else {
          acc[0] += T::load(s, 0);
        }
      }
      if constexpr (kVec) {
        int4 r;
#pragma unroll
        for (int e = 0; e < kPer; ++e) T::store(&r, e, acc[e]);
        *reinterpret_cast<int4*>(o + u * 16) = r;
      } else {
        T::store(o, u, acc[0]);
      }
    }
    __syncthreads();
  }
}

constexpr int kMapThreads = 1024;

// One block per local expert: the block walks the rows in order, and each row that selected the expert
// takes the next position (warp ballots + a block-wide prefix over warp totals), offset by the rows of
// all earlier experts. Every slot is written once, so the output needs no fill: a repeated id of a row
// gets -1 from its expert's block, ids outside [0, num_experts) (other ranks' experts, -1) from block 0.
__global__ void __launch_bounds__(kMapThreads) expert_major_map_kernel(const int64_t* topk_idx, int64_t num_rows,
                                                                       int num_topk, const int* counts, int* dst) {
  constexpr int kWarps = kMapThreads / UCCL_WARP_SIZE;
  __shared__ int s_warp[kWarps];
  __shared__ int s_base;
  const int e = blockIdx.x;
  const int lane = threadIdx.x % UCCL_WARP_SIZE, warp = threadIdx.x / UCCL_WARP_SIZE;
  if (threadIdx.x == 0) {
    int start = 0;
    for (int i = 0; i < e; ++i) start += counts[i];
    s_base = start;
  }
  __syncthreads();
  for (int64_t chunk = 0; chunk < num_rows; chunk += kMapThreads) {
    const int64_t row = chunk + threadIdx.x;
    int slot = -1;
    if (row < num_rows)
      for (int j = 0; j < num_topk; ++j) {
        const int64_t id = topk_idx[row * num_topk + j];
        if (id == e) {
          if (slot < 0)
            slot = j;
          else
            dst[row * num_topk + j] = -1;  // a repeated id: the row already has this expert's position
        } else if (e == 0 && (id < 0 || id >= (int64_t)gridDim.x)) {
          dst[row * num_topk + j] = -1;
        }
      }
#if defined(UCCL_EP_WITH_HIP)
    const uint64_t hits = __ballot(slot >= 0);
    const int before = __popcll(hits & ((1ull << lane) - 1ull));
    const int total = __popcll(hits);
#else
    const unsigned hits = __ballot_sync(0xffffffffu, slot >= 0);
    const int before = __popc(hits & ((1u << lane) - 1u));
    const int total = __popc(hits);
#endif
    if (lane == 0) s_warp[warp] = total;
    __syncthreads();
    int offset = s_base;
    for (int w = 0; w < warp; ++w) offset += s_warp[w];
    if (slot >= 0) dst[row * num_topk + slot] = offset + before;
    __syncthreads();
    if (threadIdx.x == 0) {
      int sum = 0;
      for (int w = 0; w < kWarps; ++w) sum += s_warp[w];
      s_base += sum;
    }
    __syncthreads();
  }
}

// Rows of one element (the top-k weights expand_probs spreads, and their gradients): one thread per row, no
// block barrier per row (the row-per-block kernels spend it on 4 bytes).
template <typename V>
__global__ void __launch_bounds__(kThreads) expand_elems_kernel(const V* x, const int* dst, V* out, int64_t num_rows,
                                                                int num_topk, int64_t num_out) {
  for (int64_t row = (int64_t)blockIdx.x * kThreads + threadIdx.x; row < num_rows; row += (int64_t)gridDim.x * kThreads) {
    const V v = x[row];
    for (int j = 0; j < num_topk; ++j) {
      const int d = dst[row * num_topk + j];
      if (d >= 0 && d < num_out) out[d] = v;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) reduce_elems_kernel(const char* y, const int* dst, char* out,
                                                                int64_t num_rows, int num_topk, int64_t num_in) {
  for (int64_t row = (int64_t)blockIdx.x * kThreads + threadIdx.x; row < num_rows; row += (int64_t)gridDim.x * kThreads) {
    float acc = 0.f;
    for (int j = 0; j < num_topk; ++j) {  // slot order, as reduce_rows_kernel
      const int d = dst[row * num_topk + j];
      if (d >= 0 && d < num_in) acc += T::load(y, d);
    }
    T::store(out, row, acc);
  }
}

static int elem_grid(int64_t num_rows) {
  const int64_t blocks = (num_rows + kThreads - 1) / kThreads;
  return (int)(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

constexpr int kTopkThreads = 256;
using intranode::kWarpSize;

__global__ void __launch_bounds__(kTopkThreads) routing_topk_kernel(const bool* routing_map, const float* probs,
                                                                    int64_t num_tokens, int num_experts, int num_topk,
                                                                    int64_t* topk_idx, float* topk_weights) {
  constexpr int kWarpsPerBlock = kTopkThreads / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t first = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  for (int64_t t = first; t < num_tokens; t += (int64_t)gridDim.x * kWarpsPerBlock) {
    const bool* row = routing_map + t * num_experts;
    int found = 0;
    for (int e0 = 0; e0 < num_experts && found < num_topk; e0 += kWarpSize) {
      const int e = e0 + lane;
      const bool sel = e < num_experts && row[e];
      const uint64_t hits = intranode::warp_ballot(sel);
      const int before = __popcll(hits & ((1ull << lane) - 1ull));
      const int total = __popcll(hits);
      const int slot = found + before;
      if (sel && slot < num_topk) {
        topk_idx[t * num_topk + slot] = e;
        topk_weights[t * num_topk + slot] = probs[t * num_experts + e];
      }
      found += total;
    }
    for (int slot = found + lane; slot < num_topk; slot += kWarpSize) {
      topk_idx[t * num_topk + slot] = -1;
      topk_weights[t * num_topk + slot] = 0.f;
    }
  }
}

void launch_routing_topk(const bool* routing_map, const float* probs, int64_t num_tokens, int num_experts,
                         int num_topk, int64_t* topk_idx, float* topk_weights, gpuStream_t stream) {
  UCCL_CHECK(num_topk >= 1 && num_topk <= num_experts, "num_topk " << num_topk << " out of [1, num_experts="
                                                                    << num_experts << "]");
  if (num_tokens == 0) return;
  constexpr int kWarpsPerBlock = kTopkThreads / kWarpSize;
  const int64_t blocks = (num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  routing_topk_kernel<<<(int)(blocks < kMaxBlocks ? blocks : kMaxBlocks), kTopkThreads, 0, stream>>>(
      routing_map, probs, num_tokens, num_experts, num_topk, topk_idx, topk_weights);
  UCCL_CHECK_GPU(gpuGetLastError());
}

void launch_expert_major_map(const int64_t* topk_idx, int64_t num_rows, int num_topk, int num_experts,
                             const int* counts, int* dst, gpuStream_t stream) {
  UCCL_CHECK(num_topk >= 1 && num_topk <= kMaxTopk, "num_topk " << num_topk << " out of [1, " << kMaxTopk << "]");
  UCCL_CHECK(num_experts >= 0, "num_experts " << num_experts);
  if (num_rows == 0) return;
  if (num_experts == 0) {  // no expert here: every slot is -1 (all bits set)
    UCCL_CHECK_GPU(gpuMemsetAsync(dst, 0xff, (size_t)num_rows * num_topk * sizeof(int), stream));
    return;
  }
  expert_major_map_kernel<<<num_experts, kMapThreads, 0, stream>>>(topk_idx, num_rows, num_topk, counts, dst);
  UCCL_CHECK_GPU(gpuGetLastError());
}

static int grid_for(int64_t num_rows) {
  return (int)(num_rows < kMaxBlocks ? num_rows : kMaxBlocks);
}

static bool aligned16(const void* a, const void* b, int64_t bytes) {
  return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | (uintptr_t)bytes) & 15u) == 0;
}

void launch_expand_rows(const void* x, const int* dst, void* out, int64_t num_rows, int num_topk, int64_t row_bytes,
                        int64_t num_out, gpuStream_t stream) {
  UCCL_CHECK(num_topk >= 1 && num_topk <= kMaxTopk, "num_topk " << num_topk << " out of [1, " << kMaxTopk << "]");
  UCCL_CHECK(row_bytes >= 0, "row_bytes " << row_bytes);
  if (num_rows == 0 || row_bytes == 0) return;
  const int grid = grid_for(num_rows);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(out);
  if (row_bytes == 4 && (addr & 3u) == 0) {
    expand_elems_kernel<int><<<elem_grid(num_rows), kThreads, 0, stream>>>(
        static_cast<const int*>(x), dst, static_cast<int*>(out), num_rows, num_topk, num_out);
  } else if (row_bytes == 2 && (addr & 1u) == 0) {
    expand_elems_kernel<short><<<elem_grid(num_rows), kThreads, 0, stream>>>(
        static_cast<const short*>(x), dst, static_cast<short*>(out), num_rows, num_topk, num_out);
  } else if (aligned16(x, out, row_bytes)) {
    expand_rows_kernel<int4><<<grid, kThreads, 0, stream>>>(static_cast<const int4*>(x), dst, static_cast<int4*>(out),
                                                            num_rows, num_topk, row_bytes / 16, num_out);
  } else if (((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(out) | (uintptr_t)row_bytes) & 3u) == 0) {
    expand_rows_kernel<int><<<grid, kThreads, 0, stream>>>(static_cast<const int*>(x), dst, static_cast<int*>(out),
                                                           num_rows, num_topk, row_bytes / 4, num_out);
  } else {
    expand_rows_kernel<char><<<grid, kThreads, 0, stream>>>(static_cast<const char*>(x), dst, static_cast<char*>(out),
                                                            num_rows, num_topk, row_bytes, num_out);
  }
  UCCL_CHECK_GPU(gpuGetLastError());
}

template <typename T>
static void reduce_as(const void* y, const int* dst, void* out, int64_t num_rows, int num_topk, int64_t hidden,
                      int64_t num_in, gpuStream_t stream) {
  const int grid = grid_for(num_rows);
  const char* yc = static_cast<const char*>(y);
  char* oc = static_cast<char*>(out);
  if (hidden == 1)
    reduce_elems_kernel<T><<<elem_grid(num_rows), kThreads, 0, stream>>>(yc, dst, oc, num_rows, num_topk, num_in);
  else if (aligned16(y, out, hidden * T::kSize))
    reduce_rows_kernel<T, true><<<grid, kThreads, 0, stream>>>(yc, dst, oc, num_rows, num_topk, hidden, num_in);
  else
    reduce_rows_kernel<T, false><<<grid, kThreads, 0, stream>>>(yc, dst, oc, num_rows, num_topk, hidden, num_in);
}

void launch_reduce_rows(const void* y, const int* dst, void* out, int64_t num_rows, int num_topk, int64_t hidden,
                        int64_t num_in, int dtype, gpuStream_t stream) {
  UCCL_CHECK(num_topk >= 1 && num_topk <= kMaxTopk, "num_topk " << num_topk << " out of [1, " << kMaxTopk << "]");
  if (num_rows == 0 || hidden == 0) return;
  switch (dtype) {
    case kBf16: reduce_as<Bf16>(y, dst, out, num_rows, num_topk, hidden, num_in, stream); break;
    case kFp16: reduce_as<Fp16>(y, dst, out, num_rows, num_topk, hidden, num_in, stream); break;
    case kFp32: reduce_as<Fp32>(y, dst, out, num_rows, num_topk, hidden, num_in, stream); break;
    default: UCCL_THROW("reduce_rows: unsupported dtype code " << dtype << " (bf16=0, fp16=1, fp32=2)");
  }
  UCCL_CHECK_GPU(gpuGetLastError());
}

}  // namespace uccl_ep::permute
