// Internode high-throughput kernels: NVLink/xGMI aggregation inside a node, CPU-proxy RDMA between nodes.
//
// Dispatch (three launches on the caller's stream):
//   pack     every token is read once and written once per destination: in row format into its row of
//            each other destination NODE's segment of the send area (with its positions on that node's
//            ranks), into its receive rows in the NVL buffers of this node's other final ranks, and split
//            into this rank's outputs when it is a final rank itself. When a chunk of send rows is complete,
//            the warp that completed it pushes ONE write command (the chunk into the recv area of the rank
//            with the same local index on that node) and one atomic add on the chunk's arrival flag, on the
//            same channel: the proxy applies them in order, so the flag means "the chunk's bytes are there".
//            Block 0 first starts the op: clears this op's arrival flags, sends READY to every RDMA peer
//            (senders write into a peer's areas only after its READY for the op: nothing it still reads is
//            overwritten) and arrives at the node barrier; every block waits for the node peers' arrival
//            (their previous ops are done with their NVL buffers) before writing into them.
//   forward  each row landed from another node (once its chunk flag is up) goes to its final ranks in the
//            node: over NVLink/xGMI into the NVL buffers of the others, split into the outputs for this
//            rank. Rows land at row_base[source][rank] + position: the same rows as intranode (source
//            rank, then token). The last block arrives at the node barrier again.
//   copy-out once every node peer finished, the rows they wrote into this rank's NVL buffer are split into
//            the outputs (top-k ids become this rank's local expert ids or -1); padding rows are filled.
// Every row is thus written into its final place by the rank that holds it (no copy with one rank per node).
// Combine (three launches): stage (the rows node peers reduce into this rank's NVL staging area, node
// barrier), forward (each forwarded row is the float32 sum of its node ranks' rows, in local order, this
// rank's own read from x; one write + flag per chunk back to the source node's RDMA peer, or straight into
// this rank's crecv for its own node; with one rank per node the reduce reads the own node's rows from x
// instead), reduce (each token sums its nodes' rows in node order, + biases, rounded once).
//
// Inter-node bytes move only through proxy commands. Every wait has a deadline and reports rank, peer,
// channel and phase into the error record (internode_buffer.cu formats it).
#include <atomic>

#include "common/check.h"
#include "kernels/row_ops.cuh"
#include "kernels/internode_launch.cuh"

namespace uccl_ep::internode {
namespace {

using intranode::kWarpSize;
using intranode::report_error;
using intranode::st_release_sys_u64;
using intranode::wait_geq;

constexpr int kWarps = kThreads / kWarpSize;

__device__ __forceinline__ uint64_t* bar_words(char* nvl) { return reinterpret_cast<uint64_t*>(nvl + kBarOffset); }

// This rank arrives at node barrier `b` (one thread): its earlier writes, and those of the blocks whose
// completion it observed, are visible to a peer that sees the word.
__device__ void barrier_arrive(const Common& c, uint64_t b) {
  __threadfence_system();
  for (int j = 0; j < c.L; ++j) st_release_sys_u64(bar_words(c.nvl[j]) + c.local, b);
}

// Every block: waits until every node peer arrived at barrier `b`.
__device__ bool barrier_wait(const Common& c, uint64_t b, int phase) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = 1;
    const uint64_t* words = bar_words(c.nvl[c.local]);
    for (int j = 0; j < c.L && ok; ++j)
      if (!wait_geq(words + j, b, c.timeout_cycles, c.err, c.claim, c.rank, c.node * c.L + j, phase, 0)) ok = 0;
  }
  __syncthreads();
  return ok != 0;
}

// One thread of the last block to finish (of this launch) returns true, after all blocks' writes. That block
// sets the counter back to zero for the next launch (every other block counted already; the next kernel on
// the stream starts after this one ends), so it holds nothing a graph replay could find stale.
__device__ bool last_block(const Common& c) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    const unsigned long long old = atomicAdd(reinterpret_cast<unsigned long long*>(c.done), 1ULL);
    last = old == gridDim.x - 1;
    if (last) *c.done = 0;
  }
  __syncthreads();
  return last && threadIdx.x == 0;
}

// The last kernel of an op, its last block (last_block): the op is finished on this rank; the next op's
// kernels (after this one on the stream) read its number and barriers from the counters.
__device__ void finish_op(const Common& c, uint64_t op, uint64_t barrier) {
  c.counters->ops = op;
  c.counters->barriers = barrier + 1;  // the op arrived at barrier and barrier + 1
}

// Pushes n commands on `channel`'s ring; a ring that stays full for the timeout is an error (the proxy
// thread is gone: the ring is unusable afterwards, and so is the backend).
__device__ bool push(const Common& c, int channel, const uccl::Command* cmds, int n, int peer, int phase) {
  if (uccl::ring_push(c.rings.r[channel % c.rings.n], cmds, uint32_t(n), c.ring_spins)) return true;
  report_error(c.err, c.claim, kErrRingFull, c.rank, peer, phase, n, 0, channel);
  return false;
}

// Every block, before it writes any outgoing area: every RDMA peer sent READY for this op. A peer's READY
// means it finished every earlier op, so it received all this rank's earlier chunks (whose copies may still
// have been reading these areas) and no longer reads the areas this op writes into at its side.
__device__ bool wait_peers_ready(const Common& c, uint64_t op, int phase) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = 1;
    for (int n = 0; n < c.N && ok; ++n) {
      if (n == c.node) continue;
      const int peer = n * c.L + c.local;
      if (!wait_geq(c.flags + ready_flag(c.num_ranks, peer), op, c.timeout_cycles, c.err, c.claim, c.rank, peer, phase,
                    0))
        ok = 0;
    }
  }
  __syncthreads();
  return ok != 0;
}

// Pushes [write chunk j to node n's RDMA peer, its flag += 1] on the chunk's channel (in this order: the
// proxy applies the add after the write landed).
__device__ void send_chunk(const Common& c, int n, int j, int64_t local_off, int64_t remote_off, int64_t bytes,
                           int64_t flag_word, int phase) {
  const int peer = n * c.L + c.local;
  const int channel = 1 + j % c.data_channels;
  uccl::Command cmds[2] = {};
  cmds[0].op = uccl::OP_WRITE;
  cmds[0].dst_rank = uint8_t(peer);
  cmds[0].channel = uint8_t(channel);
  cmds[0].region = 0;
  cmds[0].length = uint32_t(bytes);
  cmds[0].local_off = uint32_t(local_off);
  cmds[0].remote_off = uint32_t(remote_off);
  cmds[1].op = uccl::OP_ATOMIC_ADD;
  cmds[1].dst_rank = uint8_t(peer);
  cmds[1].channel = uint8_t(channel);
  cmds[1].region = 1;
  cmds[1].length = 1;
  cmds[1].remote_off = uint32_t(flag_word * 8);
  uccl::ring_release_data();  // the chunk's rows (this and other warps', fenced before their count) first
  push(c, channel, cmds, 2, peer, phase);
}

// Starts an op (block 0, thread 0): clears the arrival flags of this op's chunks (this rank's host flag
// words, before READY lets anyone set them), READY to every RDMA peer, arrival at the node barrier.
__device__ void start_op(const Common& c, uint64_t barrier, int64_t first_flag_of_node0, const int* nchunks,
                         int phase) {
  for (int n = 0; n < c.N; ++n)
    for (int j = 0; j < nchunks[n]; ++j) c.flags[first_flag_of_node0 + int64_t(n) * kMaxChunks + j] = 0;
  __threadfence_system();
  for (int n = 0; n < c.N; ++n) {
    if (n == c.node) continue;
    uccl::Command cmd = {};
    cmd.op = uccl::OP_ATOMIC_ADD;
    cmd.dst_rank = uint8_t(n * c.L + c.local);
    cmd.channel = 0;
    cmd.region = 1;
    cmd.length = 1;
    cmd.remote_off = uint32_t(ready_flag(c.num_ranks, c.rank) * 8);
    if (!push(c, 0, &cmd, 1, n * c.L + c.local, phase)) return;
  }
  barrier_arrive(c, barrier);
}

// Counts one finished row of chunk (n, j); true for the lane-0 call that completed the chunk.
__device__ bool chunk_done(const Common& c, int n, int j, int rows_in_chunk) {
  __threadfence();  // this row's stores before the count (the completing warp fences at system scope)
  return atomicAdd(c.chunk_count + n * kMaxChunks + j, 1) + 1 == rows_in_chunk;
}

// Lane 0, after the warp wrote row i of node n's segment (rows [seg_row0, seg_row0 + seg_rows) of the
// outgoing area at byte area_off): the call that completes the row's chunk sends the chunk to the segment's
// place at node n's RDMA peer (remote_in) with its flag (flag0 + chunk).
__device__ void row_written(const Common& c, int n, int64_t i, int64_t seg_row0, int64_t seg_rows, int chunk_rows,
                            int64_t area_off, int64_t remote_in, int64_t row_bytes, int64_t flag0, int phase) {
  const int j = int(i / chunk_rows);
  const int64_t left = seg_rows - int64_t(j) * chunk_rows;
  const int rows = int(left < chunk_rows ? left : chunk_rows);
  if (!chunk_done(c, n, j, rows)) return;
  send_chunk(c, n, j, area_off + (seg_row0 + int64_t(j) * chunk_rows) * row_bytes,
             remote_in + int64_t(j) * chunk_rows * row_bytes, rows * row_bytes, flag0 + j, phase);
}

