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
#include "kernels/row_ops.cuh"

namespace uccl_ep::intranode {

// ------------------------------------------------------------------------------------------------ notify
// Exclusive prefix sums, in place, of rows 0..rows-1 of s_scan (kNotifyThreads values each; rows <= warps
// of the block): warp w sums row w lane by lane, one thread per row scans the lane sums, warp w writes back.
__device__ __forceinline__ void exclusive_scan_rows(int (*s_scan)[kNotifyThreads], int (*s_lane)[kWarpSize],
                                                    int rows) {
  constexpr int kPerLane = kNotifyThreads / kWarpSize;
  const int tid = threadIdx.x, w = tid / kWarpSize, lane = tid % kWarpSize;
  if (w < rows) {
    int s = 0;
    for (int i = 0; i < kPerLane; ++i) s += s_scan[w][lane * kPerLane + i];
    s_lane[w][lane] = s;
  }
  __syncthreads();
  if (tid < rows) {
    int acc = 0;
    for (int l = 0; l < kWarpSize; ++l) {
      const int v = s_lane[tid][l];
      s_lane[tid][l] = acc;
      acc += v;
    }
  }
  __syncthreads();
  if (w < rows) {
    int acc = s_lane[w][lane];
    for (int i = 0; i < kPerLane; ++i) {
      const int v = s_scan[w][lane * kPerLane + i];
      s_scan[w][lane * kPerLane + i] = acc;
      acc += v;
    }
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kNotifyThreads) notify_kernel(NotifyArgs a) {
  if (threadIdx.x == 0) adopt_peer_error(a.sig.err, a.sig.claim);  // a peer failed since the last call
  const int R = a.num_ranks, me = a.rank, tid = threadIdx.x, N = a.num_tokens;
  const int epr = a.num_experts / R;
  char* my = a.peers.p[me];
  uint64_t* arrive = reinterpret_cast<uint64_t*>(my + kArriveOffset);
  uint64_t* free_ = reinterpret_cast<uint64_t*>(my + kFreeOffset);
  const OpSeq op = OpSeq::at(my);
  const uint64_t base = op.read();
  __shared__ int s_scan[kMaxRanks][kNotifyThreads];
  __shared__ int s_lane[kMaxRanks][kWarpSize];
  __shared__ int s_counts[kMaxRanks][kMaxRanks];
  __shared__ int s_total[kMaxRanks], s_bad;

  if (tid < R && tid != me) wait_geq(&free_[tid], base, a.sig.timeout_cycles, a.sig.err, a.sig.claim, me, tid, kPhaseNotify);
  __syncthreads();

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
  exclusive_scan_rows(s_scan, s_lane, R);
  if (tid == kNotifyThreads - 1)
    for (int r = 0; r < R; ++r) s_total[r] = s_scan[r][tid] + run[r];  // tokens is_token_in_rank sends to r
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r)
    if (r < R) run[r] = s_scan[r][tid];
  for (int t = t0; t < t1; ++t) {
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r)
      if (r < R) a.send_pos[(int64_t)t * R + r] = a.in_rank[(int64_t)t * R + r] ? run[r]++ : -1;
  }

  __syncthreads();
  // The counts must be what is_token_in_rank sends (receivers place rows by them, senders by the mask); the
  // host checks it only with UCCL_EP_CHECK_VALUES=1. A mismatch, or an error pending from before (e.g. an
  // expert id out of range in the layout), is reported to every rank, and no count leaves this rank.
  if (tid == 0) {
    s_bad = error_pending(a.sig.claim);
    if (s_bad) adopt_peer_error(a.sig.err, a.sig.claim);
    for (int r = 0; r < R && !s_bad; ++r)
      if (s_total[r] != a.per_rank[r]) {
        report_error(a.sig.err, a.sig.claim, kErrBadCounts, me, r, kPhaseNotify, a.per_rank[r], s_total[r]);
        s_bad = 1;
      }
  }
  __syncthreads();
  if (s_bad) {
    if (tid == 0) op.exit_block(1);
    return;
  }
  // Push this rank's counts into slot [me] of every rank (own included): per-rank counts, then the
  // destination's local experts, and the call's shape at the slot's end.
  for (int r = 0; r < R; ++r) {
    int* slot = reinterpret_cast<int*>(a.peers.p[r] + kCountsOffset) + (int64_t)me * kCountsSlotInts;
    for (int i = tid; i < R + epr; i += blockDim.x) slot[i] = i < R ? a.per_rank[i] : a.per_expert[r * epr + i - R];
    if (tid < kShapeInts) slot[kCountsSlotInts - kShapeInts + tid] = a.shape[tid];
  }
  __threadfence_system();
  __syncthreads();
  if (tid == 0)
    for (int r = 0; r < R; ++r)
      if (r != me) signal_add(reinterpret_cast<uint64_t*>(a.peers.p[r] + kArriveOffset) + me);
  if (tid < R && tid != me)
    wait_geq(&arrive[tid], base + 1, a.sig.timeout_cycles, a.sig.err, a.sig.claim, me, tid, kPhaseNotify);
  __syncthreads();

