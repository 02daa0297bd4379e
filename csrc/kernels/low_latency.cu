// Low-latency dispatch / combine kernels (design: docs/low_latency.md; API: low_latency_api.h).
//
// Two kernels, dispatch and combine, each of a send and a receive phase (one launch runs both, or, with the
// recv hook, the send now and the receive in the hook), on `Args::half` (the call's half of the
// double-buffered areas):
//   dispatch_send  every block counts each expert's rows from topk_idx itself (no grid barrier), block 0 sends
//                  every rank its counts header at once (the first signal); each block gives its (token, top-k
//                  slot) pairs their rows (pair_pos, the combine's input) and the destination's row index entry
//                  (the row's message), and writes each of its tokens once to every rank that has any of its
//                  experts (a message: BF16 copy or FP8 cast with per-128 scales; node peers: NVLink stores into
//                  their receive block, other nodes: this rank's send block, which one proxy write carries
//                  over); the block that completes a rank signals it (the second signal).
//   dispatch_recv  wait for the node's blocks and the other nodes' counts headers, then unpack the blocks
//                  into DeepEP's packed layout [local expert][rank * max tokens][hidden], grouped by source rank,
//                  in the order the source sent them (its token order), a message to each row that names it:
//                  the node's blocks first, while the other nodes' rows are still on their way through the
//                  proxies, then those.
//   combine_send   send each expert output row back to the row its token came from (same blocks, reversed).
//   combine_recv   wait for every rank, then out[t] = sum over k of w[t][k] * row(t, k), in top-k order.
//
// Signals only grow. A destination's combine signal goes up by one per call, its dispatch signal by two (the
// counts header landed, then the row index and messages); the receiver waits until it passes what the calls it
// has received on that half account for (`seq`, a device word the last block of the receive phase advances), so
// a graph replay waits for the next call, never for a value frozen at capture. The counters a call uses as scratch
// (per-destination completions) are returned to zero by the block that finishes with them, inside the call.
#include <cstdio>

#include "common/check.h"
#include "kernels/low_latency_launch.cuh"
#include "kernels/row_ops.cuh"

namespace uccl_ep::low_latency {

using intranode::kWarpSize;
using intranode::report_error;
using intranode::wait_geq;

namespace {

struct Counters {
  unsigned* d_done;
  unsigned* c_done;
  unsigned long long* words;
};

__device__ __forceinline__ Counters counters(const Args& a) {
  char* base = a.buf + a.lay.counters;
  return Counters{reinterpret_cast<unsigned*>(base + kDoneOffset), reinterpret_cast<unsigned*>(base + kCDoneOffset),
                  reinterpret_cast<unsigned long long*>(base + kWordsOffset)};
}

// seq[kind][half]: calls of this kind received on this half so far (kind 0 dispatch, 1 combine).
__device__ __forceinline__ unsigned long long* seq_word(const Args& a, int kind) {
  return counters(a).words + kSeqWord + 2 * kind + a.half;
}

__device__ __forceinline__ bool same_node(const Args& a, int r) {
  return r / a.ranks_per_node == a.rank / a.ranks_per_node;
}

// Where this rank's rows for rank r go: r's receive block for this rank (node peer, NVLink), else this rank's
// send block for r (the proxy copies it over).
__device__ __forceinline__ char* out_block(const Args& a, int r, int64_t send_area, int64_t recv_area,
                                           int64_t block_bytes) {
  if (same_node(a, r)) return a.peers[r % a.ranks_per_node] + recv_area + a.rank * block_bytes;
  return a.buf + send_area + r * block_bytes;
}

// The last block of a launch to finish (kernel `kind`) moves seq to `value`: every block read seq before.
__device__ void finish_launch(const Args& a, int word, unsigned long long* seq, unsigned long long value) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned long long old = atomicAdd(counters(a).words + word, 1ull);
    if ((old + 1) % gridDim.x == 0) *reinterpret_cast<volatile unsigned long long*>(seq) = value;
  }
}

// Every block waits until the signal of each node peer (this rank included) reached `near` and that of each
// rank of another node reached `far` (0: not waited for); false on deadline.
// A node peer's signal is in this rank's GPU memory, where every block polls it. Another node's is in host
// memory (the proxy raises it): only block 0 polls it, over PCIe, and mirrors the value it saw into the
// rank's unused GPU signal word, which the other blocks poll (a spinning receive kernel polling host memory
// from every block slowed the transfers it waited for; the mirror is release-stored after the acquire that
// saw the flag, so the proxy's bytes are visible to whoever sees the mirror; its waiters have twice the
// deadline, so that block 0 reports a lost signal). Both only grow, so block 0 reads the mirror first: when an
// earlier wait of the call already saw the value (rows often land with their headers), no PCIe read.
__device__ bool wait_all(const Args& a, int64_t gpu_sig, int64_t host_sig, unsigned long long near,
                         unsigned long long far, int phase) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  for (int s = threadIdx.x; s < a.num_ranks; s += blockDim.x) {
    const int ring = a.rings.n > 0 ? s % a.rings.n : 0;
    const bool remote = !same_node(a, s);
    const unsigned long long target = remote ? far : near;
    if (target == 0) continue;
    uint64_t* mirror = reinterpret_cast<uint64_t*>(a.buf + gpu_sig) + s;
    const bool on_host = remote && blockIdx.x == 0;
    if (on_host && intranode::ld_acquire_sys(mirror) >= target) continue;  // an earlier wait saw it: no PCIe read
    const uint64_t* polled = on_host ? a.host_flags + host_sig + s : mirror;
    const int64_t deadline = remote && !on_host ? intranode::mirror_timeout(a.timeout_cycles) : a.timeout_cycles;
    if (!wait_geq(polled, target, deadline, a.err, a.claim, a.rank, s, phase, remote ? ring : -1))
      failed = 1;
    else if (on_host)
      intranode::st_release_sys_u64(mirror, intranode::ld_acquire_sys(polled));
  }
  __syncthreads();
  return failed == 0;
}