// Every block, once the kernel that counted chunks (pack / combine forward) is done: its counters back to
// zero for the next op (they start zeroed with the NVL buffer). Kept off the stream as a kernel's last
// step, so that nothing but kernels is queued behind a kernel that waits for the proxies.
__device__ void clear_chunk_counts(const Common& c, const int* nchunks) {
  for (int n = 0; n < c.N; ++n)
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < nchunks[n]; j += gridDim.x * blockDim.x)
      c.chunk_count[n * kMaxChunks + j] = 0;
}

// Chunk arrivals as one block sees them. Lane 0 of warp 0, the block's watcher, follows the chunks the kernel
// consumes, chunk-major over the remote nodes (the order their senders complete them), and publishes per node
// how many leading chunks landed; the other warps take a row as soon as its chunk is published, spinning on
// shared memory only. Block 0's watcher polls the chunk flags in host memory and mirrors each landing into
// GPU memory; the other blocks' watchers poll the mirror. Pollers of host memory slow the whole host link,
// the proxies' rings and copies included (a poller per warp, then one per block, both measured slower); and a
// block that waited at a barrier per unit of rows while one thread polled left every warp idle meanwhile.
struct Arrivals {
  int ready[kMaxNodes];  // chunks [0, ready[n]) from node n landed
  int failed;            // the watcher's wait failed (the error record says why): stop
};

__device__ void arrivals_init(Arrivals& s) {
  if (threadIdx.x < kMaxNodes) s.ready[threadIdx.x] = 0;
  if (threadIdx.x == 0) s.failed = 0;
  __syncthreads();
}

// The watcher (call with the whole block; only thread 0 works): flag_of(n, j) is the flag word of chunk j
// from node n, nchunks[n] the chunks coming from node n, `kind` 0 for dispatch chunks, 1 for combine chunks,
// op the op's number (NodeTables::op).
// The flags are host memory (the proxies raise them): block 0's watcher alone polls them over PCIe and
// mirrors each landing into this rank's NVL header as the op number; the other blocks' watchers poll the
// mirror in GPU memory (every block polling host memory slowed the transfers they waited for), with twice
// the deadline, so that a lost chunk is reported by block 0, naming its flag.
template <typename FlagOf>
__device__ void watch_arrivals(const Common& c, uint64_t op, Arrivals& s, const int* nchunks, FlagOf flag_of,
                               int kind, int phase) {
  if (threadIdx.x != 0) return;
  uint64_t* mirror = reinterpret_cast<uint64_t*>(c.nvl[c.local] + kArrivalMirrorOffset) +
                     int64_t(kind) * kMaxNodes * kMaxChunks;
  int most = 0;
  for (int n = 0; n < c.N; ++n)
    if (n != c.node && nchunks[n] > most) most = nchunks[n];
  for (int j = 0; j < most; ++j)
    for (int n = 0; n < c.N; ++n) {
      if (n == c.node || j >= nchunks[n]) continue;
      uint64_t* mine = mirror + int64_t(n) * kMaxChunks + j;
      const bool ok = blockIdx.x == 0 ? wait_geq(c.flags + flag_of(n, j), 1, c.timeout_cycles, c.err, c.claim,
                                                 c.rank, n * c.L + c.local, phase, 1 + j % c.data_channels)
                                      : wait_geq(mine, op, intranode::mirror_timeout(c.timeout_cycles), c.err,
                                                 c.claim, c.rank, n * c.L + c.local, phase, 1 + j % c.data_channels);
      if (!ok) {
        *reinterpret_cast<volatile int*>(&s.failed) = 1;
        return;
      }
      __threadfence_system();  // acquire side of the proxy's write-then-flag (or of block 0's mirror)
      if (blockIdx.x == 0) intranode::st_release_sys_u64(mine, op);
      *reinterpret_cast<volatile int*>(&s.ready[n]) = j + 1;
    }
}

// One thread: true once chunk j from node n was published (false when the watcher failed). The thread's
// later loads, and those of threads that sync with it afterwards, see the chunk's bytes.
__device__ __forceinline__ bool arrived(const Arrivals& s, int n, int j) {
  while (*reinterpret_cast<const volatile int*>(&s.ready[n]) <= j)
    if (*reinterpret_cast<const volatile int*>(&s.failed)) return false;
  __threadfence_block();
  return true;
}

__device__ __forceinline__ int segment_of(const int64_t* row0, int N, int64_t k) {
  int n = 0;
  while (n + 1 < N && row0[n + 1] <= k) ++n;
  return n;
}

// One warp copies `bytes` from src to each of the n destinations (src read once): several 16-byte vectors in
// flight per lane when src and every destination are 16-byte aligned and bytes a multiple of 16, else byte by
// byte. kNc: nobody writes src during the kernel.
template <bool kNc>
__device__ __forceinline__ void warp_copy_to(char* const* dsts, int n, const char* src, int64_t bytes, int lane) {
  uintptr_t bits = reinterpret_cast<uintptr_t>(src) | uintptr_t(bytes);
  for (int q = 0; q < n; ++q) bits |= reinterpret_cast<uintptr_t>(dsts[q]);
  if ((bits & 15u) == 0) {
    intranode::warp_push_row<int4, 8, kNc>(src, bytes, dsts, n, lane);
  } else {
    for (int q = 0; q < n; ++q)
      for (int64_t i = lane; i < bytes; i += kWarpSize) dsts[q][i] = src[i];
  }
}

template <bool kNc>
__device__ __forceinline__ void warp_copy(char* dst, const char* src, int64_t bytes, int lane) {
  warp_copy_to<kNc>(&dst, 1, src, bytes, lane);
}

// A row's scales (FP8: float32 words, 224 bytes at hidden 7168) held by the warp, two words per lane: read
// in the round that loads the row's other small fields and stored from registers into every row that
// carries them, where a copy per destination would cost a load round each. Scales of more than two words per
// lane (64 on NVIDIA), or not whole words, are copied from src instead (warp_copy, kNc as the caller's).
template <bool kNc>
struct ScaleWords {
  const char* src;
  int64_t bytes;
  int n, w0 = 0, w1 = 0;
  __device__ __forceinline__ ScaleWords(const char* s, int64_t b, int lane) : src(s), bytes(b) {
    n = b % 4 == 0 && b <= 8 * kWarpSize ? int(b / 4) : -1;
    const int* p = reinterpret_cast<const int*>(s);
    if (lane < n) w0 = p[lane];
    if (lane + kWarpSize < n) w1 = p[lane + kWarpSize];
  }
  __device__ __forceinline__ void store(char* dst, int lane) const {
    if (n < 0) {
      warp_copy<kNc>(dst, src, bytes, lane);
      return;
    }
    int* d = reinterpret_cast<int*>(dst);
    if (lane < n) d[lane] = w0;
    if (lane + kWarpSize < n) d[lane + kWarpSize] = w1;
  }
};

// The lanes with ok set publish their value into out[] in lane order (the whole warp calls it; it syncs
// the warp before returning); returns how many did.
template <typename P>
__device__ __forceinline__ int warp_compact(P* out, bool ok, P value, int lane) {
  const uint64_t hit = intranode::warp_ballot(ok);
  if (ok) out[__popcll(hit & ((1ull << lane) - 1ull))] = value;
  intranode::warp_sync();
  return __popcll(hit);
}