  const volatile int* slots = reinterpret_cast<const volatile int*>(my + kCountsOffset);
  // Without a host sync (num_worst_tokens) the ranks' shapes are compared here: every rank finds a mismatch
  // (it differs from its own shape on some rank), reports it, and its dispatch then moves nothing.
  if (a.num_worst_tokens > 0 && tid < R && tid != me)
    for (int i = 1; i < kShapeInts; ++i) {
      const int theirs = slots[(int64_t)tid * kCountsSlotInts + kCountsSlotInts - kShapeInts + i];
      if (theirs != a.shape[i]) {
        report_error(a.sig.err, a.sig.claim, kErrShape, me, tid, kPhaseNotify, a.shape[i], theirs, i);
        break;
      }
    }
  if (tid < R * R) s_counts[tid / R][tid % R] = slots[(int64_t)(tid / R) * kCountsSlotInts + tid % R];
  // every rank's shape, for the host to check that the ranks agree on the call (after the handle matrices)
  if (tid < R * kShapeInts)
    a.info[R * R + epr + R * epr + 2 * R + tid] =
        slots[(int64_t)(tid / kShapeInts) * kCountsSlotInts + kCountsSlotInts - kShapeInts + tid % kShapeInts];
  __syncthreads();
  if (tid < R) {
    // DeepEP's handle matrices for one channel per rank pair, after the expert-major bases: rows sent to
    // rank tid (channel_prefix_matrix), where source tid's rows start here (recv_channel_prefix_matrix)
    int* channels = a.info + R * R + epr + R * epr;
    channels[tid] = a.per_rank[tid];
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      if (tid == me) channels[R + s] = acc;
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
  // Expert-major base row of each (source s, local expert e) block: experts in order, then source ranks.
  // With an expert capacity every block has exactly that many rows (the rows a source does not fill stay
  // as the host allocated them: zeros), and a source sending more is reported (its rows would spill into
  // the next block): this rank's dispatch then moves nothing, and its peers' neither.
  const int capacity = a.shape[kShapeExpertCapacity];
  if (capacity > 0) {
    int* em_base = a.info + R * R + epr;
    for (int i = tid; i < R * epr; i += blockDim.x) {
      const int s = i / epr, e = i % epr;
      em_base[s * epr + e] = (e * R + s) * capacity;
      const int sent = slots[(int64_t)s * kCountsSlotInts + R + e];
      if (sent > capacity) report_error(a.sig.err, a.sig.claim, kErrExpertCapacity, me, s, kPhaseNotify, sent, capacity, e);
    }
  } else {
    const int echunk = (epr + (int)blockDim.x - 1) / (int)blockDim.x;
    const int e0 = min(epr, tid * echunk), e1 = min(epr, e0 + echunk);
    int esum = 0;
    for (int e = e0; e < e1; ++e) esum += a.info[R * R + e];
    s_scan[0][tid] = esum;
    __syncthreads();
    exclusive_scan_rows(s_scan, s_lane, 1);
    int base = s_scan[0][tid];
    int* em_base = a.info + R * R + epr;
    for (int e = e0; e < e1; ++e) {
      int acc = base;
      for (int s = 0; s < R; ++s) {
        em_base[s * epr + e] = acc;
        acc += slots[(int64_t)s * kCountsSlotInts + R + e];
      }
      base += a.info[R * R + e];
    }
  }
  __syncthreads();
  if (tid == 0) {
    for (int r = 0; r < R; ++r)
      if (r != me) signal_add(reinterpret_cast<uint64_t*>(a.peers.p[r] + kFreeOffset) + me);
    op.exit_block(1);
  }
}

// Whether any rank's buffer must hold more rows than fit (data rows and row flags) in this op: rows_of(r)
// is rank r's row count; block 0 reports the ranks over (one thread calls it).
template <typename RowsOf>
__device__ __forceinline__ int over_capacity(const RowLayout& lay, const SignalArgs& sig, int R, int me, int phase,
                                             RowsOf rows_of) {
  const int64_t cap = min(lay.cap_rows, kMaxFlagRows);
  int over = 0;
  for (int r = 0; r < R; ++r) {
    const int total = rows_of(r);
    if (total > cap) {
      over = 1;
      if (blockIdx.x == 0) report_error(sig.err, sig.claim, kErrCapacity, me, r, phase, total, (int)cap);
    }
  }
  return over;
}

// ---------------------------------------------------------------------------------------------- dispatch
// Warp roles per block: the first `push_warps` warps push tokens (each token once per destination rank;
// every remote row is followed by a system-scope release of its "row landed" flag in the receiver's
// header); the other warps copy landed rows out of this rank's buffer while the pushes are still going.
// Push warps join the copy-out when their tokens are done. Rows for this block: i = lo_s + b + k*B.
template <typename V>
__device__ __forceinline__ void warp_copy_row(char* dst, const char* src, int64_t nbytes, int lane) {
  constexpr int U = 8;
  const int n = (int)(nbytes / (int64_t)sizeof(V));
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  for (int base = lane; base < n; base += kWarpSize * U) {
    V v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (base + u * kWarpSize < n) v[u] = s[base + u * kWarpSize];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (base + u * kWarpSize < n) d[base + u * kWarpSize] = v[u];
  }
}

__device__ __forceinline__ void warp_copy_words(void* dst, const void* src, int64_t nbytes, int lane) {
  const int* s = reinterpret_cast<const int*>(src);
  int* d = reinterpret_cast<int*>(dst);
  for (int i = lane; i < nbytes / 4; i += kWarpSize) d[i] = s[i];
}

// Row g (from 0) of the receive-order blocks [lo[r], hi[r]) of every rank r but `me`, taken in rank order:
// its row index; its rank in `r`. g must be below the blocks' total.
__device__ __forceinline__ int64_t row_of_others(int64_t g, const int* lo, const int* hi, int me, int& r) {
  for (r = 0;; ++r) {
    if (r == me) continue;
    if (g < hi[r] - lo[r]) return lo[r] + g;
    g -= hi[r] - lo[r];
  }
}

// How long an expand block waits for its launch's communication blocks to have started before it leaves
// (SideWork): ~50 us, far longer than a launch takes to place its first blocks.
constexpr int64_t kSidePatienceCycles = 100000;

template <typename V>
__global__ void __launch_bounds__(kDispatchThreads, 1) dispatch_kernel(DispatchArgs a) {
  if (blockIdx.x == 0 && threadIdx.x == 0) adopt_peer_error(a.sig.err, a.sig.claim);
  constexpr int kWarps = kDispatchThreads / kWarpSize;
  const int R = a.num_ranks, me = a.rank, tid = threadIdx.x, w = tid / kWarpSize, lane = tid % kWarpSize;
  const int K = a.num_topk, epr = a.experts_per_rank;
  const int push_warps = a.push_warps;
  char* my = a.peers.p[me];
  uint64_t* free_ = reinterpret_cast<uint64_t*>(my + kFreeOffset);
  const uint32_t* my_flags = reinterpret_cast<const uint32_t*>(my + kFlagsOffset);
  const OpSeq op = OpSeq::at(my);
  const uint64_t base = op.read();
  const uint32_t seq = (uint32_t)(base + 1);
  __shared__ int s_P[kMaxRanks * kMaxRanks];
  __shared__ int s_lo[kMaxRanks], s_hi[kMaxRanks], s_dstlo[kMaxRanks], s_nrows[kMaxRanks];
  __shared__ int s_skip, s_next;
  __shared__ char* s_dx[kWarps][kMaxRanks + kMaxExpertMajorTopk];  // row destinations of a warp's token
  __shared__ int s_dr[kWarps][kMaxRanks], s_ds[kWarps][kMaxRanks], s_nd[kWarps], s_nm[kWarps], s_own[kWarps];
  const bool em = a.em_x != nullptr;
  // Expand blocks (expert-major mode, a.expand_blocks > 0): the last a.expand_blocks blocks write every row's
  // expert-major copies (own tokens from x, landed rows from the buffer once flagged) as SideWork items; the
  // first nblk blocks push and copy out only the rows' metadata, then take the items nobody has claimed and
  // wait for all of them before releasing the buffer.
  const bool expand = a.expand_blocks > 0;
  const int nblk = (int)gridDim.x - a.expand_blocks;
  const char* data = my + kHeaderBytes;

  // Lane k's expert-major row for slot k (-1: none), per lane < em_k. Own token t (its row `own` in the
  // receive order): from topk_idx / topk_pos / em_base (fresh) or em_map (cached).
  auto own_dest = [&](int64_t t, int64_t own) {
    int d = -1;
    if (a.with_topk) {
      const int64_t e = a.topk_idx[t * K + lane] - (int64_t)me * epr;
      const int pos = a.topk_pos[t * K + lane];  // -1: a repeated id of this token (no row)
      if (e >= 0 && e < epr && pos >= 0) d = a.em_base[me * epr + (int)e] + pos;
    } else {
      d = a.em_map[own * a.em_k + lane];
    }
    return (d < 0 || d >= a.em_rows) ? -1 : d;
  };
  // Landed row i from source s: the id word's local expert and position (fresh; `local` out) or em_map's
  // entry `cached_d` (cached).
  auto landed_dest = [&](int s, int64_t i, int cached_d, int& local) {
    int d = cached_d;
    local = -1;
    if (a.with_topk) {
      const int64_t v = reinterpret_cast<const int64_t*>(data + a.lay.off_topk_idx)[i * K + lane];
      local = v < 0 ? -1 : (int)(v & 0xffffffffll);
      d = (local >= 0 && local < epr) ? a.em_base[s * epr + local] + (int)(v >> 32) : -1;
    }
    return (d < 0 || d >= a.em_rows) ? -1 : d;
  };
  // Gathers the warp's destinations (lanes with d >= 0) into s_dx[w][base..), returns how many.
  auto gather_dests = [&](int d, int base) {
    const uint64_t hit = warp_ballot(d >= 0);
    if (d >= 0) s_dx[w][base + __popcll(hit & ((1ull << lane) - 1ull))] = a.em_x + (int64_t)d * a.x_bytes;
    warp_sync();
    return __popcll(hit);
  };

  if (tid < R * R) s_P[tid] = a.rank_prefix[tid];
  __syncthreads();
  if (tid < R) {
    s_lo[tid] = tid > 0 ? s_P[(tid - 1) * R + me] : 0;  // rows from rank tid in my receive order
    s_hi[tid] = (int)min((int64_t)s_P[tid * R + me], a.out_rows);
    s_dstlo[tid] = me > 0 ? s_P[(me - 1) * R + tid] : 0;  // my first row on rank tid
    // rows of source tid that this block copies out: lo + blockIdx.x + k * nblk
    const int n = s_hi[tid] - s_lo[tid] - (int)blockIdx.x;
    s_nrows[tid] = (tid == me || n <= 0) ? 0 : (n + nblk - 1) / nblk;
  }
  // Expansion item f: own token f (f < num_tokens, at hand) or the (f - num_tokens)-th landed row of the
  // others in receive order (they land in about that order), read from the buffer once its flag is up.
  // False: the row never landed (reported).
  uint32_t expand_checked = 0;  // lane 0's: sources whose shape slot this warp compared (shape_agrees)
  auto expand_item = [&](int64_t f) {
    if (f < a.num_tokens) {
      const int pos = a.send_pos[f * R + me];
      const int64_t own = (int64_t)s_dstlo[me] + pos;
      if (pos < 0 || own >= a.out_rows) return true;
      const int n = gather_dests(lane < a.em_k ? own_dest(f, own) : -1, 0);
      warp_push_row<V>(a.x + f * a.x_bytes, a.x_bytes, s_dx[w], n, lane);
    } else {
      int src;
      const int64_t i = row_of_others(f - a.num_tokens, s_lo, s_hi, me, src);
      const int cached_d = (!a.with_topk && lane < a.em_k) ? a.em_map[i * a.em_k + lane] : -1;
      int ok = 1;
      if (lane == 0) {
        ok = wait_flag(my_flags + i, seq, a.sig.timeout_cycles, a.sig.err, a.sig.claim, me, src, kPhaseDispatch,
                       (int)i);
        if (ok && !(expand_checked >> src & 1u)) {
          ok = shape_agrees(my, src, a.shape, a.sig.err, a.sig.claim, me, kPhaseDispatch);
          expand_checked |= 1u << src;
        }
      }
      if (!warp_shfl(ok, 0)) return false;
      warp_sync();
      int local;
      const int n = gather_dests(lane < a.em_k ? landed_dest(src, i, cached_d, local) : -1, 0);
      warp_push_row<V, 8, false>(data + a.lay.off_x + i * a.x_bytes, a.x_bytes, s_dx[w], n, lane);
    }
    warp_sync();  // s_dx[w] is rewritten for the next row
    return true;
  };
  const SideWork side = SideWork::at(my);
  auto expand_items = [&]() {  // (after the block barrier that follows s_lo / s_hi)
    int64_t n = a.num_tokens;
    for (int r = 0; r < R; ++r)
      if (r != me) n += s_hi[r] - s_lo[r];
    return n;
  };
  // The warp claims expansion items until none is left (or a row never landed), then counts its own.
  auto expand_claimed = [&](int64_t total) {
    uint64_t n = 0;
    for (int64_t f = side.claim(lane); f < total && expand_item(f); f = side.claim(lane)) ++n;
    if (lane == 0 && n > 0) side.finish(n);
  };

  if ((int)blockIdx.x >= nblk) {  // an expand block: expansion items from its start (see SideWork)
    if (tid == 0) s_skip = !side.comm_resident(nblk, kSidePatienceCycles);
    __syncthreads();
    if (!s_skip) expand_claimed(expand_items());
    __syncthreads();
    if (tid == 0) op.exit_block(nblk);
    return;
  }
  if (expand && tid == 0) side.comm_started();
  if (tid == 0) {
    // an error pending (this rank's or a peer's: the layout and counts may be garbage): move nothing
    s_skip = error_pending(a.sig.claim) ||
             over_capacity(a.lay, a.sig, R, me, kPhaseDispatch, [&](int r) { return s_P[(R - 1) * R + r]; });
    adopt_peer_error(a.sig.err, a.sig.claim);  // a peer's report (or abort) this rank's host must raise
    s_next = 0;
  }
  if (tid < R) {  // (own slot too, as the combine does; no dispatch reads it)
    if (tid != me) wait_geq(&free_[tid], base, a.sig.timeout_cycles, a.sig.err, a.sig.claim, me, tid, kPhaseDispatch);
    publish_shape(a.peers.p[tid], me, a.shape);
  }
  __syncthreads();

  const bool has_scales = a.scale_bytes > 0;
  if (!s_skip && w < push_warps) {
    int batch = 0, t_first = 0;
    const int stride = nblk * push_warps;
    for (int t = blockIdx.x * push_warps + w; t < a.num_tokens; t += stride) {
      if (lane == 0) {
        int nd = 0, nm = 0, own = -1;
        for (int r = 0; r < R; ++r) {
          const int pos = a.send_pos[(int64_t)t * R + r];
          if (pos < 0) continue;
          const int64_t slot = s_dstlo[r] + pos;
          if (r == me) {
            if (slot >= a.out_rows) continue;
            if (em)
              own = (int)slot;  // expert-major rows: found by the whole warp below
            else
              s_dx[w][nd++] = a.recv_x + slot * a.x_bytes;
          } else {
            s_dx[w][nd++] = a.peers.p[r] + kHeaderBytes + a.lay.off_x + slot * a.x_bytes;
          }
          s_dr[w][nm] = r;
          s_ds[w][nm] = (int)slot;
          ++nm;
        }
        s_nd[w] = nd;
        s_nm[w] = nm;
        s_own[w] = own;
      }
      warp_sync();
      int nd = s_nd[w];
      const int nm = s_nm[w];
      if (em) {  // this rank's own copies of the token go straight to its expert-major rows (expand blocks')
        const int own = s_own[w];
        const int d = (own >= 0 && lane < a.em_k) ? own_dest(t, own) : -1;
        if (own >= 0 && lane < a.em_k && a.with_topk) a.em_map[(int64_t)own * K + lane] = d;
        if (!expand) nd += gather_dests(d, nd);
      }
      warp_push_row<V>(a.x + (int64_t)t * a.x_bytes, a.x_bytes, s_dx[w], nd, lane);
      for (int j = 0; j < nm; ++j) {
        const int r = s_dr[w][j];
        const int64_t slot = s_ds[w][j];
        char* pdata = a.peers.p[r] + kHeaderBytes;
        if (has_scales) {
          char* dst = r == me ? a.recv_scales + slot * a.scale_bytes : pdata + a.lay.off_scales + slot * a.scale_bytes;
          warp_copy_words(dst, a.scales + (int64_t)t * a.scale_bytes, a.scale_bytes, lane);
        }
        if (a.with_topk) {
          int64_t* di = r == me ? a.recv_idx : reinterpret_cast<int64_t*>(pdata + a.lay.off_topk_idx);
          float* dw = r == me ? a.recv_w : reinterpret_cast<float*>(pdata + a.lay.off_topk_w);
          for (int k = lane; k < K; k += kWarpSize) {
            const int64_t e = a.topk_idx[(int64_t)t * K + k];
            const int64_t local = (e >= (int64_t)r * epr && e < (int64_t)(r + 1) * epr) ? e - (int64_t)r * epr : -1;
            // expert-major: a peer's id word carries the row's position in its (source, expert) block too
            const bool packed = em && r != me && local >= 0;
            di[slot * K + k] = packed ? (local | ((int64_t)a.topk_pos[(int64_t)t * K + k] << 32)) : local;
            dw[slot * K + k] = (local >= 0 && a.with_weights) ? a.topk_w[(int64_t)t * K + k] : 0.f;
          }
        }
        if (a.with_src && lane == 0) {
          int* ds = r == me ? a.recv_src : reinterpret_cast<int*>(pdata + a.lay.off_src);
          ds[slot] = t;
        }
      }
      // Release every flag_batch tokens (and after the last): the rows reach the peers before their flags.
      if (batch++ == 0) t_first = t;
      if (batch == a.flag_batch || t + stride >= a.num_tokens) {
        __threadfence_system();
        warp_sync();
        for (int j = lane; j < batch * R; j += kWarpSize) {
          const int tt = t_first + (j / R) * stride, r = j % R;
          if (r == me) continue;
          const int pos = a.send_pos[(int64_t)tt * R + r];
          if (pos >= 0) st_relaxed_sys_u32(reinterpret_cast<uint32_t*>(a.peers.p[r] + kFlagsOffset) + s_dstlo[r] + pos, seq);
        }
        batch = 0;
      }
      warp_sync();
    }
  }

  // Copy-out of landed remote rows (copy warps from the start, push warps once their tokens are done).
  if (!s_skip) {
    uint32_t checked = 0;  // lane 0's: sources whose shape slot this warp compared (shape_agrees)
    for (;;) {
      int k = 0;
      if (lane == 0) k = atomicAdd(&s_next, 1);
      k = warp_shfl(k, 0);
      int s = 0;
      for (; s < R; ++s) {
        if (k < s_nrows[s]) break;
        k -= s_nrows[s];
      }
      if (s >= R) break;
      const int64_t i = s_lo[s] + blockIdx.x + (int64_t)k * nblk;
      // cached expert-major: the row's destinations are an input, loaded while the row is still landing
      const int cached_d = (em && !a.with_topk && lane < a.em_k) ? a.em_map[i * a.em_k + lane] : -1;
      int ok = 1;
      if (lane == 0) {  // acquire by lane 0, then the warp barrier orders every lane's reads after it
        ok = wait_flag(my_flags + i, seq, a.sig.timeout_cycles, a.sig.err, a.sig.claim, me, s, kPhaseDispatch, (int)i);
        if (ok && !(checked >> s & 1u)) {
          ok = shape_agrees(my, s, a.shape, a.sig.err, a.sig.claim, me, kPhaseDispatch);
          checked |= 1u << s;
        }
      }
      ok = warp_shfl(ok, 0);
      warp_sync();
      if (!ok) break;
      if (em) {  // one read of the landed row, one store per local expert (expert-major rows; expand blocks')
        int d = -1;
        if (lane < a.em_k) {
          int local;
          d = landed_dest(s, i, cached_d, local);
          if (a.with_topk) {
            a.recv_idx[i * K + lane] = local < epr ? local : -1;
            a.em_map[i * K + lane] = d;
          }
        }
        if (!expand) {
          const int n = gather_dests(d, 0);
          warp_push_row<V, 8, false>(data + a.lay.off_x + i * a.x_bytes, a.x_bytes, s_dx[w], n, lane);
          warp_sync();  // s_dx[w] is rewritten for the next row
        }
        if (a.with_topk) warp_copy_words(a.recv_w + i * K, data + a.lay.off_topk_w + i * K * 4, K * 4, lane);
      } else {
        warp_copy_row<V>(a.recv_x + i * a.x_bytes, data + a.lay.off_x + i * a.x_bytes, a.x_bytes, lane);
        if (has_scales)
          warp_copy_words(a.recv_scales + i * a.scale_bytes, data + a.lay.off_scales + i * a.scale_bytes, a.scale_bytes, lane);
        if (a.with_topk) {
          warp_copy_words(a.recv_idx + i * K, data + a.lay.off_topk_idx + i * K * 8, K * 8, lane);
          warp_copy_words(a.recv_w + i * K, data + a.lay.off_topk_w + i * K * 4, K * 4, lane);
        }
      }
      if (a.with_src && lane == 0) a.recv_src[i] = reinterpret_cast<const int*>(data + a.lay.off_src)[i];
    }
    // Padding rows (num_worst_tokens): x and scales 0, top-k ids -1, weights 0, source index -1; in
    // expert-major mode no x (the rows are expert-major) and expert-major rows -1 (they name none).
    const int64_t gtid = (int64_t)blockIdx.x * blockDim.x + tid, gthreads = (int64_t)nblk * blockDim.x;
    const int64_t total = s_P[(R - 1) * R + me];
    if (total < a.out_rows) {
      const int64_t pad = a.out_rows - total;
      if (!em) grid_zero_bytes(a.recv_x + total * a.x_bytes, pad * a.x_bytes, gtid, gthreads);
      if (has_scales) grid_zero_bytes(a.recv_scales + total * a.scale_bytes, pad * a.scale_bytes, gtid, gthreads);
      if (a.with_topk)
        for (int64_t i = gtid; i < pad * K; i += gthreads) {
          a.recv_idx[total * K + i] = -1;
          a.recv_w[total * K + i] = 0.f;
          if (em) a.em_map[total * K + i] = -1;
        }
      if (a.with_src)
        for (int64_t i = gtid; i < pad; i += gthreads) a.recv_src[total + i] = -1;
    }
  }
  // then the expansion items no warp has claimed yet (all of them when no expand block is resident)
  if (expand && !s_skip) expand_claimed(expand_items());
  __syncthreads();
  if (tid == 0) {
    // the buffer is free once every expansion item has read its landed row (local counter, no peer)
    if (expand)
      wait_geq(reinterpret_cast<const uint64_t*>(side.done), (uint64_t)expand_items(), a.sig.timeout_cycles,
               a.sig.err, a.sig.claim, me, me, kPhaseDispatch);
    for (int r = 0; r < R; ++r)
      if (r != me) {
        signal_add(reinterpret_cast<uint64_t*>(a.peers.p[r] + kArriveOffset) + me);
        signal_add(reinterpret_cast<uint64_t*>(a.peers.p[r] + kFreeOffset) + me);
      }
    op.exit_block(nblk);
  }
}

// ----------------------------------------------------------------------------------------------- combine
// Combine. Rows travel back into the source's buffer at their dispatch positions; the source sums them per
// token in float32. What keeps it fast is how many bytes each warp keeps in flight and how few round trips
// sit between them:
//  - push: 12 vectors of 16 B per lane per round without per-vector predicates (a 7168-wide bf16 row is
//    2 full rounds + a 4-vector tail), the row's top-k weights loaded before the row and stored after it.
//  - reduce: lane r (< R) owns source rank r: it reads send_pos (prefetched one token ahead), waits for
//    its own row flag, and publishes the row pointer; the rows are then summed with every source's loads
//    of a round issued together (12-14 vectors per lane for 1-4 sources; more spills at 128 registers), from the global
//    state space (explicit ld.global, no generic loads), biases loaded as two more sources (the sum order
//    stays: sources in rank order, then bias_0, then bias_1).
constexpr int kCombineStageBytes = kCombineThreads * kStageSlots * 16;  // 192 KiB

// kMode 1: the reduce loads into registers (CombineRow::fixed / generic); kMode 2: through shared memory
// with cp.async (CombineRow::staged, dynamic shared memory of kCombineStageBytes; CUDA only).
template <typename T, int kVec, int kMode>
__global__ void __launch_bounds__(kCombineThreads, 1) combine_kernel(CombineArgs a) {
  if (blockIdx.x == 0 && threadIdx.x == 0) adopt_peer_error(a.sig.err, a.sig.claim);
  constexpr int kWarps = kCombineThreads / kWarpSize;
  using Row = CombineRow<T, kVec>;
  extern __shared__ int4 s_stage[];  // kMode 2: kStageSlots vectors per lane, lane-interleaved per warp
  using PushV = typename std::conditional<
      kVec * sizeof(T) == 16, int4,
      typename std::conditional<kVec * sizeof(T) == 4, int, typename std::conditional<kVec * sizeof(T) == 8, int2, short>::type>::type>::type;
  constexpr int kPushU = sizeof(PushV) == 16 ? 12 : 4;
  const int R = a.num_ranks, me = a.rank, tid = threadIdx.x, w = tid / kWarpSize, lane = tid % kWarpSize;
  const int K = a.num_topk, H = a.hidden;
  const int push_warps = a.push_warps;
  const int64_t row_bytes = (int64_t)H * sizeof(T);
  const T* x = reinterpret_cast<const T*>(a.x);
  char* my = a.peers.p[me];
  uint64_t* free_ = reinterpret_cast<uint64_t*>(my + kFreeOffset);
  const uint32_t* my_flags = reinterpret_cast<const uint32_t*>(my + kFlagsOffset);
  const OpSeq op = OpSeq::at(my);
  const uint64_t base = op.read();
  const uint32_t seq = (uint32_t)(base + 1);
  __shared__ int s_P[kMaxRanks * kMaxRanks];
  __shared__ int s_lo[kMaxRanks], s_hi[kMaxRanks], s_sendbase[kMaxRanks], s_recvbase[kMaxRanks];
  __shared__ int s_skip, s_next;
  __shared__ unsigned s_got;  // sources whose rows this block reduced
  __shared__ const T* s_src[kWarps][kMaxRanks + 2];  // sources in rank order, then bias_0, bias_1
  __shared__ const float* s_wsrc[kWarps][kMaxRanks];
  __shared__ const T* s_fold[kWarps][kMaxExpertMajorTopk];  // fold modes: expert-major rows of one row
  // Fold blocks (a.fold_out set): the last a.fold_blocks blocks fold every row into a.fold_out and flag it
  // (SideWork items); the first nblk blocks push and reduce those rows as a plain combine, each row once its
  // flag is up, forming unclaimed rows themselves while it is down.
  // Fused fold (a.fold_map set, no fold_out): the push warps fold each row while pushing it.
  const bool overlap = a.fold_out != nullptr;
  const bool fold = a.fold_map != nullptr && !overlap;
  const int nblk = (int)gridDim.x - a.fold_blocks;
  const T* rows = overlap ? reinterpret_cast<const T*>(a.fold_out) : x;  // what plain pushes / reduces read
  uint32_t* fold_ready = reinterpret_cast<uint32_t*>(my + kFoldReadyOffset);

  // row i of the receive order = the float32 sum (slot order, rounded once) of its expert-major rows, into
  // dst (a peer's buffer or fold_out): the whole warp
  auto fold_row = [&](int64_t i, char* dst) {
    int d = -1;
    if (lane < a.fold_k) {
      d = a.fold_map[i * a.fold_k + lane];
      if (d >= a.fold_rows) d = -1;
    }
    const uint64_t hit = warp_ballot(d >= 0);
    if (d >= 0) s_fold[w][__popcll(hit & ((1ull << lane) - 1ull))] = x + (int64_t)d * H;
    warp_sync();
    const int m = __popcll(hit);
    if (m == 1) {
      warp_push_row<PushV, kPushU>(reinterpret_cast<const char*>(s_fold[w][0]), row_bytes, &dst, 1, lane);
    } else {
      // the fold reads m rows per row: staged copies (kMode 2) keep kStageSlots vectors per lane in flight
      // without holding registers (the register variant keeps 12 and waits per round)
      bool done = false;
      if constexpr (kMode == 2) {
        if (m > 0 && m <= kStageSlots) {  // m == 0 (a received row without local experts): zeros below
          Row::staged(s_fold[w], m, reinterpret_cast<T*>(dst), H / kVec, lane,
                      s_stage + (int64_t)w * kStageSlots * kWarpSize);
          done = true;
        }
      }
      if (!done) Row::sum_rows(s_fold[w], m, reinterpret_cast<T*>(dst), H / kVec, lane);
    }
    warp_sync();  // s_fold[w] is rewritten for the next row
  };

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
  // Fold items (fold blocks): rows in the order they are consumed, own rows (which the reduce reads in token
  // order) spread evenly among the rows pushed to peers (which the push warps take destination by
  // destination); item f forms its row into fold_out, then releases the row's flag (fence, then the flag).
  const SideWork side = SideWork::at(my);
  __syncthreads();  // s_lo / s_hi
  const int64_t fold_total = s_hi[R - 1], fold_own = s_hi[me] - s_lo[me];
  auto fold_item = [&](int64_t f) {
    const int64_t a0 = f * fold_own / fold_total;  // own rows among the first f
    int64_t i;
    if ((f + 1) * fold_own / fold_total > a0) {
      i = s_lo[me] + a0;
    } else {
      int s;
      i = row_of_others(f - a0, s_lo, s_hi, me, s);  // the (f - a0)-th pushed row
    }
    fold_row(i, const_cast<char*>(reinterpret_cast<const char*>(rows + i * H)));
    __threadfence();
    warp_sync();
    if (lane == 0) st_relaxed_sys_u32(fold_ready + i, seq);
  };
  // Row i formed (the whole warp): while its flag is down, the warp forms unclaimed rows itself; once all
  // are claimed, it waits for the warp that has row i. False: the row never came (reported).
  auto folded = [&](int64_t i) {
    for (;;) {
      int up = 0;
      if (lane == 0) up = ld_acquire_sys_u32(fold_ready + i) == seq;
      if (warp_shfl(up, 0)) return true;
      const int64_t f = side.claim(lane);
      if (f >= fold_total) break;
      fold_item(f);
    }
    int ok = 1;
    if (lane == 0)
      ok = wait_flag(fold_ready + i, seq, a.sig.timeout_cycles, a.sig.err, a.sig.claim, me, me, kPhaseCombine, (int)i);
    return warp_shfl(ok, 0) != 0;
  };
  if ((int)blockIdx.x >= nblk) {  // a fold block: fold items from its start
    for (int64_t f = side.claim(lane); f < fold_total; f = side.claim(lane)) fold_item(f);
    __syncthreads();
    if (tid == 0) op.exit_block(nblk);
    return;
  }
  if (tid == 0) {
    s_skip = error_pending(a.sig.claim) || over_capacity(a.lay, a.sig, R, me, kPhaseCombine, [&](int s) {
      int total = 0;
      for (int r = 0; r < R; ++r) total += count(s, r);
      return total;
    });
    adopt_peer_error(a.sig.err, a.sig.claim);  // a peer's report (or abort) this rank's host must raise
    s_next = 0;
    s_got = 0;
  }
  if (tid < R) {  // (own slot too: fold mode reads own rows from the own buffer)
    if (tid != me) wait_geq(&free_[tid], base, a.sig.timeout_cycles, a.sig.err, a.sig.claim, me, tid, kPhaseCombine);
    publish_shape(a.peers.p[tid], me, a.shape);
  }
  __syncthreads();

  if (!s_skip && w < push_warps) {
    const int gw = blockIdx.x * push_warps + w, nw = nblk * push_warps;
    bool stop = false;  // a fold flag never came (reported): no further pushes
    for (int s = 0; s < R && !stop; ++s) {
      if (s == me && !fold) continue;  // fold mode: own rows are folded into the own buffer like any other
      char* pdata = a.peers.p[s] + kHeaderBytes;
      uint32_t* pflags = reinterpret_cast<uint32_t*>(a.peers.p[s] + kFlagsOffset);
      int batch = 0;
      int64_t pend_first = 0;
      for (int i = s_lo[s] + gw; i < s_hi[s]; i += nw) {
        const int64_t slot = s_sendbase[s] + (i - s_lo[s]);
        if (batch == 0) pend_first = slot;
        float wv = 0.f;  // loaded before the row, stored after it: no extra round trip per row
        const bool w_lane = a.with_weights && K <= kWarpSize && lane < K;
        if (w_lane) wv = a.topk_w[(int64_t)i * K + lane];
        char* dst = pdata + a.lay.off_x + slot * row_bytes;
        if (fold) {
          fold_row(i, dst);
        } else if (overlap) {
          if (!folded(i)) {
            stop = true;
            break;
          }
          // fold_out was written during this kernel: the coherent path, not the read-only one
          warp_push_row<PushV, kPushU, false>(reinterpret_cast<const char*>(rows) + (int64_t)i * row_bytes, row_bytes,
                                             &dst, 1, lane);
        } else {
          warp_push_row<PushV, kPushU>(reinterpret_cast<const char*>(x) + (int64_t)i * row_bytes, row_bytes, &dst, 1, lane);
        }
        if (a.with_weights) {
          float* dw = reinterpret_cast<float*>(pdata + a.lay.off_topk_w) + slot * K;
          if (K <= kWarpSize) {
            if (w_lane) dw[lane] = wv;
          } else {
            for (int k = lane; k < K; k += kWarpSize) dw[k] = a.topk_w[(int64_t)i * K + k];
          }
        }
        // Release every flag_batch rows (and after the last): rows reach the peer before their flags.
        if (++batch == a.flag_batch || i + nw >= s_hi[s]) {
          __threadfence_system();
          warp_sync();
          for (int j = lane; j < batch; j += kWarpSize) st_relaxed_sys_u32(pflags + pend_first + (int64_t)j * nw, seq);
          batch = 0;
        }
      }
    }
  }

  // Reduce: tokens b + k*B of this block, claimed by any free warp (one token ahead, so its send_pos
  // loads overlap the current token); lane r waits for the flag of the row from rank r.
  if (!s_skip) {
    const char* data = my + kHeaderBytes;
    const int nv = H / kVec;
    const int N = a.num_tokens;
    const int nbias = (a.bias0 != nullptr ? 1 : 0) + (a.bias1 != nullptr ? 1 : 0);
    auto claim = [&]() {
      int k = 0;
      if (lane == 0) k = atomicAdd(&s_next, 1);
      return (int64_t)blockIdx.x + (int64_t)warp_shfl(k, 0) * nblk;
    };
    int64_t t = claim();
    int pos = (lane < R && t < N) ? a.send_pos[t * R + lane] : -1;
    bool got = false;  // lane r: whether this warp consumed a row of rank r (its shape slot is then checked)
    while (t < N) {
      const int64_t t_next = claim();
      const int pos_next = (lane < R && t_next < N) ? a.send_pos[t_next * R + lane] : -1;
      bool ok = true;
      int64_t row = 0;
      const bool direct = lane == me && !fold;  // own rows are read in place (fold mode: from the buffer)
      if (overlap) {  // the own row is formed in fold_out first
        const int own = warp_shfl(pos, me);
        if (own >= 0) ok = folded(s_lo[me] + own);
      }
      if (pos >= 0) {
        if (direct) {
          row = s_lo[me] + pos;
        } else {
          row = s_recvbase[lane] + pos;
          ok = wait_flag(my_flags + row, seq, a.sig.timeout_cycles, a.sig.err, a.sig.claim, me, lane, kPhaseCombine,
                         (int)row);
          got |= ok;
        }
      }
      if (warp_any(!ok)) break;  // each lane's acquire, then the vote (a warp barrier): every lane reads the rows
      const uint64_t present = warp_ballot(pos >= 0);
      const int n = __popcll(present);
      if (pos >= 0) {
        const int j = __popcll(present & ((1ull << lane) - 1ull));
        if (direct) {
          s_src[w][j] = rows + row * H;
          s_wsrc[w][j] = a.topk_w + row * K;
        } else {
          s_src[w][j] = reinterpret_cast<const T*>(data + a.lay.off_x) + row * H;
          s_wsrc[w][j] = reinterpret_cast<const float*>(data + a.lay.off_topk_w) + row * K;
        }
      }
      if (lane == 0) {
        int m = n;
        if (a.bias0 != nullptr) s_src[w][m++] = reinterpret_cast<const T*>(a.bias0) + t * H;
        if (a.bias1 != nullptr) s_src[w][m++] = reinterpret_cast<const T*>(a.bias1) + t * H;
      }
      warp_sync();
      // top-k weights: every source's value loaded at once, summed in source order
      float wv[kMaxRanks];
      const bool w_lane = a.with_weights && K <= kWarpSize && lane < K;
      if (w_lane) {
#pragma unroll
        for (int j = 0; j < kMaxRanks; ++j)
          if (j < n) wv[j] = s_wsrc[w][j][lane];
      }
      const int m = n + nbias;
      T* out_row = reinterpret_cast<T*>(a.out) + t * H;
      if constexpr (kMode == 2) {
        if (m > 0)
          Row::staged(s_src[w], m, out_row, nv, lane, s_stage + (int64_t)w * kStageSlots * kWarpSize);
        else
          Row::sum_rows(s_src[w], 0, out_row, nv, lane);
      } else {
        Row::sum_rows(s_src[w], m, out_row, nv, lane);  // m == 0 (sent nowhere, no bias): zeros, as the reference
      }
      if (w_lane) {
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < kMaxRanks; ++j)
          if (j < n) acc += wv[j];
        a.out_w[t * K + lane] = acc;
      }
      if (a.with_weights && K > kWarpSize)
        for (int kk = lane; kk < K; kk += kWarpSize) {
          float acc = 0.f;
          for (int j = 0; j < n; ++j) acc += s_wsrc[w][j][kk];
          a.out_w[t * K + kk] = acc;
        }
      warp_sync();  // s_src / s_wsrc of this warp are rewritten for the next token
      t = t_next;
      pos = pos_next;
    }
    if (got) atomicOr(&s_got, 1u << lane);
  }
  __syncthreads();
  // The shape of each source this block took rows from (off the reduce loop: a check there costs registers
  // the row sums need). A mismatch is reported after the sums were formed from the wrong row size: they are
  // garbage, and every rank raises.
  if (tid < R && (s_got >> tid & 1u)) shape_agrees(my, tid, a.shape, a.sig.err, a.sig.claim, me, kPhaseCombine);
  if (tid == 0) {
    for (int r = 0; r < R; ++r)
      if (r != me) {
        signal_add(reinterpret_cast<uint64_t*>(a.peers.p[r] + kArriveOffset) + me);
        signal_add(reinterpret_cast<uint64_t*>(a.peers.p[r] + kFreeOffset) + me);
      }
    op.exit_block(nblk);
  }
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
  const bool full = a.hidden % kFull == 0;
  if (!full) {
    combine_kernel<T, 1, 1><<<num_blocks, kCombineThreads, 0, stream>>>(a);
    return;
  }
#if !defined(UCCL_EP_WITH_HIP)
  if (a.variant == 2) {
    // Per launch (cheap): the attribute belongs to the current device, and devices differ in opt-in
    // shared memory (sm_90: 227 KiB; sm_80: 163 KiB, too small: run variant 1 there).
    int dev = 0, optin = 0;
    UCCL_CHECK_GPU(gpuGetDevice(&dev));
    UCCL_CHECK_GPU(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    if (optin >= kCombineStageBytes) {
      UCCL_CHECK_GPU(cudaFuncSetAttribute(combine_kernel<T, kFull, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          kCombineStageBytes));
      combine_kernel<T, kFull, 2><<<num_blocks, kCombineThreads, kCombineStageBytes, stream>>>(a);
      return;
    }
  }
#endif
  combine_kernel<T, kFull, 1><<<num_blocks, kCombineThreads, 0, stream>>>(a);  // variant 1 (default); HIP runs it for 2 too
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