// Raises rank r's signal by one after everything this rank wrote for it: NVLink peers by a system-scope
// atomic after a fence; other nodes by the proxy, one write of the block's `bytes` from byte `from` and the
// atomic behind it on the same channel (applied in order, so the signal means the bytes landed).
__device__ bool signal_rank(const Args& a, int r, int64_t gpu_sig, int64_t host_sig, int64_t send_area,
                            int64_t recv_area, int64_t block_bytes, int64_t from, int64_t bytes, int phase) {
  if (same_node(a, r)) {
    __threadfence_system();
    uint64_t* sig = reinterpret_cast<uint64_t*>(a.peers[r % a.ranks_per_node] + gpu_sig) + a.rank;
    atomicAdd_system(reinterpret_cast<unsigned long long*>(sig), 1ull);
    return true;
  }
  const int ring = r % a.rings.n;
  uccl::Command cmds[2];
  int n = 0;
  if (bytes > 0) {
    cmds[n].op = uccl::OP_WRITE;
    cmds[n].dst_rank = uint8_t(r);
    cmds[n].channel = uint8_t(ring);
    cmds[n].region = 0;
    cmds[n].length = uint32_t(bytes);
    cmds[n].local_off = uint32_t(send_area + r * block_bytes + from);
    cmds[n].remote_off = uint32_t(recv_area + a.rank * block_bytes + from);
    ++n;
  }
  cmds[n].op = uccl::OP_ATOMIC_ADD;
  cmds[n].dst_rank = uint8_t(r);
  cmds[n].channel = uint8_t(ring);
  cmds[n].region = 1;
  cmds[n].length = 1u;
  cmds[n].local_off = 0;
  cmds[n].remote_off = uint32_t(8 * (host_sig + a.rank));
  ++n;
  uccl::ring_release_data();
  if (!uccl::ring_push(a.rings.r[ring], cmds, uint32_t(n), a.ring_spins)) {
    report_error(a.err, a.claim, kErrRingFull, a.rank, r, phase, n, 0, ring);
    return false;
  }
  return true;
}

// ---- FP8 ------------------------------------------------------------------------------------------------
// float -> e4m3 (fn: bias 7, max 448; fnuz: bias 8, max 240, no negative zero), round to nearest even,
// saturating: the same bits as torch's cast of an already clamped value, on every GPU.
__device__ __forceinline__ uint32_t to_e4m3(float v, bool fnuz) {
  const uint32_t sign = (__float_as_uint(v) >> 24) & 0x80u;
  const float m = fabsf(v);
  const uint32_t max_code = fnuz ? 0x7Fu : 0x7Eu;
  uint32_t code;
  if (m < (fnuz ? 0.0078125f : 0.015625f)) {  // subnormal: steps of 2^-10 (fnuz) / 2^-9 (fn)
    code = uint32_t(__float2int_rn(m * (fnuz ? 1024.f : 512.f)));
  } else {
    const uint32_t b = __float_as_uint(m);
    int e = int((b >> 23) & 0xffu) - 127 + (fnuz ? 8 : 7);
    uint32_t mant = (b >> 20) & 7u;
    const uint32_t rest = b & 0xfffffu;
    if (rest > 0x80000u || (rest == 0x80000u && (mant & 1u))) {
      if (++mant == 8u) {
        mant = 0;
        ++e;
      }
    }
    code = (uint32_t(e) << 3) | mant;
    if (code > max_code) code = max_code;
  }
  return code == 0 && fnuz ? 0u : (code | sign);
}

// Scale of a 128-channel block: amax / fp8 max (at least 1e-4 / max), rounded up to a power of two with
// round_scale. As uccl_ep_train/fp8.py's per_token_cast_to_fp8 computes it on a GPU, bit for bit: torch
// divides by a scalar as a multiplication by its float reciprocal.
__device__ __forceinline__ float fp8_scale(float amax, bool fnuz, bool round_scale) {
  float s = fmaxf(amax, 1e-4f) * (fnuz ? 1.0f / 240.f : 1.0f / 448.f);
  if (round_scale) {
    const uint32_t b = __float_as_uint(s);
    if (b & 0x7fffffu) s = __uint_as_float(((b >> 23) + 1u) << 23);
  }
  return s;
}