// ---- notify ---------------------------------------------------------------------------------------------
// The count rows land in the slots of the notifies counter's parity (the counts kernel reads them after this
// kernel advanced it; the next notify writes the other parity's).
__global__ void __launch_bounds__(kThreads) notify_kernel(NotifyArgs a) {
  const Common& c = a.c;
  const uint64_t notifies = c.counters->notifies;  // (advanced below, after every thread read it)
  const int64_t in_off = count_slots_off(a.stride, c.num_ranks, notifies);
  const int64_t out_off = count_out_off(a.stride, notifies);
  int* out = reinterpret_cast<int*>(c.rdma + out_off);
  int* own = reinterpret_cast<int*>(c.rdma + in_off) + int64_t(c.rank) * a.stride;
  const int R = c.num_ranks, N = c.N;
  for (int i = threadIdx.x; i < a.row_ints; i += blockDim.x) {
    int v;
    if (i < kHeaderInts) v = a.header[i];
    else if (i < kHeaderInts + R) v = a.per_rank[i - kHeaderInts];
    else if (i < kHeaderInts + R + N) v = a.per_node[i - kHeaderInts - R];
    else v = a.per_expert[i - kHeaderInts - R - N];
    out[i] = v;
    own[i] = v;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  c.counters->notifies = notifies + 1;
  uccl::ring_release_data();
  for (int s = 1; s < R; ++s) {
    const int dst = (c.rank + s) % R;  // staggered: ranks do not all start with rank 0
    uccl::Command cmds[2] = {};
    cmds[0].op = uccl::OP_WRITE;
    cmds[0].dst_rank = uint8_t(dst);
    cmds[0].length = uint32_t(a.row_ints * 4);
    cmds[0].local_off = uint32_t(out_off);
    cmds[0].remote_off = uint32_t(in_off + int64_t(c.rank) * a.stride * 4);
    cmds[1].op = uccl::OP_ATOMIC_ADD;
    cmds[1].dst_rank = uint8_t(dst);
    cmds[1].region = 1;
    cmds[1].length = 1;
    cmds[1].remote_off = uint32_t(notify_flag(c.rank) * 8);
    if (!push(c, 0, cmds, 2, dst, kPhaseNotify)) return;
  }
}

// ---- send positions -------------------------------------------------------------------------------------
// DeepEP's send_head and send_rdma_head from is_token_in_rank [T, R] in one launch: block d < R scans column d
// (send_pos[t, d]: token t's row among this rank's tokens for rank d, -1), block R + n the node column n (a
// token goes to node n when it goes to any of its ranks; node_head[t, n] likewise). Tiles of blockDim tokens in
// order, each an exclusive scan of warp ballots, so no torch op (cumsum, where, any) is needed per call.
__global__ void __launch_bounds__(kThreads) send_positions_kernel(const bool* in_rank, int num_tokens, int R, int L,
                                                                  int* send_pos, int* node_head) {
  __shared__ int s_warp[kWarps];
  const bool node_col = int(blockIdx.x) >= R;
  const int col = node_col ? int(blockIdx.x) - R : int(blockIdx.x);
  const int width = node_col ? R / L : R;
  int* out = node_col ? node_head : send_pos;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  int carry = 0;  // hits in the tiles before this one
  for (int base = 0; base < num_tokens; base += blockDim.x) {
    const int t = base + threadIdx.x;
    bool hit = false;
    if (t < num_tokens) {
      const bool* row = in_rank + int64_t(t) * R;
      if (node_col) {
        for (int j = 0; j < L; ++j) hit = hit || row[col * L + j];
      } else {
        hit = row[col];
      }
    }
    const uint64_t votes = intranode::warp_ballot(hit);
    if (lane == 0) s_warp[warp] = __popcll(votes);
    __syncthreads();
    int before = carry + __popcll(votes & ((1ull << lane) - 1ull)), total = 0;
    for (int w = 0; w < kWarps; ++w) {
      before += w < warp ? s_warp[w] : 0;
      total += s_warp[w];
    }
    if (t < num_tokens) out[int64_t(t) * width + col] = hit ? before : -1;
    carry += total;
    __syncthreads();  // s_warp is rewritten by the next tile
  }
}

// ---- counts ---------------------------------------------------------------------------------------------
// The first thing every rank finds wrong with the call, in one order on every rank (each reads every rank's
// count row): a shape field that differs from rank 0's (first field, then first rank), a rank receiving more
// than num_worst_tokens (first rank), a source sending more than expert_capacity to one expert (first source,
// then expert), a source sending a node more than max_node_rows (first source, then node). Packed as
// kind << 40 | index, so that the smallest key is the first.
constexpr unsigned long long kNoViolation = ~0ull;
__device__ __forceinline__ unsigned long long violation(int kind, int64_t index) {
  return (static_cast<unsigned long long>(kind) << 40) | static_cast<unsigned long long>(index);
}

// One block: waits for every rank's count row of this notify (thread 0 polls the host flags, as the host's
// wait did), checks them (CountChecks) and writes the call info. A violation is reported (the same record on
// every rank) and leaves the info zeroed: the kernels after this one then move no rows (and their waits stop
// at the recorded error).
__global__ void __launch_bounds__(kThreads) counts_kernel(CountsArgs a) {
  const Common& c = a.c;
  const int R = c.num_ranks, N = c.N, L = c.L;
  const InfoOffsets o = info_offsets(R, L);
  const uint64_t notifies = c.counters->notifies;  // the notify kernel before this one advanced it
  __shared__ int s_ok;
  __shared__ unsigned long long s_first;
  if (threadIdx.x == 0) {
    s_ok = 1;
    s_first = kNoViolation;
    for (int s = 0; s < R && s_ok; ++s)
      if (s != c.rank && !wait_geq(c.flags + notify_flag(s), notifies, c.timeout_cycles, c.err, c.claim, c.rank, s,
                                   kPhaseNotify, 0))
        s_ok = 0;
    __threadfence_system();  // acquire side of the proxies' write-then-flag
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < o.ints; i += blockDim.x) a.info[i] = 0;
  if (!s_ok) return;  // the wait recorded why
  const int* rows = reinterpret_cast<const int*>(c.rdma + count_slots_off(a.stride, R, notifies - 1));
  auto row = [&](int s) { return rows + int64_t(s) * a.stride; };
  auto count = [&](int s, int r) { return row(s)[kHeaderInts + r]; };
  unsigned long long first = kNoViolation;
  for (int i = threadIdx.x; i < R * intranode::kShapeInts; i += blockDim.x) {
    const int field = i / R, s = i % R;  // field 0 (num_tokens) may differ
    if (field > 0 && row(s)[field] != row(0)[field]) first = min(first, violation(0, i));
  }
  for (int r = threadIdx.x; r < R && a.checks.num_worst_tokens > 0; r += blockDim.x) {
    int64_t recv = 0;
    for (int s = 0; s < R; ++s) recv += count(s, r);
    if (recv > a.checks.num_worst_tokens) first = min(first, violation(1, r));
  }
  const int64_t sent_experts = int64_t(R) * a.num_experts;
  for (int64_t i = threadIdx.x; i < sent_experts && a.checks.expert_capacity > 0; i += blockDim.x) {
    const int s = int(i / a.num_experts), e = int(i % a.num_experts);
    if (row(s)[kHeaderInts + R + N + e] > a.checks.expert_capacity) first = min(first, violation(2, i));
  }
  for (int i = threadIdx.x; i < R * N && a.checks.max_node_rows > 0; i += blockDim.x) {
    const int v = row(i / N)[kHeaderInts + R + i % N];
    if (v < 0 || v > a.checks.max_node_rows) first = min(first, violation(3, i));
  }
  if (first != kNoViolation) atomicMin(&s_first, first);
  __syncthreads();
  if (s_first != kNoViolation) {
    if (threadIdx.x == 0) {
      const int kind = int(s_first >> 40);
      const int64_t i = int64_t(s_first & ((1ull << 40) - 1));
      if (kind == 0) {
        const int field = int(i / R), s = int(i % R);
        report_error(c.err, c.claim, kErrShape, 0, s, kPhaseNotify, row(0)[field], row(s)[field], field);
      } else if (kind == 1) {
        int64_t recv = 0;
        for (int s = 0; s < R; ++s) recv += count(s, int(i));
        report_error(c.err, c.claim, kErrWorstTokens, int(i), int(i), kPhaseNotify, int(recv),
                     int(a.checks.num_worst_tokens), 0);
      } else if (kind == 2) {
        const int s = int(i / a.num_experts), e = int(i % a.num_experts), epr = a.num_experts / R;
        report_error(c.err, c.claim, kErrExpertCapacity, e / epr, s, kPhaseNotify, row(s)[kHeaderInts + R + N + e],
                     a.checks.expert_capacity, e % epr);
      } else {
        const int s = int(i / N), n = int(i % N);
        report_error(c.err, c.claim, kErrNodeRows, c.rank, s, kPhaseNotify, row(s)[kHeaderInts + R + n],
                     int(a.checks.max_node_rows), n);
      }
    }
    return;
  }
  for (int i = threadIdx.x; i < R * N; i += blockDim.x) a.info[o.rd + i] = row(i / N)[kHeaderInts + R + i % N];
  for (int i = threadIdx.x; i < R * R; i += blockDim.x) a.info[o.counts + i] = count(i / R, i % R);
  if (threadIdx.x < L) {  // source by source: where each one's rows start on local rank j of this node
    const int j = threadIdx.x;
    int base = 0;
    for (int s = 0; s < R; ++s) {
      a.info[o.row_base + s * L + j] = base;
      base += count(s, c.node * L + j);
    }
  }
  if (threadIdx.x == kWarpSize) {
    int recv = 0, forwarded = 0;  // (forwarded: the rows from the RDMA peers, so far)
    for (int s = 0; s < R; ++s) {
      a.info[o.recv_starts + s] = recv;
      recv += count(s, c.rank);
      a.info[o.recv_ends + s] = recv;
    }
    for (int n = 0; n < N; ++n) {
      const int v = row(n * L + c.local)[kHeaderInts + R + c.node];
      a.info[o.from_nodes + n] = v;
      forwarded += v;
      a.info[o.from_ends + n] = forwarded;
    }
    a.info[o.num_recv] = recv;
    a.info[o.valid] = 1;
  }
}

// Every thread of the block: this call's tables from the call info, for rows of row_bytes (a dispatch) or
// crow_bytes (a combine). Where this rank's rows land at an RDMA peer comes from the peer's layout, computed
// here as the peer computes it: the same rd on every rank.
__device__ void load_tables(const Common& c, const int* info, int64_t row_bytes, int64_t crow_bytes,
                            int requested_chunk_rows, bool combine, NodeTables& t) {
  const int R = c.num_ranks, N = c.N, L = c.L;
  const InfoOffsets o = info_offsets(R, L);
  const int* rd = info + o.rd;
  const int64_t stride_bytes = 4 * count_row_ints(R, kMaxExperts, L);
  __shared__ int s_most;
  if (threadIdx.x == 0) s_most = 0;
  __syncthreads();
  int most = 0;
  for (int i = threadIdx.x; i < R * N; i += blockDim.x) most = max(most, rd[i]);
  if (most > 0) atomicMax(&s_most, most);
  if (threadIdx.x < N && threadIdx.x != c.node) {  // thread n: node n's RDMA peer's layout
    const int n = threadIdx.x;
    int64_t send_row0[kMaxNodes + 1], recv_row0[kMaxNodes + 1];
    segment_rows(rd, R, L, n * L + c.local, send_row0, recv_row0);
    const Areas pa = areas_of(stride_bytes, R, send_row0[N], recv_row0[N], row_bytes, crow_bytes);
    // this rank's rows land in the peer's segment for this node
    t.remote_in[n] = combine ? pa.crecv_off + send_row0[c.node] * crow_bytes
                             : pa.recv_off + recv_row0[c.node] * row_bytes;
  }
  if (threadIdx.x == kWarpSize) {
    segment_rows(rd, R, L, c.rank, t.send_row0, t.recv_row0);
    t.areas = areas_of(stride_bytes, R, t.send_row0[N], t.recv_row0[N], row_bytes, crow_bytes);
    t.num_recv = info[o.num_recv];
    t.valid = info[o.valid];
    t.op = c.counters->ops + 1;  // (the op's last kernel advances them once every block of it read them)
    t.barrier = c.counters->barriers + 1;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int floor_rows = (s_most + kMaxChunks - 1) / kMaxChunks;
    t.chunk_rows = max(max(requested_chunk_rows, 1), floor_rows);
    for (int n = 0; n < N; ++n) {
      t.nchunks_send[n] = int((t.send_row0[n + 1] - t.send_row0[n] + t.chunk_rows - 1) / t.chunk_rows);
      t.nchunks_recv[n] = int((t.recv_row0[n + 1] - t.recv_row0[n] + t.chunk_rows - 1) / t.chunk_rows);
    }
  }
  __syncthreads();
}

// The call info's row_base [R, L]: first receive row of source s on local rank j of this node.
__device__ __forceinline__ const int* row_base_of(const Common& c, const int* info) {
  return info + info_offsets(c.num_ranks, c.L).row_base;
}

// ---- dispatch -------------------------------------------------------------------------------------------
struct RowFormat {  // byte offsets inside a dispatch row (dispatch_row_bytes)
  int64_t scales, ids, weights, src, pos;
  __device__ RowFormat(int64_t x_bytes, int64_t scale_bytes, int k) {
    scales = x_bytes;
    ids = scales + scale_bytes;
    weights = ids + 4 * k;
    src = weights + 4 * k;
    pos = src + 8;
  }
};

// Rows of this rank's receive order that it writes into its outputs itself (pack: its own tokens; forward:
// rows from its RDMA peers): those from source s == rank, or from a remote node's rank with this local
// index. Node peers write the other rows into this rank's NVL buffer (copy-out moves them), and in a
// combine they read the other rows from this rank's staging area.
__device__ __forceinline__ bool written_here(const Common& c, int s) {
  return s == c.rank || (s / c.L != c.node && s % c.L == c.local);
}

// The source rank of row i of this rank's receive order (rows are grouped by source rank: source s starts
// at s_base[s], s_base[R] = rows), by bisection over the block's copy of the bases.
__device__ __forceinline__ int source_of(const int* s_base, int R, int64_t i) {
  int lo = 0, hi = R - 1;  // the last s with s_base[s] <= i (empty sources share their successor's base)
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (s_base[mid] <= i) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// The block copies this rank's column of row_base ([R, L]) into s_base, and s_base[R] = rows.
__device__ void load_bases(const Common& c, const int* row_base, int64_t rows, int* s_base) {
  for (int s = threadIdx.x; s <= c.num_ranks; s += blockDim.x)
    s_base[s] = s < c.num_ranks ? row_base[s * c.L + c.local] : int(rows);
  __syncthreads();
}

static_assert(kMaxExpertMajorTopk <= kWarpSize, "one lane per top-k slot");

// A slot's id word as rows carry it: the expert id, and in an expert-major dispatch (kEmIdBits) the slot's
// position + 1 among the sender's tokens for that expert, so that the receiver knows its expert-major row. An
// id past the experts (possible only with the value checks off) goes as -1 there: its low bits would name
// another expert.
__device__ __forceinline__ int em_word(const DispatchArgs& a, int id, int pos) {
  if (a.em_x == nullptr || id < 0) return id;
  return id < a.experts_per_rank * a.c.num_ranks ? id | ((pos + 1) << kEmIdBits) : -1;
}
// An id word's expert (-1 stays -1) and its position + 1 (0: none), as em_word packed them.
__device__ __forceinline__ int em_expert(int word) { return word < 0 ? word : word & ((1 << kEmIdBits) - 1); }
__device__ __forceinline__ int em_position1(int word) { return word < 0 ? 0 : word >> kEmIdBits; }

// The whole warp: outputs row `row` of a token whose top-k id words / weights are id(k) / w(k) (em_word)
// and which is token src_token of rank src_rank: ids become local expert ids or -1. Expert-major: lane k
// also names slot k's expert-major row in em_map and the warp stores the token's x (at xsrc, row format or
// the caller's x: kNc) there.
template <bool kNc, typename Id, typename W>
__device__ __forceinline__ void emit_meta(const DispatchArgs& a, int64_t row, Id id, W w, int src_token, int src_rank,
                                          const char* xsrc, int lane) {
  const int lo = a.c.rank * a.experts_per_rank;
  if (a.recv_idx != nullptr) {
    for (int k = lane; k < a.num_topk; k += kWarpSize) {
      const int v = id(k);
      const int e = (a.em_x != nullptr ? em_expert(v) : v) - lo;
      const bool mine = e >= 0 && e < a.experts_per_rank;
      a.recv_idx[row * a.num_topk + k] = mine ? e : -1;
      if (a.recv_w != nullptr) a.recv_w[row * a.num_topk + k] = mine ? w(k) : 0.f;
    }
  }
  if (a.recv_src != nullptr && lane < 2) a.recv_src[row * 2 + lane] = lane == 0 ? src_token : src_rank;
  if (a.em_x == nullptr) return;
  int d = -1;  // lane k: slot k's expert-major row (num_topk <= kMaxExpertMajorTopk: a lane per slot)
  if (lane < a.num_topk) {
    const int v = id(lane);
    const int e = v < 0 ? -1 : em_expert(v) - lo;
    const int pos1 = em_position1(v);
    if (e >= 0 && e < a.experts_per_rank && pos1 > 0) {
      d = a.em_base[src_rank * a.experts_per_rank + e] + pos1 - 1;
      if (d >= a.em_rows) d = -1;  // (the host refused blocks that overflow a capacity)
    }
    a.em_map[row * a.num_topk + lane] = d;
  }
  // the token's expert-major rows (the same list in every lane), then x read once and stored in each
  char* dst[kMaxExpertMajorTopk];
  int m = 0;
  for (int k = 0; k < a.num_topk; ++k) {
    const int dk = intranode::warp_shfl(d, k);
    if (dk >= 0) dst[m++] = a.em_x + int64_t(dk) * a.x_bytes;
  }
  warp_copy_to<kNc>(dst, m, xsrc, a.x_bytes, lane);
}

// The whole warp: outputs row `row` from a token in row format at p (landed here or in the NVL buffer).
// (The row's small fields are loaded first, so that their round trip overlaps the copies.)
__device__ __forceinline__ void emit_row(const DispatchArgs& a, const RowFormat& f, const char* p, int64_t row,
                                         int lane) {
  const int* ids = reinterpret_cast<const int*>(p + f.ids);
  const float* ws = reinterpret_cast<const float*>(p + f.weights);
  const bool few = a.num_topk <= kWarpSize;  // then lane k holds top-k entry k
  const int id0 = few && lane < a.num_topk ? ids[lane] : 0;
  const float w0 = few && lane < a.num_topk ? ws[lane] : 0.f;
  const int src = lane < 2 ? reinterpret_cast<const int*>(p + f.src)[lane] : 0;
  const ScaleWords<false> scales(p + f.scales, a.recv_scales != nullptr ? a.scale_bytes : 0, lane);
  if (a.recv_x != nullptr) warp_copy<false>(a.recv_x + row * a.x_bytes, p, a.x_bytes, lane);
  if (a.recv_scales != nullptr) scales.store(a.recv_scales + row * a.scale_bytes, lane);
  emit_meta<false>(a, row, [&](int k) { return few ? id0 : ids[k]; }, [&](int k) { return few ? w0 : ws[k]; },
                   intranode::warp_shfl(src, 0), intranode::warp_shfl(src, 1), p, lane);
}

// Each token is read once and written, in row format, into its row of every other destination node's send
// segment and into its receive rows on this node's other ranks (their NVL buffers), and, split, into this
// rank's own outputs when it is one of its final ranks.
__global__ void __launch_bounds__(kThreads) dispatch_pack_kernel(DispatchArgs a) {
  const Common& c = a.c;
  __shared__ NodeTables tab;
  load_tables(c, a.info, a.row_bytes, 0, a.requested_chunk_rows, false, tab);
  if (blockIdx.x == 0 && threadIdx.x == 0)
    start_op(c, tab.barrier, dispatch_flag(c.num_ranks, 0, 0), tab.nchunks_recv, kPhaseDispatchSend);
  if (!wait_peers_ready(c, tab.op, kPhaseDispatchSend)) return;
  // node peers no longer read their NVL buffers of the previous op
  if (c.L > 1 && !barrier_wait(c, tab.barrier, kPhaseDispatchSend)) return;
  const RowFormat f(a.x_bytes, a.scale_bytes, a.num_topk);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t gwarp = int64_t(blockIdx.x) * kWarps + warp;
  const int64_t nwarps = int64_t(gridDim.x) * kWarps;
  char* send = c.rdma + tab.areas.send_off;
  // the token's row-format rows (other nodes' send rows, then node peers' NVL rows), then its own output row
  __shared__ char* s_dst[kWarps][kMaxNodes + kMaxLocal];
  __shared__ int s_node[kWarps][kMaxNodes + kMaxLocal];  // destination node of a send row, -1 for an NVL row
  const int R = c.num_ranks, K = a.num_topk;
  const bool few_ranks = R <= kWarpSize, few_topk = K <= kWarpSize;  // then one lane per rank / top-k entry
  // this rank's rows on the node's ranks
  const int base = lane < c.L ? row_base_of(c, a.info)[c.rank * c.L + lane] : 0;
  const int64_t num_tokens = tab.valid ? a.num_tokens : 0;  // a refused call moves none of the caller's rows
  for (int64_t t = gwarp; t < num_tokens; t += nwarps) {
    // every load of the token's small fields first, in one round trip: its rows per node, its positions
    // on every rank, its top-k
    const int head = lane < c.N ? a.node_head[t * c.N + lane] : -1;
    const int pos_r = few_ranks && lane < R ? a.send_pos[t * R + lane] : -1;
    // lane k: slot k's id word (em_word; an expert-major dispatch has few_topk)
    const int id0 = few_topk && lane < K
                        ? em_word(a, int(a.topk_idx[t * K + lane]), a.em_x != nullptr ? a.topk_pos[t * K + lane] : -1)
                        : 0;
    const float w0 = few_topk && lane < K && a.topk_w != nullptr ? a.topk_w[t * K + lane] : 0.f;
    const ScaleWords<true> scales(a.scales + t * a.scale_bytes, a.scale_bytes, lane);
    // lane j < L: the token's position among the rows this rank sends to rank j of node n
    auto pos_on = [&](int n) {
      const int r = n * c.L + (lane < c.L ? lane : 0);
      const int v = few_ranks ? intranode::warp_shfl(pos_r, r) : (lane < c.L ? a.send_pos[t * R + r] : -1);
      return lane < c.L ? v : -1;
    };
    const int own_head = intranode::warp_shfl(head, c.node);
    const bool remote = head >= 0 && lane != c.node;
    const uint64_t hit = intranode::warp_ballot(remote);
    if (remote) {
      const int q = __popcll(hit & ((1ull << lane) - 1ull));
      s_dst[warp][q] = send + (tab.send_row0[lane] + head) * a.row_bytes;
      s_node[warp][q] = lane;
    }
    const int mr = __popcll(hit);
    // this node's final ranks (lane j: local rank j)
    const int own_pos = pos_on(c.node);  // -1 everywhere when no rank of this node takes the token
    const int dst_row = own_pos >= 0 ? base + own_pos : -1;
    if (lane < c.L && a.fwd_head != nullptr && own_head >= 0)
      a.fwd_head[(tab.recv_row0[c.node] + own_head) * c.L + lane] = dst_row;
    const int own_row = intranode::warp_shfl(dst_row, c.local);
    const bool peer = dst_row >= 0 && lane != c.local;
    const uint64_t phit = intranode::warp_ballot(peer);
    if (peer) {
      const int q = mr + __popcll(phit & ((1ull << lane) - 1ull));
      s_dst[warp][q] = c.nvl[lane] + a.nvl_recv_off + int64_t(dst_row) * a.row_bytes;
      s_node[warp][q] = -1;
    }
    const int m = mr + __popcll(phit);
    const bool own_x = own_row >= 0 && a.recv_x != nullptr;
    if (own_x && lane == 0) s_dst[warp][m] = a.recv_x + int64_t(own_row) * a.x_bytes;
    intranode::warp_sync();
    const char* x = a.x + t * a.x_bytes;
    warp_copy_to<true>(s_dst[warp], m + own_x, x, a.x_bytes, lane);
    for (int q = 0; q < m; ++q) {
      char* p = s_dst[warp][q];
      const int n = s_node[warp][q];
      if (a.scale_bytes) scales.store(p + f.scales, lane);
      for (int k = lane; k < K; k += kWarpSize) {
        reinterpret_cast<int*>(p + f.ids)[k] = few_topk ? id0 : int(a.topk_idx[t * K + k]);
        reinterpret_cast<float*>(p + f.weights)[k] = few_topk ? w0 : a.topk_w != nullptr ? a.topk_w[t * K + k] : 0.f;
      }
      if (lane < 2) reinterpret_cast<int*>(p + f.src)[lane] = lane == 0 ? int(t) : c.rank;
      if (n < 0) continue;  // an NVL row: its reader needs no positions
      const int pos = pos_on(n);
      if (lane < c.L) reinterpret_cast<int*>(p + f.pos)[lane] = pos;
      intranode::warp_sync();
      if (lane == 0)
        row_written(c, n, a.node_head[t * c.N + n], tab.send_row0[n], tab.send_row0[n + 1] - tab.send_row0[n],
                    tab.chunk_rows, tab.areas.send_off, tab.remote_in[n], a.row_bytes,
                    dispatch_flag(c.num_ranks, c.node, 0),
                    kPhaseDispatchSend);
    }
    if (own_row >= 0) {
      if (a.recv_scales != nullptr) scales.store(a.recv_scales + int64_t(own_row) * a.scale_bytes, lane);
      const int64_t* ids = a.topk_idx + t * K;
      const float* ws = a.topk_w != nullptr ? a.topk_w + t * K : nullptr;
      emit_meta<true>(a, own_row, [&](int k) { return few_topk ? id0 : int(ids[k]); },
                      [&](int k) { return few_topk ? w0 : ws != nullptr ? ws[k] : 0.f; }, int(t), c.rank, x, lane);
    }
    intranode::warp_sync();  // s_dst / s_node are rewritten for the next token
  }
}

// One warp forwards row i of remote node n's segment (landed in the recv area) to its final ranks in this
// node: into their NVL buffers over NVLink/xGMI (read once, stored once per rank; s_dst: the warp's scratch
// for their addresses), and, split, into this rank's own outputs. Rows are 16-byte multiples
// (dispatch_row_bytes).
__device__ void forward_row(const DispatchArgs& a, const Common& c, const NodeTables& tab, const RowFormat& f, int n,
                            int64_t i, int lane, char** s_dst) {
  const int64_t k = tab.recv_row0[n] + i;
  const char* p = c.rdma + tab.areas.recv_off + k * a.row_bytes;
  const int src = n * c.L + c.local;
  int dst_row = -1;
  bool bad = false;
  if (lane < c.L) {
    const int base = row_base_of(c, a.info)[src * c.L + lane];  // issued before, not after, the position's load
    // the rows src sends to this node's rank `lane`: a landed position is checked against them before any write
    const int rows = a.info[info_offsets(c.num_ranks, c.L).counts + src * c.num_ranks + c.node * c.L + lane];
    const int pos = reinterpret_cast<const volatile int*>(p + f.pos)[lane];
    const int from = lane == 0 ? reinterpret_cast<const volatile int*>(p + f.src)[1] : src;
    bad = pos < -1 || pos >= rows || from != src;
    if (bad) report_error(c.err, c.claim, kErrBadRow, c.rank, src, kPhaseDispatchForward, from != src ? -2 : pos, rows,
                          lane);
    dst_row = pos >= 0 && !bad ? base + pos : -1;
  }
  if (intranode::warp_any(bad)) dst_row = -1;  // (a garbled row: none of its writes)
  if (lane < c.L && a.fwd_head != nullptr) a.fwd_head[k * c.L + lane] = dst_row;
  const int own_row = intranode::warp_shfl(dst_row, c.local);
  const int m = warp_compact(s_dst, dst_row >= 0 && lane != c.local,
                             c.nvl[lane < c.L ? lane : 0] + a.nvl_recv_off + int64_t(dst_row) * a.row_bytes, lane);
  if (m > 0) intranode::warp_push_row<int4, 8, false>(p, a.row_bytes, s_dst, m, lane);
  if (own_row >= 0) emit_row(a, f, p, own_row, lane);
  intranode::warp_sync();  // s_dst is rewritten for the next row
}

// The rows of the remote segments, concatenated in node order, are dealt to the worker warps (all but the
// watcher warp 0) of all blocks in turn; a worker forwards a row as soon as its chunk landed (Arrivals).
__global__ void __launch_bounds__(kThreads) dispatch_forward_kernel(DispatchArgs a) {
  const Common& c = a.c;
  __shared__ NodeTables tab;
  load_tables(c, a.info, a.row_bytes, 0, a.requested_chunk_rows, false, tab);
  if (!barrier_wait(c, tab.barrier, kPhaseDispatchForward)) return;
  __shared__ Arrivals s;
  arrivals_init(s);
  const RowFormat f(a.x_bytes, a.scale_bytes, a.num_topk);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  __shared__ char* s_dst[kWarps][kMaxLocal];
  if (warp == 0) {
    watch_arrivals(c, tab.op, s, tab.nchunks_recv, [&](int n, int j) { return dispatch_flag(c.num_ranks, n, j); },
                   0, kPhaseDispatchForward);
  } else {
    int64_t total = 0;  // remote rows (the pack kernel placed this node's own)
    for (int n = 0; n < c.N; ++n)
      if (n != c.node) total += tab.recv_row0[n + 1] - tab.recv_row0[n];
    const int64_t nw = int64_t(gridDim.x) * (kWarps - 1);
    int n = -1;
    int64_t seg_lo = 0, seg_hi = 0;  // the concatenated rows [seg_lo, seg_hi) are node n's segment
    for (int64_t k = int64_t(blockIdx.x) * (kWarps - 1) + warp - 1; k < total; k += nw) {
      while (k >= seg_hi) {
        do ++n; while (n == c.node);
        seg_lo = seg_hi;
        seg_hi += tab.recv_row0[n + 1] - tab.recv_row0[n];
      }
      const int64_t i = k - seg_lo;
      const bool ok = intranode::warp_shfl(lane == 0 ? int(arrived(s, n, int(i / tab.chunk_rows))) : 0, 0) != 0;
      intranode::warp_sync();  // lane 0's acquire orders the other lanes' loads too
      if (!ok) break;
      forward_row(a, c, tab, f, n, i, lane, s_dst[warp]);
    }
  }
  if (last_block(c)) barrier_arrive(c, tab.barrier + 1);
}

// Moves the rows node peers wrote into this rank's NVL buffer (none with one rank per node) into the
// outputs, and fills the padding rows up to num_worst_tokens (zeros, ids -1, sources -1).
__global__ void __launch_bounds__(kThreads) dispatch_copy_out_kernel(DispatchArgs a) {
  const Common& c = a.c;
  __shared__ NodeTables tab;
  load_tables(c, a.info, a.row_bytes, 0, a.requested_chunk_rows, false, tab);
  if (!barrier_wait(c, tab.barrier + 1, kPhaseDispatchCopyOut)) return;
  clear_chunk_counts(c, tab.nchunks_send);  // the pack kernel's
  __shared__ int s_base[kMaxNodes * kMaxLocal + 1];
  load_bases(c, row_base_of(c, a.info), tab.num_recv, s_base);
  const RowFormat f(a.x_bytes, a.scale_bytes, a.num_topk);
  const int lane = threadIdx.x % kWarpSize;
  const int64_t gwarp = int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  const int64_t nwarps = int64_t(gridDim.x) * kWarps;
  const char* area = c.nvl[c.local] + a.nvl_recv_off;
  for (int64_t i = (c.L == 1 ? tab.num_recv : 0) + gwarp; i < a.out_rows; i += nwarps) {
    if (i < tab.num_recv) {
      if (!written_here(c, source_of(s_base, c.num_ranks, i))) emit_row(a, f, area + i * a.row_bytes, i, lane);
      continue;
    }
    if (a.recv_x != nullptr) intranode::grid_zero_bytes(a.recv_x + i * a.x_bytes, a.x_bytes, lane, kWarpSize);
    if (a.recv_scales != nullptr)
      intranode::grid_zero_bytes(a.recv_scales + i * a.scale_bytes, a.scale_bytes, lane, kWarpSize);
    if (a.recv_idx != nullptr)
      for (int k = lane; k < a.num_topk; k += kWarpSize) {
        a.recv_idx[i * a.num_topk + k] = -1;
        if (a.recv_w != nullptr) a.recv_w[i * a.num_topk + k] = 0.f;
      }
    if (a.recv_src != nullptr && lane < 2) a.recv_src[i * 2 + lane] = -1;
    if (a.em_map != nullptr && lane < a.num_topk) a.em_map[i * a.num_topk + lane] = -1;
  }
  if (last_block(c)) finish_op(c, tab.op, tab.barrier);
}

// ---- combine --------------------------------------------------------------------------------------------
// Stages the rows node peers reduce (rows from the sources they forward for, written_here() false: none with
// one rank per node) with their weights into this rank's NVL staging area.
__global__ void __launch_bounds__(kThreads) combine_stage_kernel(CombineArgs a, int elem_bytes) {
  const Common& c = a.c;
  __shared__ NodeTables tab;
  load_tables(c, a.info, 0, a.crow_bytes, a.requested_chunk_rows, true, tab);
  if (blockIdx.x == 0 && threadIdx.x == 0)
    start_op(c, tab.barrier, combine_flag(c.num_ranks, c.N, 0, 0), tab.nchunks_send, kPhaseCombineStage);
  if (!barrier_wait(c, tab.barrier, kPhaseCombineStage)) return;  // peers no longer read the staging rows
  __shared__ int s_base[kMaxNodes * kMaxLocal + 1];
  load_bases(c, row_base_of(c, a.info), tab.num_recv, s_base);
  const int lane = threadIdx.x % kWarpSize;
  const int64_t gwarp = int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  const int64_t nwarps = int64_t(gridDim.x) * kWarps;
  const int64_t y_bytes = int64_t(a.hidden) * elem_bytes;
  char* stage = c.nvl[c.local] + a.nvl_stage_off;
  for (int64_t i = (c.L == 1 ? tab.num_recv : 0) + gwarp; i < tab.num_recv; i += nwarps) {
    if (written_here(c, source_of(s_base, c.num_ranks, i))) continue;
    char* p = stage + i * a.crow_bytes;
    warp_copy<true>(p, a.x + i * y_bytes, y_bytes, lane);
    for (int k = lane; k < a.num_topk; k += kWarpSize)
      reinterpret_cast<float*>(p + y_bytes)[k] = a.topk_w[i * a.num_topk + k];
  }
  if (last_block(c)) barrier_arrive(c, tab.barrier + 1);
}

// The whole warp: out = the float32 sum of the m rows src[0..m) in order, rounded once (CombineRow; kVec:
// elements per 16-byte vector, or 1 when a row or pointer is not a 16-byte multiple), and, when out_w is
// set, out_w = the sum of the m_w weight rows w[0..m_w) (float32 x num_topk; biases carry none).
template <typename T, int kVec>
__device__ __forceinline__ void sum_rows(const T* const* src, int m, const float* const* w, int m_w, T* out,
                                         float* out_w, const CombineArgs& a, int lane) {
  // lane k's weights of slot k loaded before the rows (one round trip fewer) when each lane holds one slot
  constexpr int kEarly = 4;  // weight rows held that way (the nodes of a reduce, a forward's local ranks)
  const bool early = out_w != nullptr && a.num_topk <= kWarpSize && m_w <= kEarly;
  float wk[kEarly];
#pragma unroll
  for (int q = 0; q < kEarly; ++q) wk[q] = early && q < m_w && lane < a.num_topk ? w[q][lane] : 0.f;
  intranode::CombineRow<T, kVec>::sum_rows(src, m, out, a.hidden / kVec, lane);
  if (out_w == nullptr) return;
  if (early) {
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < kEarly; ++q)
      if (q < m_w) s += wk[q];
    if (lane < a.num_topk) out_w[lane] = s;
    return;
  }
  for (int kk = lane; kk < a.num_topk; kk += kWarpSize) {
    float s = 0.f;
    for (int q = 0; q < m_w; ++q) s += w[q][kk];
    out_w[kk] = s;
  }
}

// Lane 0, once the warp wrote row i of node n's segment of csend (the combine forward's rows for a remote
// node, weights included): counts it towards its chunk, which the call completing it sends.
__device__ void combine_row_sent(const CombineArgs& a, const Common& c, const NodeTables& tab, int n, int64_t i) {
  row_written(c, n, i, tab.recv_row0[n], tab.recv_row0[n + 1] - tab.recv_row0[n], tab.chunk_rows,
              tab.areas.csend_off, tab.remote_in[n], a.crow_bytes, combine_flag(c.num_ranks, c.N, c.node, 0),
              kPhaseCombineForward);
}

// ---- bulk copies (sm_90): the forward's rows with one rank per node ----------------------------------------
// With one rank per node each row the forward sends is one x row, byte for byte (the float32 sum of one row,
// rounded, is the row; the reduce adds the partials from +0, so a -0 kept here comes out as the register path's
// +0). A warp streams its rows through kBulkStages shared-memory chunks with Hopper's bulk copies: lane 0
// loads chunk k + kBulkStages from global while chunk k is stored to the send row, so up to ~12.75 KiB per warp
// are in flight without registers (the register loop: ~6 KiB). Beside a copy engine's traffic (the emulated
// NIC) a bulk copy kept 1.46x the register loop's rate per SM in a probe.
constexpr int kBulkStages = 3;
constexpr int kBulkChunk = 4352;  // bytes; 16-byte multiple
constexpr int kBulkBytes = kWarps * kBulkStages * kBulkChunk;  // 204 KiB per block

#if !defined(UCCL_EP_WITH_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// Where a warp's row stream stands: row r of its rows (j = first + r * step over the forwarded rows, own
// node's skipped), chunk ch of it. Rows whose dispatch row had no source here (dst_row -1) are not in the
// stream: forward_rows_bulk writes them as zeros first.
struct BulkCursor {
  const CombineArgs* a;
  int64_t j, step, total, own_lo, own_rows, nch, y_bytes;
  int64_t k;  // the row (forwarded-row index)
  int ch;
  const char* src;
  __device__ bool valid() const { return j < total; }
  __device__ void settle() {  // from j on, the first row with a source
    for (; j < total; j += step) {
      k = j < own_lo ? j : j + own_rows;
      const int dst_row = a->fwd_head[k];
      if (dst_row >= 0) {
        src = a->x + int64_t(dst_row) * y_bytes;
        return;
      }
    }
  }
  __device__ void next() {
    if (++ch < nch) return;
    ch = 0;
    j += step;
    settle();
  }
  __device__ uint32_t len() const {
    const int64_t left = y_bytes - int64_t(ch) * kBulkChunk;
    return uint32_t(left < kBulkChunk ? left : kBulkChunk);
  }
  __device__ bool last() const { return ch == nch - 1; }
};

template <typename T>
__device__ void forward_rows_bulk(const CombineArgs& a, const Common& c, const NodeTables& tab, int64_t first,
                                  int64_t step, int64_t total, int64_t own_lo, int64_t own_rows, char* stage,
                                  uint64_t* bars, int lane) {
  const int64_t y_bytes = int64_t(a.hidden) * sizeof(T);
  char* csend = c.rdma + tab.areas.csend_off;
  auto signal = [&](int64_t k) {  // lane 0: row k's bytes are in csend (its weights: the warp's, synced)
    const int n = segment_of(tab.recv_row0, c.N, k);
    combine_row_sent(a, c, tab, n, k - tab.recv_row0[n]);
  };
  // rows without a source: zeros (and zero weights), sent as they are
  for (int64_t j = first; j < total; j += step) {
    const int64_t k = j < own_lo ? j : j + own_rows;
    if (a.fwd_head[k] >= 0) continue;
    char* out = csend + k * a.crow_bytes;
    for (int64_t i = lane * 16; i < y_bytes; i += kWarpSize * 16) *reinterpret_cast<int4*>(out + i) = int4{0, 0, 0, 0};
    for (int kk = lane; kk < a.num_topk; kk += kWarpSize) reinterpret_cast<float*>(out + y_bytes)[kk] = 0.f;
    intranode::warp_sync();
    if (lane == 0) signal(k);
  }
  const int64_t nch = (y_bytes + kBulkChunk - 1) / kBulkChunk;
  BulkCursor ld{&a, first, step, total, own_lo, own_rows, nch, y_bytes, 0, 0, nullptr};
  ld.settle();
  BulkCursor st = ld;
  if (lane == 0) {
    for (int q = 0; q < kBulkStages; ++q)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[q])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  intranode::warp_sync();
  auto load = [&](int q) {  // lane 0: the load cursor's chunk into stage q
    const uint32_t len = ld.len();
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&bars[q])), "r"(len)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(stage + q * kBulkChunk)),
                 "l"(ld.src + int64_t(ld.ch) * kBulkChunk), "r"(len), "r"(smem_addr(&bars[q]))
                 : "memory");
  };
  if (lane == 0)
    for (int q = 0; q < kBulkStages && ld.valid(); ++q, ld.next()) load(q);
  int64_t pending = -1;  // a row whose last chunk's store is in flight
  for (int64_t item = 0; st.valid(); ++item) {
    const int q = int(item % kBulkStages);
    if (st.ch == 0) {  // the row's weights, by the lanes (stored before its signal: warp_sync, lane 0's fence)
      const int dst_row = a.fwd_head[st.k];
      float* out_w = reinterpret_cast<float*>(csend + st.k * a.crow_bytes + y_bytes);
      for (int kk = lane; kk < a.num_topk; kk += kWarpSize) out_w[kk] = a.topk_w[int64_t(dst_row) * a.num_topk + kk];
    }
    if (lane == 0) {
      const uint32_t parity = uint32_t((item / kBulkStages) & 1);
      uint32_t ok = 0;
      while (!ok)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(ok)
                     : "r"(smem_addr(&bars[q])), "r"(parity)
                     : "memory");
      char* dst = csend + st.k * a.crow_bytes + int64_t(st.ch) * kBulkChunk;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                   "r"(smem_addr(stage + q * kBulkChunk)), "r"(st.len())
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // stage q is read: free for the next load
      if (ld.valid()) {
        load(q);
        ld.next();
      }
      asm volatile("cp.async.bulk.wait_group 1;" ::: "memory");  // every store but this one has landed
      if (pending >= 0) {
        asm volatile("fence.proxy.async.global;" ::: "memory");
        signal(pending);
      }
      pending = st.last() ? st.k : -1;
    }
    intranode::warp_sync();  // (every lane follows the store cursor: the weights; lane 0 alone issues copies)
    st.next();
  }
  if (lane == 0) {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    if (pending >= 0) {
      asm volatile("fence.proxy.async.global;" ::: "memory");
      signal(pending);
    }
    for (int q = 0; q < kBulkStages; ++q)
      asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_addr(&bars[q])));
  }
  intranode::warp_sync();
}
#endif