// One warp casts part `part` of `parts` of token t to FP8 once and stores it at each of outs[0..n): hidden
// bytes, then float scales. A part is every parts-th pass of 256 channels (a pass: 8 channels per lane, 16
// lanes per 128-channel block), so several warps share a token when there are fewer tokens than warps.
__device__ void cast_token_fp8(const Args& a, int t, char* const* outs, int n, int lane, int part, int parts) {
  const int H = a.hidden;
  const int4* src = reinterpret_cast<const int4*>(a.x + int64_t(t) * H * 2);
  const float fmax = a.fnuz ? 240.f : 448.f;
  for (int base = part * kWarpSize; base < H / 8; base += parts * kWarpSize) {
    const int i = base + lane;
    const bool live = i < H / 8;  // H is a multiple of 128: a 16-lane group is all live or all not
    float v[8];
    float amax = 0.f;
    if (live) {
      const int4 raw = intranode::ld_nc_v4(src + i);
      const uint32_t w[4] = {uint32_t(raw.x), uint32_t(raw.y), uint32_t(raw.z), uint32_t(raw.w)};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[2 * j] = __uint_as_float(w[j] << 16);
        v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
    }
#pragma unroll
    for (int d = 8; d >= 1; d >>= 1) {
#if defined(UCCL_EP_WITH_HIP)
      amax = fmaxf(amax, __shfl_xor(amax, d));
#else
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
#endif
    }
    if (!live) continue;
    const float s = fp8_scale(amax, a.fnuz, a.round_scale);
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float q = fminf(fmaxf(__fdiv_rn(v[j], s), -fmax), fmax);
      const uint32_t c = to_e4m3(q, a.fnuz);
      if (j < 4) lo |= c << (8 * j);
      else hi |= c << (8 * (j - 4));
    }
    for (int d = 0; d < n; ++d) {
      reinterpret_cast<uint2*>(outs[d])[i] = make_uint2(lo, hi);
      if ((lane & 15) == 0) reinterpret_cast<float*>(outs[d] + H)[i / 16] = s;
    }
  }
}

// ---- kernels --------------------------------------------------------------------------------------------
constexpr int kCombineVectors = 7;  // 16-byte vectors per lane a combine_recv warp sums at once: 7 x 32 x 8 channels
                                    // is a quarter of hidden 7168 (DeepSeek-V3), no register spills

// Bytes between consecutive messages of this call: the layout's msg_bytes (header and BF16 row), or with FP8
// the header, the FP8 row and its float scales, 16-byte aligned (about half: the blocks' writes move only that).
__device__ __forceinline__ int64_t msg_stride(const Args& a) {
  if (!a.use_fp8) return a.lay.msg_bytes;
  return (kMsgHeaderBytes + a.hidden + a.hidden / 128 * 4 + 15) / 16 * 16;
}

// The last s in [0, n) with base[s] <= j (base ascending: the block, of n, that flat entry j falls in).
__device__ __forceinline__ int block_of(const int* base, int n, int j) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (base[mid] <= j) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ int ld_volatile(const int* p) { return *reinterpret_cast<const volatile int*>(p); }

// Lane i gets v[0] + ... + v[i] over the warp's lanes.
__device__ __forceinline__ int warp_inclusive_sum(int v, int lane) {
  for (int d = 1; d < kWarpSize; d <<= 1) {
    const int y = intranode::warp_shfl(v, lane >= d ? lane - d : lane);
    if (lane >= d) v += y;
  }
  return v;
}

// One warp: out[i * ostride] = in[0] + ... + in[(i - 1) * stride] for i < n (shared memory, strided so that a
// column of a table scans too); returns the total. A warp-wide scan per pass of kWarpSize values: a thread
// summing a whole row of L = 128 counts alone took microseconds at the head of every LL kernel.
__device__ int warp_exclusive_scan(const int* in, int stride, int* out, int ostride, int n, int lane) {
  int carry = 0;
  for (int base = 0; base < n; base += kWarpSize) {
    const int i = base + lane;
    const int v = i < n ? in[i * stride] : 0;
    const int x = warp_inclusive_sum(v, lane);
    if (i < n) out[i * ostride] = carry + x - v;
    carry += intranode::warp_shfl(x, kWarpSize - 1);
  }
  return carry;
}

constexpr int kDestGroup = 8;  // destinations a dispatch_send warp stores one read (or cast) of a row part to

__device__ __forceinline__ void dispatch_send(const Args& a, int* smem) {
  // smem: rows[E] (this rank's rows for expert e, at most max_tokens), base[E] (the expert's first row in its
  // destination block), earlier[E] (rows for e from the tokens before this block's), msgs[R] (this rank's
  // messages to r), before[R] (those of tokens before this block's), then each token's destinations as a bit
  // mask, uint32 [T][W]
  const int warp = int(threadIdx.x) / kWarpSize, lane = int(threadIdx.x) % kWarpSize;
  const int E = a.num_experts, L = a.num_local, R = a.num_ranks, K = a.num_topk, T = a.num_tokens;
  const int M = a.max_tokens, W = (R + 31) / 32;
  const Layout& lay = a.lay;
  const Counters ctr = counters(a);
  const int64_t stride = msg_stride(a);
  int* rows = smem;
  int* base = smem + E;
  int* earlier = smem + 2 * E;
  int* msgs = smem + 3 * E;
  int* before = msgs + R;
  unsigned* dests = reinterpret_cast<unsigned*>(before + R);
  const int per_block = (T + int(gridDim.x) - 1) / int(gridDim.x);
  const int t_lo = min(T, int(blockIdx.x) * per_block), t_hi = min(T, t_lo + per_block);
  auto goes_to = [&](int t, int r) { return ((dests[t * W + r / 32] >> (r % 32)) & 1u) != 0; };
  auto message_of = [&](int t, int r) {  // token t's message on r (t one of this block's tokens)
    int m = before[r];
    for (int u = t_lo; u < t; ++u) m += goes_to(u, r);
    return m;
  };

  // 1. every block, from topk_idx alone (no grid barrier: nothing here needs another block): which ranks each
  //    token goes to (a token is one message to a rank, however many of its experts are there), how many
  //    messages each rank gets from this rank and from the tokens before this block's, each expert's rows (an
  //    expert takes at most max_tokens rows from one source, its share of the receiver's packed output: only a
  //    token listing it several times can exceed that; the rows past it are dropped and the call raises) with
  //    their first row in the destination block, and those of the tokens before this block's
  for (int i = threadIdx.x; i < T * W; i += blockDim.x) dests[i] = 0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) rows[e] = earlier[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < T * K; p += blockDim.x) {
    const int64_t e = a.topk_idx[p];
    if (e < 0 || e >= E) continue;
    atomicOr(dests + (p / K) * W + int(e / L) / 32, 1u << (int(e / L) % 32));
    atomicAdd(rows + e, 1);
    if (p < t_lo * K) atomicAdd(earlier + e, 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    if (blockIdx.x == 0 && rows[e] > M)
      report_error(a.err, a.claim, kErrExpertFull, a.rank, e, kPhaseDispatchSend, rows[e], M);
    rows[e] = min(rows[e], M);
  }
  for (int r = warp; r < R; r += kWarps) {
    int total = 0, earlier_msgs = 0;
    for (int t0 = 0; t0 < T; t0 += kWarpSize) {
      const int t = t0 + lane;
      const uint64_t hit = intranode::warp_ballot(t < T && goes_to(t, r));
      const int below = min(max(t_lo - t0, 0), kWarpSize);  // lanes of tokens before this block's
      total += __popcll(hit);
      earlier_msgs += __popcll(below >= 64 ? hit : hit & ((1ull << below) - 1ull));
    }
    if (lane == 0) msgs[r] = total, before[r] = earlier_msgs;
  }
  __syncthreads();
  for (int r = warp; r < R; r += kWarps) warp_exclusive_scan(rows + r * L, 1, base + r * L, 1, L, lane);
  __syncthreads();

  // 2. block 0 sends every destination its counts header now (a warp per destination: lanes write it, lane 0
  //    signals; the first signal of the call), so the receivers know where every source's rows go before the
  //    messages arrive and can unpack the node's blocks while the other nodes' travel
  if (blockIdx.x == 0) {
    for (int r = warp; r < R; r += kWarps) {
      int* hdr = reinterpret_cast<int*>(out_block(a, r, lay.d_send, lay.d_recv, lay.block_bytes));
      for (int le = lane; le < L; le += kWarpSize) hdr[le] = rows[r * L + le];
      __threadfence_system();
      intranode::warp_sync();
      if (lane == 0)
        signal_rank(a, r, lay.gpu_dsig, lay.host_dsig, lay.d_send, lay.d_recv, lay.block_bytes, 0, lay.hdr_bytes,
                    kPhaseDispatchSend);
    }
  }

  // 3. warp 0: this block's (token, top-k slot) pairs in order get their rows (an expert's rows from this rank
  //    in token order, then top-k order: the order the receiver unpacks them in): pair_pos (the combine's input)
  //    and the destination's row index (the row's message). A pair's rank among the earlier pairs of its expert
  //    is the block's `earlier` count plus a count over the lanes of its pass. Ids are checked here, on the GPU
  //    (no host sync): a bad one moves nothing and the call raises on the next use. With each expert capped at
  //    max_tokens rows a block's row index never overflows: it gets at most min(L, top-k) x max_tokens rows.
  if (warp == 0) {
    for (int p0 = t_lo * K; p0 < t_hi * K; p0 += kWarpSize) {
      const int p = p0 + lane;
      const bool live = p < t_hi * K;
      const int64_t e = live ? a.topk_idx[p] : -1;
      if (live && (e < -1 || e >= E))
        report_error(a.err, a.claim, kErrBadExpert, a.rank, p / K, kPhaseDispatchSend, intranode::saturate_int(e), E,
                     p % K);
      const int ev = live && e >= 0 && e < E ? int(e) : -1;
      int same_before = 0, same_after = 0;  // lanes of this pass with the same expert
      for (int d = 0; d < kWarpSize; ++d) {
        const int other = intranode::warp_shfl(ev, d);
        same_before += other == ev && d < lane;
        same_after += other == ev && d > lane;
      }
      if (live) {
        const int pos = ev >= 0 ? earlier[ev] + same_before : M;
        a.pair_pos[p] = pos < M ? base[ev] + pos : -1;  // -1: no expert, a bad id, or past the expert's rows
        if (pos < M) {
          const int r = ev / L;
          char* blk = out_block(a, r, lay.d_send, lay.d_recv, lay.block_bytes);
          reinterpret_cast<int*>(blk + lay.hdr_bytes)[base[ev] + pos] = message_of(p / K, r);
        }
      }
      intranode::warp_sync();  // every lane read earlier[] before the pass's last pair of an expert moves it
      if (ev >= 0 && same_after == 0) earlier[ev] += same_before + 1;
      intranode::warp_sync();
    }
  }

  // 4. every block writes its tokens' messages (BF16 copy or FP8 cast, straight from x) into their
  //    destinations: a node peer's receive block over NVLink/xGMI, else this rank's send block for the
  //    proxies. Warps over (token, part of its row); a part is read (and cast to FP8) once and stored to up to
  //    kDestGroup destinations at a time.
  const int mine = t_hi - t_lo, vecs = a.hidden / 8;
  const int parts = max(1, min(kWarps / max(mine, 1), a.hidden / (8 * kWarpSize)));
  for (int j = warp; j < mine * parts; j += kWarps) {
    const int t = t_lo + j / parts, part = j % parts;
    const int per = (vecs + parts - 1) / parts, v0 = min(part * per, vecs), nv = min(per, vecs - v0);
    char* out[kDestGroup];
    int n = 0;
    for (int r = 0; r <= R; ++r) {
      if (r < R && goes_to(t, r)) {
        char* msg = out_block(a, r, lay.d_send, lay.d_recv, lay.block_bytes) + lay.hdr_bytes + lay.idx_bytes +
                    message_of(t, r) * stride;
        if (part == 0 && lane == 0) *reinterpret_cast<int4*>(msg) = make_int4(t, 0, 0, 0);
        out[n++] = msg + kMsgHeaderBytes + (a.use_fp8 ? 0 : int64_t(v0) * 16);
      }
      if (n == kDestGroup || (r == R && n > 0)) {
        if (a.use_fp8) {
          cast_token_fp8(a, t, out, n, lane, part, parts);
        } else if (nv > 0) {
          intranode::warp_push_row<int4, 4, true>(a.x + (int64_t(t) * vecs + v0) * 16, int64_t(nv) * 16, out, n, lane);
        }
        n = 0;
      }
    }
  }

  // 5. per destination, the block that completes it (its row index entries and messages) raises the second
  //    signal; one completion atomic per block and destination (every thread fenced its own writes first)
  __threadfence_system();
  __syncthreads();
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    if (atomicAdd(ctr.d_done + r, 1u) != gridDim.x - 1) continue;
    __threadfence_system();
    ctr.d_done[r] = 0;
    signal_rank(a, r, lay.gpu_dsig, lay.host_dsig, lay.d_send, lay.d_recv, lay.block_bytes, lay.hdr_bytes,
                msgs[r] > 0 ? lay.idx_bytes + msgs[r] * stride : 0, kPhaseDispatchSend);
  }
}