// Each row this rank forwarded in the dispatch is the sum of its node ranks' rows, in local order: this
// rank's own from x, the others' from their staging areas. The sum goes into the csend row for a remote
// node (sent per chunk) or straight into crecv for this node. With one rank per node the own node's rows
// are skipped: each is x's row alone, which the reduce reads where it is (own_partial).
template <typename T, int kVec, bool kBulk>
__global__ void __launch_bounds__(kThreads) combine_forward_kernel(CombineArgs a) {
  const Common& c = a.c;
  __shared__ NodeTables tab;
  load_tables(c, a.info, 0, a.crow_bytes, a.requested_chunk_rows, true, tab);
  if (!barrier_wait(c, tab.barrier + 1, kPhaseCombineForward) || !wait_peers_ready(c, tab.op, kPhaseCombineForward))
    return;
  __shared__ const T* s_src[kWarps][kMaxLocal];  // the row's inputs, in local rank order
  __shared__ const float* s_w[kWarps][kMaxLocal];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t gwarp = int64_t(blockIdx.x) * kWarps + warp;
  const int64_t nwarps = int64_t(gridDim.x) * kWarps;
  const int64_t y_bytes = int64_t(a.hidden) * sizeof(T);
  // The rows forwarded: every node's segment, less the own node's with one rank per node.
  const int64_t own_lo = tab.recv_row0[c.node];
  const int64_t own_rows = c.L == 1 ? tab.recv_row0[c.node + 1] - own_lo : 0;
  const int64_t total = tab.recv_row0[c.N] - own_rows;
#if !defined(UCCL_EP_WITH_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kBulkHere = kBulk;
#else
  constexpr bool kBulkHere = false;  // (code for an older GPU runs the register loop, whatever the launch)
#endif
  if constexpr (kBulkHere) {  // one rank per node (the host launches kBulk only then, with kBulkBytes of stages)
#if !defined(UCCL_EP_WITH_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) char s_bulk[];
    __shared__ __align__(8) uint64_t s_bars[kWarps][kBulkStages];
    forward_rows_bulk<T>(a, c, tab, gwarp, nwarps, total, own_lo, own_rows,
                         s_bulk + int64_t(warp) * kBulkStages * kBulkChunk, s_bars[warp], lane);
#endif
  } else {
    for (int64_t j = gwarp; j < total; j += nwarps) {
      const int64_t k = j < own_lo ? j : j + own_rows;
      const int n = segment_of(tab.recv_row0, c.N, k);
      const int64_t i = k - tab.recv_row0[n];
      const int dst_row = lane < c.L ? a.fwd_head[k * c.L + lane] : -1;
      const T* src = nullptr;
      const float* w = nullptr;
      if (lane == c.local) {
        src = reinterpret_cast<const T*>(a.x + int64_t(dst_row) * y_bytes);
        w = a.topk_w + int64_t(dst_row) * a.num_topk;
      } else if (lane < c.L) {
        const char* staged = c.nvl[lane] + a.nvl_stage_off + int64_t(dst_row) * a.crow_bytes;
        src = reinterpret_cast<const T*>(staged);
        w = reinterpret_cast<const float*>(staged + y_bytes);
      }
      warp_compact(s_w[warp], dst_row >= 0, w, lane);
      const int m = warp_compact(s_src[warp], dst_row >= 0, src, lane);
      char* out = n == c.node ? c.rdma + tab.areas.crecv_off + (tab.send_row0[n] + i) * a.crow_bytes
                              : c.rdma + tab.areas.csend_off + k * a.crow_bytes;
      sum_rows<T, kVec>(s_src[warp], m, s_w[warp], m, reinterpret_cast<T*>(out),
                        reinterpret_cast<float*>(out + y_bytes), a, lane);
      intranode::warp_sync();  // s_src[warp] is rewritten for the next row
      if (lane == 0 && n != c.node) combine_row_sent(a, c, tab, n, i);
    }
  }
}

// The own node's partial row of a token whose own-node row the dispatch put at dst_row of x (fwd_head), with
// one rank per node: the forward skipped it, it is x's row dst_row (and its weights), bit-equal to the float32
// sum of that one row the forward would have written into crecv. False when the token's row had no source
// here (dst_row -1: the forward's row would be zeros, which add nothing).
template <typename T>
__device__ __forceinline__ bool own_partial(const CombineArgs& a, int dst_row, const T** row, const float** w) {
  if (dst_row < 0) return false;
  *row = reinterpret_cast<const T*>(a.x + int64_t(dst_row) * a.hidden * int64_t(sizeof(T)));
  *w = a.topk_w + int64_t(dst_row) * a.num_topk;
  return true;
}

// A worker warp's tokens of the reduce (combine_reduce_kernel): s_src / s_w its scratch rows. A token's small
// fields come ahead of it, so that their round trips overlap the previous tokens' sums: its rows per node
// (lane n) two tokens ahead, its own-node x row (lane `node`, one rank per node), which needs them, one ahead.
template <typename T, int kVec>
__device__ void reduce_tokens(const CombineArgs& a, const Common& c, const NodeTables& tab, const Arrivals& s,
                              int warp, const T** s_src, const float** s_w) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t nw = int64_t(gridDim.x) * (kWarps - 1);
  const int64_t y_bytes = int64_t(a.hidden) * sizeof(T);
  const char* crecv = c.rdma + tab.areas.crecv_off;
  const int64_t num_tokens = tab.valid ? a.num_tokens : 0;  // a refused dispatch's chunks never come
  const bool own_lane = c.L == 1 && lane == c.node;  // reads the own partial from x (own_partial)
  auto head_of = [&](int64_t t) { return t < num_tokens && lane < c.N ? a.node_head[t * c.N + lane] : -1; };
  auto dst_of = [&](int head) { return own_lane && head >= 0 ? a.fwd_head[tab.recv_row0[c.node] + head] : -1; };
  const int64_t first = int64_t(blockIdx.x) * (kWarps - 1) + warp - 1;
  int head = head_of(first), next_head = head_of(first + nw);
  int dst = dst_of(head);
  for (int64_t t = first; t < num_tokens; t += nw) {
    const int next_dst = dst_of(next_head), after_head = head_of(t + 2 * nw);
    const bool ok = !(head >= 0 && lane != c.node) || arrived(s, lane, head / tab.chunk_rows);
    const bool failed = intranode::warp_any(!ok);
    intranode::warp_sync();  // the waiting lanes' acquires order every lane's loads
    if (failed) break;
    const char* row = crecv + (tab.send_row0[lane < c.N ? lane : 0] + head) * a.crow_bytes;
    const T* src = reinterpret_cast<const T*>(row);
    const float* w = reinterpret_cast<const float*>(row + y_bytes);
    const bool has = head >= 0 && (!own_lane || own_partial<T>(a, dst, &src, &w));
    warp_compact(s_w, has, w, lane);
    const int m = warp_compact(s_src, has, src, lane);
    int nb = m;
    if (a.bias0 != nullptr && lane == 0) s_src[nb] = reinterpret_cast<const T*>(a.bias0 + t * y_bytes);
    nb += a.bias0 != nullptr;
    if (a.bias1 != nullptr && lane == 0) s_src[nb] = reinterpret_cast<const T*>(a.bias1 + t * y_bytes);
    nb += a.bias1 != nullptr;
    intranode::warp_sync();
    sum_rows<T, kVec>(s_src, nb, s_w, m, reinterpret_cast<T*>(a.out + t * y_bytes),
                      a.out_w != nullptr ? a.out_w + t * a.num_topk : nullptr, a, lane);
    intranode::warp_sync();
    head = next_head;
    dst = next_dst;
    next_head = after_head;
  }
}