// Message j of the flattened (source, local expert, row) order -> its source s, expert le and row i.
__device__ __forceinline__ void locate(const int* src_base, const int* in_off, int R, int L, int j, int& s, int& le,
                                       int& i) {
  s = block_of(src_base, R, j);  // the blocks are in rank order
  const int idx = j - src_base[s];
  int lo = 0, hi = L - 1;  // last le with in_off[s][le] <= idx
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (in_off[s * L + mid] <= idx) lo = mid;
    else hi = mid - 1;
  }
  le = lo;
  i = idx - in_off[s * L + le];
}

// Prefix tables over counts cnt[s][le] (by source block): in_off[s][le] (row in s's block), out_off[le][s]
// (row in local expert le's packed output), src_base[s] (first message of block s in the flat order): warp
// scans over rows (sources) and columns (local experts), then over the block totals.
__device__ void prefix_tables(const int* cnt, int* in_off, int* out_off, int* src_base, int R, int L) {
  const int warp = int(threadIdx.x) / kWarpSize, lane = int(threadIdx.x) % kWarpSize;
  for (int s = warp; s < R; s += kWarps) {
    const int total = warp_exclusive_scan(cnt + s * L, 1, in_off + s * L, 1, L, lane);
    if (lane == 0) src_base[s] = total;  // block s's rows, summed below
  }
  for (int le = warp; le < L; le += kWarps) warp_exclusive_scan(cnt + le, L, out_off + le * R, 1, R, lane);
  __syncthreads();
  if (warp == 0) {
    const int total = warp_exclusive_scan(src_base, 1, src_base, 1, R, lane);
    if (lane == 0) src_base[R] = total;
  }
  __syncthreads();
}