// Each token is the sum of its nodes' partial rows in node order (+ biases). A worker warp (all but the
// watcher warp 0) takes a token as soon as the chunks holding its remote partials landed (Arrivals): the
// reduce overlaps the last chunks' transfers.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) combine_reduce_kernel(CombineArgs a) {
  const Common& c = a.c;
  __shared__ NodeTables tab;
  load_tables(c, a.info, 0, a.crow_bytes, a.requested_chunk_rows, true, tab);
  __shared__ Arrivals s;
  arrivals_init(s);
  clear_chunk_counts(c, tab.nchunks_recv);  // the forward kernel's (it finished: it ran before on this stream)
  __shared__ const T* s_src[kWarps][kMaxNodes + 2];  // the token's node sums in node order, then the biases
  __shared__ const float* s_w[kWarps][kMaxNodes];
  const int warp = threadIdx.x / kWarpSize;
  if (warp == 0) {
    watch_arrivals(c, tab.op, s, tab.nchunks_send,
                   [&](int n, int j) { return combine_flag(c.num_ranks, c.N, n, j); }, 1, kPhaseCombineReduce);
  } else {
    reduce_tokens<T, kVec>(a, c, tab, s, warp, s_src[warp], s_w[warp]);
  }
  if (last_block(c)) finish_op(c, tab.op, tab.barrier);
}