// One warp: message `msg` to row `row` of local expert le in the packed outputs (x, source token, FP8 scales).
__device__ __forceinline__ void unpack_message(const Args& a, const char* msg, int le, int64_t row, int64_t rows,
                                               int lane) {
  const int H = a.hidden, S = H / 128;                     // FP8 scales per row
  const int64_t x_bytes = a.use_fp8 ? H : int64_t(H) * 2;  // payload bytes of a row
  char* dst = a.recv_x + (le * rows + row) * x_bytes;
  intranode::warp_push_row<int4, 4, false>(msg + kMsgHeaderBytes, x_bytes, &dst, 1, lane);
  if (lane == 0) a.src_info[le * rows + row] = *reinterpret_cast<const volatile int*>(msg);
  if (!a.use_fp8) return;
  // scales: [L][S][rows] float, or [L][S/4][rows] packed UE8M0 exponents
  const float* sc = reinterpret_cast<const float*>(msg + kMsgHeaderBytes + H);
  if (!a.use_ue8m0) {
    float* out = reinterpret_cast<float*>(a.recv_scales);
    for (int q = lane; q < S; q += kWarpSize) out[(int64_t(le) * S + q) * rows + row] = sc[q];
  } else {
    int* out = reinterpret_cast<int*>(a.recv_scales);
    for (int q = lane; q < S / 4; q += kWarpSize) {
      uint32_t packed = 0;
      for (int b = 0; b < 4; ++b) packed |= ((__float_as_uint(sc[4 * q + b]) >> 23) & 0xffu) << (8 * b);
      out[(int64_t(le) * (S / 4) + q) * rows + row] = int(packed);
    }
  }
}

__device__ __forceinline__ void dispatch_recv(const Args& a, int* smem) {
  // smem: cnt[R*L], in_off[R*L], out_off[L*R], src_base[R+1]
  const int R = a.num_ranks, L = a.num_local, M = a.max_tokens;
  const Layout& lay = a.lay;
  int* cnt = smem;
  int* in_off = smem + R * L;
  int* out_off = in_off + R * L;
  int* src_base = out_off + R * L;
  unsigned long long* seq = seq_word(a, 0);
  const int64_t stride = msg_stride(a);
  const unsigned long long calls = *reinterpret_cast<volatile unsigned long long*>(seq);
  // the node's blocks whole (messages too), the other nodes' headers: where every row goes
  if (!wait_all(a, lay.gpu_dsig, lay.host_dsig, 2 * calls + 2, 2 * calls + 1, kPhaseDispatchRecv)) return;
  const char* recv = a.buf + lay.d_recv;
  for (int i = threadIdx.x; i < R * L; i += blockDim.x)
    cnt[i] = reinterpret_cast<const volatile int*>(recv + (i / L) * lay.block_bytes)[i % L];
  __syncthreads();
  prefix_tables(cnt, in_off, out_off, src_base, R, L);

  const int warp = int(threadIdx.x) / kWarpSize, lane = int(threadIdx.x) % kWarpSize;
  const int64_t rows = int64_t(R) * M;  // rows per local expert in the outputs
  // The node's blocks first (its ranks are consecutive: one range of the flat order), then, once their rows
  // landed, the other nodes' blocks (the rest of the order): the node's unpacking overlaps their trip. Block 0
  // sits out the first pass when there are other nodes: it polls their signals in host memory for the others,
  // which would otherwise see them only after block 0's share of the node's rows.
  const bool far_nodes = R > a.ranks_per_node;
  const int node0 = a.rank / a.ranks_per_node * a.ranks_per_node;
  const int near0 = src_base[node0], near = src_base[node0 + a.ranks_per_node] - near0;
  for (int pass = 0; pass < (far_nodes ? 2 : 1); ++pass) {
    if (pass == 1 && !wait_all(a, lay.gpu_dsig, lay.host_dsig, 0, 2 * calls + 2, kPhaseDispatchRecv)) return;
    const int skip = pass == 0 && far_nodes && gridDim.x > 1 ? 1 : 0;  // blocks sitting out the pass
    if (int(blockIdx.x) < skip) continue;
    const int gw = (int(blockIdx.x) - skip) * kWarps + warp, nw = (int(gridDim.x) - skip) * kWarps;
    const int count = pass == 0 ? near : src_base[R] - near;
    for (int f = gw; f < count; f += nw) {
      int s, le, i;
      locate(src_base, in_off, R, L, pass == 0 ? near0 + f : f < near0 ? f : f + near, s, le, i);
      const char* blk = recv + s * lay.block_bytes;
      const int m = ld_volatile(reinterpret_cast<const int*>(blk + lay.hdr_bytes) + in_off[s * L + le] + i);
      unpack_message(a, blk + lay.hdr_bytes + lay.idx_bytes + m * stride, le, int64_t(out_off[le * R + s]) + i, rows,
                     lane);
    }
  }
  if (blockIdx.x == 0) {
    for (int le = threadIdx.x; le < L; le += blockDim.x) {
      int total = 0;
      for (int s = 0; s < R; ++s) {
        const int c = cnt[s * L + le];
        a.layout_range[le * R + s] = (int64_t(out_off[le * R + s]) << 32) | int64_t(c);
        total += c;
      }
      a.recv_count[le] = total;
      if (a.stats != nullptr) a.stats[le] += total;
    }
  }
  finish_launch(a, kBlocksDoneWord + 0, seq, calls + 1);
}

// Combine: the counts of every (local expert, source) pair come from the handle's layout_range.
__device__ __forceinline__ void combine_send(const Args& a, int* smem) {
  // smem: cnt[R*L] (by destination block), in_off[R*L], out_off[L*R], dst_base[R+1]
  const int R = a.num_ranks, L = a.num_local, M = a.max_tokens, H = a.hidden;
  const Layout& lay = a.lay;
  int* cnt = smem;
  int* in_off = smem + R * L;
  int* out_off = in_off + R * L;
  int* dst_base = out_off + R * L;
  for (int i = threadIdx.x; i < R * L; i += blockDim.x) {
    const int r = i / L, le = i % L;
    cnt[i] = int(a.layout_range[le * R + r] & 0xffffffffll);
  }
  __syncthreads();
  prefix_tables(cnt, in_off, out_off, dst_base, R, L);
  const int warp = int(threadIdx.x) / kWarpSize, lane = int(threadIdx.x) % kWarpSize;
  const int gw = int(blockIdx.x) * kWarps + warp, nw = int(gridDim.x) * kWarps;
  const int64_t rows = int64_t(R) * M, row_bytes = int64_t(H) * 2;
  const Counters ctr = counters(a);
  // Rows for other nodes first, as in dispatch_send. The node's ranks are consecutive, so its rows are one
  // range of the flat order, [near0, near0 + near); the other nodes' rows are the rest.
  const int node0 = a.rank / a.ranks_per_node * a.ranks_per_node;
  const int near0 = dst_base[node0], near = dst_base[node0 + a.ranks_per_node] - near0;
  for (int pass = R > a.ranks_per_node ? 0 : 1; pass < 2; ++pass) {
    const int count = pass == 0 ? dst_base[R] - near : near;
    for (int q = gw; q < count; q += nw) {
      const int j = pass == 1 ? near0 + q : q < near0 ? q : q + near;
      int r, le, i;
      locate(dst_base, in_off, R, L, j, r, le, i);
      const char* src = a.x + (le * rows + out_off[le * R + r] + i) * row_bytes;
      char* dst = out_block(a, r, lay.c_send, lay.c_recv, lay.cblock_bytes) +
                  int64_t(in_off[r * L + le] + i) * row_bytes;
      intranode::warp_push_row<int4, 4>(src, row_bytes, &dst, 1, lane);
    }
    __threadfence_system();  // then one completion atomic per block and destination, as in dispatch_send
    __syncthreads();
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
      if (same_node(a, r) != (pass == 1) || atomicAdd(ctr.c_done + r, 1u) != gridDim.x - 1) continue;
      __threadfence_system();
      ctr.c_done[r] = 0;
      signal_rank(a, r, lay.gpu_csig, lay.host_csig, lay.c_send, lay.c_recv, lay.cblock_bytes, 0,
                  int64_t(dst_base[r + 1] - dst_base[r]) * row_bytes, kPhaseCombineSend);
    }
  }
}