void check_launch(const char* what) {
  const gpuError_t e = gpuGetLastError();
  UCCL_CHECK(e == gpuSuccess, "internode " << what << ": kernel launch failed: " << gpuGetErrorString(e));
}

// Whether the combine forward for element type T may run its bulk-copy path on the current device: a
// Hopper-class GPU (sm_90+) whose blocks can take kBulkBytes of dynamic shared memory beside the kernel's static
// shared memory, which the first call per device opts in to. The attribute belongs to one kernel on one device,
// so the cached answer is kept per element type (one kernel each) and per device.
template <typename T>
bool bulk_copies() {
#if defined(UCCL_EP_WITH_HIP)
  return false;
#else
  const auto kernel = combine_forward_kernel<T, 16 / sizeof(T), true>;
  static std::atomic<int> verdict[64] = {};  // per device: 0 unknown, 1 yes, 2 no (a race only repeats the work)
  int dev = 0;
  UCCL_CHECK_GPU(gpuGetDevice(&dev));
  UCCL_CHECK(dev >= 0 && dev < 64, "internode: device " << dev << " beyond the 64 the bulk-copy check tracks");
  if (const int v = verdict[dev].load(std::memory_order_acquire)) return v == 1;
  int major = 0, optin = 0;
  UCCL_CHECK_GPU(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  UCCL_CHECK_GPU(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  cudaFuncAttributes attr{};
  UCCL_CHECK_GPU(cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernel)));
  const bool ok = major >= 9 && int64_t(optin) - int64_t(attr.sharedSizeBytes) >= kBulkBytes;
  if (ok) UCCL_CHECK_GPU(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkBytes));
  verdict[dev].store(ok ? 1 : 2, std::memory_order_release);
  return ok;