__device__ __forceinline__ void combine_recv(const Args& a) {
  constexpr int U = kCombineVectors;
  const int L = a.num_local, H = a.hidden, K = a.num_topk;
  const Layout& lay = a.lay;
  unsigned long long* seq = seq_word(a, 1);
  const unsigned long long target = *reinterpret_cast<volatile unsigned long long*>(seq) + 1;
  if (!wait_all(a, lay.gpu_csig, lay.host_csig, target, target, kPhaseCombineRecv)) return;
  const int warp = int(threadIdx.x) / kWarpSize, lane = int(threadIdx.x) % kWarpSize;
  const int gw = int(blockIdx.x) * kWarps + warp, nw = int(gridDim.x) * kWarps;
  const char* recv = a.buf + lay.c_recv;
  const int64_t row_bytes = int64_t(H) * 2;
  const int vecs = H / 8;                                   // 16-byte vectors of a row
  const int chunks = (vecs + U * kWarpSize - 1) / (U * kWarpSize);
  // Warps over (token, chunk of U vectors per lane): with 128 tokens every warp of the grid has one. Per
  // top-k slot a lane has its U loads in flight before it adds them; the sum runs in top-k order.
  for (int j = gw; j < a.num_tokens * chunks; j += nw) {
    const int t = j / chunks;
    const int v0 = (j % chunks) * U * kWarpSize + lane;
    float acc[U][8];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[u][c] = 0.f;
    for (int k = 0; k < K; ++k) {
      const int64_t e = a.topk_idx[int64_t(t) * K + k];
      const int pos = a.pair_pos[int64_t(t) * K + k];
      if (e < 0 || e >= a.num_experts || pos < 0) continue;  // no expert, or a row the dispatch dropped
      const float w = a.topk_w[int64_t(t) * K + k];
      const int4* row = reinterpret_cast<const int4*>(recv + (e / L) * lay.cblock_bytes + int64_t(pos) * row_bytes);
      int4 raw[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        raw[u] = v0 + u * kWarpSize < vecs ? intranode::ld_global_v4(row + v0 + u * kWarpSize) : make_int4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint32_t wd[4] = {uint32_t(raw[u].x), uint32_t(raw[u].y), uint32_t(raw[u].z), uint32_t(raw[u].w)};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          acc[u][2 * c] += w * __uint_as_float(wd[c] << 16);
          acc[u][2 * c + 1] += w * __uint_as_float(wd[c] & 0xffff0000u);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * kWarpSize;
      if (v >= vecs) continue;
      uint32_t o[4];
#pragma unroll
      for (int c = 0; c < 4; ++c)
        o[c] = uint32_t(intranode::float_to_bf16(acc[u][2 * c])) |
               (uint32_t(intranode::float_to_bf16(acc[u][2 * c + 1])) << 16);
      reinterpret_cast<int4*>(a.out + int64_t(t) * row_bytes)[v] =
          make_int4(int(o[0]), int(o[1]), int(o[2]), int(o[3]));
    }
  }
  finish_launch(a, kBlocksDoneWord + 1, seq, target);
}

// One kernel per call kind, as DeepEP's: a call without recv hook runs both phases in one launch (each block
// sends, then receives: every block of the launch is resident, so the one that waits for another's signal
// cannot hold an SM it needs); a hooked call launches the send phase now and the receive phase in the hook.
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(Args a) {
  extern __shared__ int smem[];
  if (a.phases & kSendPhase) dispatch_send(a, smem);
  if (a.phases == (kSendPhase | kRecvPhase)) __syncthreads();  // the receive reuses the shared memory
  if (a.phases & kRecvPhase) dispatch_recv(a, smem);
}

__global__ void __launch_bounds__(kThreads, 1) combine_kernel(Args a) {
  extern __shared__ int smem[];
  if (a.phases & kSendPhase) combine_send(a, smem);
  if (a.phases & kRecvPhase) combine_recv(a);
}

int64_t dispatch_send_smem(const Args& a) {
  return (3 * int64_t(a.num_experts) + 2 * a.num_ranks + int64_t(a.num_tokens) * ((a.num_ranks + 31) / 32)) * 4;
}

int64_t table_smem(const Args& a) { return (3 * int64_t(a.num_ranks) * a.num_local + a.num_ranks + 1) * 4; }

template <typename K>
void launch(K kernel, const Args& a, int blocks, int64_t smem, gpuStream_t stream, const char* what) {
#if defined(UCCL_EP_WITH_HIP)
  hipLaunchKernelGGL(kernel, dim3(blocks), dim3(kThreads), size_t(smem), stream, a);
#else
  kernel<<<blocks, kThreads, size_t(smem), stream>>>(a);
#endif
  const gpuError_t e = gpuGetLastError();
  UCCL_CHECK(e == gpuSuccess, what << ": launch failed: " << gpuGetErrorString(e));
}

}  // namespace

void preload_kernels() {
  gpuFuncAttributes attr;
  UCCL_CHECK_GPU(gpuFuncGetAttributes(&attr, reinterpret_cast<const void*>(dispatch_kernel)));
  UCCL_CHECK_GPU(gpuFuncGetAttributes(&attr, reinterpret_cast<const void*>(combine_kernel)));
}

void launch_dispatch(const Args& a, int blocks, gpuStream_t stream) {
  // the send phase keeps each token's destinations (a bit per rank) with the counts, beside the kernel's
  // static shared memory
  static const int64_t limit = [] {
    gpuFuncAttributes attr;
    UCCL_CHECK_GPU(gpuFuncGetAttributes(&attr, reinterpret_cast<const void*>(dispatch_kernel)));
    return 48 * 1024 - int64_t(attr.sharedSizeBytes);
  }();
  const int64_t send = a.phases & kSendPhase ? dispatch_send_smem(a) : 0;
  UCCL_CHECK(send <= limit, "low_latency_dispatch: " << a.num_tokens << " tokens x " << a.num_ranks << " ranks x "
                            << a.num_experts << " experts need " << send << " bytes of shared memory in the send "
                            << "phase, more than its " << limit << " (fewer tokens per call)");
  const int64_t recv = a.phases & kRecvPhase ? table_smem(a) : 0;
  launch(dispatch_kernel, a, blocks, send > recv ? send : recv, stream, "low-latency dispatch");
}
void launch_combine(const Args& a, int blocks, gpuStream_t stream) {
  launch(combine_kernel, a, blocks, a.phases & kSendPhase ? table_smem(a) : 0, stream, "low-latency combine");
}

}  // namespace uccl_ep::low_latency