#endif
}

// 16-byte vectors when every row the reduces touch is a 16-byte multiple at a 16-byte address (staged and
// crecv rows are; x, the output and the biases are the caller's), else one element at a time.
// With one rank per node on Hopper the forward streams its rows with bulk copies (forward_rows_bulk).
template <typename T>
void launch_combine_typed(const CombineArgs& a, int num_sms, gpuStream_t stream) {
  constexpr int kFull = 16 / sizeof(T);
  const bool full = a.hidden % kFull == 0 &&
                    ((reinterpret_cast<uintptr_t>(a.x) | reinterpret_cast<uintptr_t>(a.out) |
                      reinterpret_cast<uintptr_t>(a.bias0) | reinterpret_cast<uintptr_t>(a.bias1)) & 15u) == 0;
  if (!full) {
    combine_forward_kernel<T, 1, false><<<num_sms, kThreads, 0, stream>>>(a);
    check_launch("combine (forward)");
    combine_reduce_kernel<T, 1><<<num_sms, kThreads, 0, stream>>>(a);
    return;
  }
  if (a.c.L == 1 && a.hidden > 0 && bulk_copies<T>())  // (rows of no bytes: nothing for a bulk copy to move)
    combine_forward_kernel<T, kFull, true><<<num_sms, kThreads, kBulkBytes, stream>>>(a);
  else
    combine_forward_kernel<T, kFull, false><<<num_sms, kThreads, 0, stream>>>(a);
  check_launch("combine (forward)");
  combine_reduce_kernel<T, kFull><<<num_sms, kThreads, 0, stream>>>(a);
}

template <typename K>
void load(K kernel, const char* name) {
  gpuFuncAttributes attr;
  const gpuError_t e = gpuFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernel));
  UCCL_CHECK(e == gpuSuccess, "internode: loading kernel " << name << " failed: " << gpuGetErrorString(e));
}

template <typename T>
void load_combine(const char* type) {
  constexpr int kFull = 16 / sizeof(T);
  load(combine_forward_kernel<T, kFull, false>, type);
  load(combine_forward_kernel<T, kFull, true>, type);
  load(combine_forward_kernel<T, 1, false>, type);
  load(combine_reduce_kernel<T, kFull>, type);
  load(combine_reduce_kernel<T, 1>, type);
}

}  // namespace

void preload_kernels() {
  load(notify_kernel, "notify");
  load(counts_kernel, "counts");
  load(send_positions_kernel, "send_positions");
  load(dispatch_pack_kernel, "dispatch_pack");
  load(dispatch_forward_kernel, "dispatch_forward");
  load(dispatch_copy_out_kernel, "dispatch_copy_out");
  load(combine_stage_kernel, "combine_stage");
  load_combine<intranode::Bf16>("combine<bf16>");
  load_combine<intranode::Fp16>("combine<fp16>");
  load_combine<intranode::Fp32>("combine<fp32>");
}

void launch_notify(const NotifyArgs& a, gpuStream_t stream) {
  notify_kernel<<<1, kThreads, 0, stream>>>(a);
  check_launch("notify");
}

void launch_send_positions(const bool* in_rank, int num_tokens, int num_ranks, int ranks_per_node, int* send_pos,
                           int* node_head, gpuStream_t stream) {
  send_positions_kernel<<<num_ranks + num_ranks / ranks_per_node, kThreads, 0, stream>>>(
      in_rank, num_tokens, num_ranks, ranks_per_node, send_pos, node_head);
  check_launch("send positions");
}

void launch_counts(const CountsArgs& a, gpuStream_t stream) {
  counts_kernel<<<1, kThreads, 0, stream>>>(a);
  check_launch("counts");
}

void launch_dispatch(const DispatchArgs& a, int num_sms, gpuStream_t stream) {
  dispatch_pack_kernel<<<num_sms, kThreads, 0, stream>>>(a);
  check_launch("dispatch (pack)");
  dispatch_forward_kernel<<<num_sms, kThreads, 0, stream>>>(a);
  check_launch("dispatch (forward)");
  dispatch_copy_out_kernel<<<num_sms, kThreads, 0, stream>>>(a);
  check_launch("dispatch (copy-out)");
}

void launch_combine(const CombineArgs& a, int num_sms, gpuStream_t stream) {
  const int elem = a.dtype == 2 ? 4 : 2;
  combine_stage_kernel<<<num_sms, kThreads, 0, stream>>>(a, elem);
  check_launch("combine (stage)");
  switch (a.dtype) {
    case 0: launch_combine_typed<intranode::Bf16>(a, num_sms, stream); break;
    case 1: launch_combine_typed<intranode::Fp16>(a, num_sms, stream); break;
    default: launch_combine_typed<intranode::Fp32>(a, num_sms, stream); break;
  }
  check_launch("combine (reduce)");
}

}  // namespace uccl_ep::internode
