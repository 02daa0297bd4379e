// Host-side interface of the internode high-throughput path: an NVLink/xGMI aggregation stage inside each
// node, CPU-proxy RDMA between nodes (docs/internode.md).
//
// Plain C++ (no GPU headers), so the pybind11 bindings compile with the host compiler; the implementation
// lives in internode_buffer.cu (host) and internode.cu (kernels), built only when nvcc or hipcc is found.
// Pointers and streams cross this boundary as integers: the native module never sees torch.
//
// Topology: rank = node * L + local (L = ranks per node, 1..kMaxLocal, chosen at run time). Between nodes
// a rank only talks to the ranks with its local index (its "RDMA peers"), through proxy commands; inside a
// node it reads and writes its node peers' buffers through CUDA/HIP IPC.
//
// Memory of one rank:
//   RDMA region (GPU, registered with the proxies as region 0, the same size on every rank):
//     notify  [2 parities] this rank's outgoing count row, [2 parities][R] count rows (one per source rank)
//     send    dispatch rows this rank packs, one segment per destination node (the own node's segment,
//             kept so that send and crecv share row numbers, stays unused: those rows go straight to
//             their final ranks)
//     recv    dispatch rows landing from the RDMA peer of each other node (own node's segment unused)
//     csend   combine rows this rank reduced for each other node's RDMA peer
//     crecv   combine rows landing back, one segment per node (own node's written locally)
//   flag region (pinned host memory, mapped; region 1): arrival counters the proxies add to in order
//   NVL buffer (GPU, IPC-shared inside the node): barrier words, the dispatch receive rows node peers write
//     (rows a rank places itself skip it), the combine staging rows the node peers read.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "common/portability.h"
#include "kernels/intranode_api.h"  // kMaxExpertMajorTopk: one warp lane per top-k slot, as in one node
#include "proxy/ring.h"

namespace uccl_ep::internode {

struct Common;  // kernel arguments every launch shares (internode_launch.cuh)

constexpr int kMaxLocal = 8;        // ranks per node (one NVLink / xGMI domain)
constexpr int kMaxNodes = 32;       // nodes (each block keeps its per-node tables in shared memory)
constexpr int kMaxRanks = 256;      // a command's destination rank is one byte
// commands carry 32-bit offsets into the RDMA region; 64 MiB short of 4 GiB keeps the largest one page-aligned
constexpr int64_t kMaxRdmaBytes = (int64_t(1) << 32) - (int64_t(64) << 20);
constexpr int kMaxChunks = 1024;    // RDMA chunks per (source node, call): chunks grow to fit
constexpr int kMaxRings = 16;       // proxy threads (rings) a kernel can push into
constexpr int kHeaderInts = 8;      // count row header: tokens, x bytes, scale bytes, top-k, weights, experts, ...
constexpr int kMaxExperts = 2048;   // count rows have room for this many experts (the notify area never moves)
// An expert-major dispatch's id words: bits [0, 11) the expert (< kMaxExperts), bits [11, 31) its position + 1
// among the sender's tokens for that expert (0: no expert-major row, a repeated id); -1 stays -1.
constexpr int kEmIdBits = 11;
constexpr int kMaxEmPosition = (1 << (31 - kEmIdBits)) - 2;  // the most a position can be
using intranode::kMaxExpertMajorTopk;

// NVL buffer header (byte offsets; local words except bar, which node peers write).
constexpr int64_t kBarOffset = 0;            // uint64 [kMaxLocal]: latest barrier each node peer arrived at
constexpr int64_t kDoneOffset = 256;         // uint64: blocks of the running last-block kernel that finished
constexpr int64_t kClaimOffset = 512;        // int: the first error claims the report
// OpCounters (uint64 x 3): what every rank advances identically, on the GPU, so that graph replays and eager
// calls stay in step (the kernels read them at their start; nothing of them comes from the host)
constexpr int64_t kOpCountersOffset = 2048;
constexpr int64_t kChunkCountOffset = 4096;  // int [kMaxNodes * kMaxChunks]: rows done per chunk (per kernel)
// uint64 [2][kMaxNodes * kMaxChunks]: dispatch / combine chunk j from node n landed in op `value` (block 0's
// watcher mirrors the host flags here for the other blocks; op numbers only grow, so nothing is reset)
constexpr int64_t kArrivalMirrorOffset = kChunkCountOffset + int64_t(kMaxNodes) * kMaxChunks * 4;
constexpr int64_t kNvlHeaderBytes = kArrivalMirrorOffset + 2 * int64_t(kMaxNodes) * kMaxChunks * 8;

// This rank's op counters (kOpCountersOffset): ops and node barriers of the finished ops (an op's last kernel
// advances them: op `ops + 1` is the next; it arrives at barriers `barriers + 1` and `+ 2`), notifies issued
// (the notify kernel advances it: its parity picks the count rows' slots).
struct OpCounters {
  uint64_t ops, barriers, notifies;
};

// The row and layout arithmetic below is host code in every build (layouts.cpp), so that Python sizes buffers
// from it without GPU kernels.
// Bytes of one dispatch row: x | scales | top-k ids (int32) | weights (float32) | source token | source rank |
// the row's position among the tokens sent to each rank of the destination node (int32 x L); 16-aligned.
int64_t dispatch_row_bytes(int64_t x_bytes, int64_t scale_bytes, int num_topk, int ranks_per_node);
// Bytes of one combine row: y (x's dtype) | weights (float32 x num_topk); 16-aligned.
int64_t combine_row_bytes(int64_t y_bytes, int num_topk);
// Ints of one notify count row: header | per-rank counts | per-node counts | per-expert counts. Rows sit
// count_row_ints(R, kMaxExperts, L) ints apart (the stride), whatever the call's number of experts.
UCCL_HOST_DEVICE inline int64_t count_row_ints(int num_ranks, int num_experts, int ranks_per_node) {
  return kHeaderInts + num_ranks + num_ranks / ranks_per_node + num_experts;
}

UCCL_HOST_DEVICE inline int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// A rank's node segments from the global per-node counts rd[s * N + n]: send_row0[n] the first of its rows for
// node n, recv_row0[n] the first of the rows from node n's RDMA peer (N + 1 entries each).
UCCL_HOST_DEVICE inline void segment_rows(const int* rd, int num_ranks, int ranks_per_node, int rank,
                                          int64_t* send_row0, int64_t* recv_row0) {
  const int N = num_ranks / ranks_per_node, node = rank / ranks_per_node, local = rank % ranks_per_node;
  send_row0[0] = recv_row0[0] = 0;
  for (int n = 0; n < N; ++n) {
    send_row0[n + 1] = send_row0[n] + rd[int64_t(rank) * N + n];
    recv_row0[n + 1] = recv_row0[n] + rd[int64_t(n * ranks_per_node + local) * N + node];
  }
}

// One rank's RDMA areas (byte offsets) for a call in which it sends send_rows rows (its segments for every
// node) and receives recv_rows rows from its RDMA peers: the one home of the region's arrangement, used by the
// host (make_layout: sizing) and by the kernels (their per-call tables, from the counts on the device).
// notify: 2 parities x this rank's outgoing count row, then 2 parities x R incoming rows; it never overlaps
// what the ops write (peers send count rows before any READY).
struct Areas {
  int64_t notify_off, send_off, recv_off, csend_off, crecv_off, rdma_bytes;
};
// Count rows in the notify area. Why two outgoing rows: a notify's row may still be on its way to a peer that
// exchanges nothing else with this rank (no READY between them: a different local rank of another node) when
// the next notify comes, and a copy out of it can run late (libfabric shm copies at the target, on the
// target's GPU queue). The notify after next may rewrite it: by then this rank's counts of the next notify
// saw every peer's row of it, which each peer sent after its own counts of this notify saw this row landed.
constexpr int kNotifyParities = 2;
UCCL_HOST_DEVICE inline int64_t notify_rows(int num_ranks) { return kNotifyParities * (1 + int64_t(num_ranks)); }

// The count rows of notify `parity` (the notifies counter's parity before it) in the notify area: the byte
// offsets of this rank's outgoing row and of the receive slots [R].
UCCL_HOST_DEVICE inline int64_t count_out_off(int64_t stride_ints, uint64_t parity) {
  return 4 * stride_ints * int64_t(parity % kNotifyParities);
}
UCCL_HOST_DEVICE inline int64_t count_slots_off(int64_t stride_ints, int num_ranks, uint64_t parity) {
  return 4 * stride_ints * (kNotifyParities + int64_t(parity % kNotifyParities) * num_ranks);
}

UCCL_HOST_DEVICE inline Areas areas_of(int64_t count_stride_bytes, int num_ranks, int64_t send_rows,
                                       int64_t recv_rows, int64_t row_bytes, int64_t crow_bytes) {
  Areas a;
  a.notify_off = 0;
  a.send_off = align_up(count_stride_bytes * notify_rows(num_ranks), 256);
  a.recv_off = align_up(a.send_off + send_rows * row_bytes, 256);
  a.csend_off = align_up(a.recv_off + recv_rows * row_bytes, 256);
  a.crecv_off = align_up(a.csend_off + recv_rows * crow_bytes, 256);
  a.rdma_bytes = align_up(a.crecv_off + send_rows * crow_bytes, 256);
  return a;
}

// Where everything of one rank lives for one call (byte offsets; "row0" arrays are row indices of each
// node's segment). Computed from the global per-node send counts rd[s * N + n] (tokens rank s sends to
// node n) that notify gives every rank, so a sender computes its receivers' offsets the same way.
struct Layout : Areas {
  int num_nodes = 0;
  int64_t row_bytes = 0, crow_bytes = 0, count_stride = 0;  // count_stride: bytes between count rows
  int64_t send_row0[kMaxNodes + 1] = {};  // this rank's tokens for node n (segment n of send and crecv)
  int64_t recv_row0[kMaxNodes + 1] = {};  // rows from node n's RDMA peer (segments of recv, csend; forwarded rows)
  int64_t nvl_bytes = 0;  // NVL buffer this rank needs: header + two halves of num_recv_rows rows
};
Layout make_layout(const std::vector<int>& rd, int num_ranks, int ranks_per_node, int rank, int64_t row_bytes,
                   int64_t crow_bytes, int64_t num_recv_rows);

// A dispatch's call info (device int32, written by the counts kernel from every rank's count row once notify
// delivered them, kept by the handle for the cached dispatch and the combine): everything the kernels derive
// their per-call tables from, and the handle items, without a host copy of the counts.
//   rd [R * N]        tokens rank s sends to node n
//   row_base [R, L]   first receive row of source s on local rank j of this node
//   counts [R, R]     tokens rank s sends to rank r
//   num_recv          rows this rank receives
//   from_nodes [N]    rows it receives from node n's RDMA peer (the rows it forwards); from_ends [N] their
//                     inclusive prefix
//   recv_starts [R], recv_ends [R]  where the rows from source s start / end in its receive order
//   valid             1 once the checks passed: a refused call's kernels take none of the caller's rows
// (from_nodes, from_ends, recv_starts, recv_ends and this rank's row of counts are DeepEP's handle items.)
struct InfoOffsets {
  int64_t rd, row_base, counts, num_recv, from_nodes, from_ends, recv_starts, recv_ends, valid, ints;
};
UCCL_HOST_DEVICE inline InfoOffsets info_offsets(int num_ranks, int ranks_per_node) {
  const int64_t R = num_ranks, N = num_ranks / ranks_per_node;
  InfoOffsets o;
  o.rd = 0;
  o.row_base = o.rd + R * N;
  o.counts = o.row_base + R * ranks_per_node;
  o.num_recv = o.counts + R * R;
  o.from_nodes = o.num_recv + 1;
  o.from_ends = o.from_nodes + N;
  o.recv_starts = o.from_ends + N;
  o.recv_ends = o.recv_starts + R;
  o.valid = o.recv_ends + R;
  o.ints = o.valid + 1;
  return o;
}

// What the counts kernel checks, for every rank alike (each reads every rank's count row, so every rank
// reaches the same verdict and either all move rows or none does): the shape headers agree, no rank receives
// more than num_worst_tokens (0: unbounded), no source sends more than expert_capacity tokens to one expert
// (0: no capacity), no source sends a node more than max_node_rows tokens (0: unchecked). The host sizes the
// buffers from the counts (a synced dispatch) or from max_node_rows (sizing.internode_worst_counts), which the
// other checks imply for counts that agree with each other: the last one refuses counts that do not (a
// num_tokens_per_rdma_rank that disagrees with num_tokens_per_rank) before they could write past a region.
struct CountChecks {
  int64_t num_worst_tokens = 0;
  int expert_capacity = 0;
  int64_t max_node_rows = 0;
};

class InternodeBuffer {
 public:
  // Allocates the NVL buffer (nvl_bytes, IPC-shareable), the RDMA region (rdma_bytes) and the flag region.
  InternodeBuffer(int device, int rank, int num_ranks, int ranks_per_node, int64_t nvl_bytes, int64_t rdma_bytes,
                  double timeout_s);
  ~InternodeBuffer();
  InternodeBuffer(const InternodeBuffer&) = delete;
  InternodeBuffer& operator=(const InternodeBuffer&) = delete;

  std::string ipc_handle() const;
  // The NVL buffers' IPC handles of this node's ranks, in local order (own included).
  void open_peers(const std::vector<std::string>& handles);
  // Replaces the RDMA region by one of `bytes` (the proxies must be rebuilt over it: collective).
  void resize_rdma(int64_t bytes);
  void destroy();

  int64_t rdma_ptr() const { return reinterpret_cast<int64_t>(rdma_); }
  int64_t rdma_bytes() const { return rdma_bytes_; }
  int64_t flag_ptr() const { return reinterpret_cast<int64_t>(flags_host_); }
  int64_t flag_bytes() const;
  int64_t nvl_bytes() const { return nvl_bytes_; }
  // The two halves of the NVL buffer after the header: receive rows, combine staging rows. The same offsets
  // on every rank (every rank's buffer has the same size: growth is collective).
  int64_t nvl_recv_off() const;
  int64_t nvl_stage_off() const;

  // The proxy rings kernels push into: device descriptors (slots, claim, tail_cache, tail, flushed, echo,
  // capacity, publish: 0 fence / 1 vector), one per proxy thread; channel c goes through ring c % count.
  // failure_record / failure_record_host: the proxies' failure record as the GPU and the host see it
  // (Proxy::failure_record), which every wait polls: the kernels' and the host's count wait (wait_counts).
  void set_rings(const std::vector<std::vector<int64_t>>& rings, int64_t failure_record, int64_t failure_record_host);

  std::string error() const;
  // Host-side abort of call `op` (kernels/abort.h): every rank of the node (this one too) stops waiting and
  // raises this rank's aborted record; ranks on other nodes learn nothing from it (they time out).
  // abort_source: (rank, op) of an aborted record held here, else (-1, "").
  void abort(const std::string& op);
  std::pair<int, std::string> abort_source() const;

  // get_dispatch_layout over all ranks (outputs zeroed int32 [R], int32 [N], int32 [E], bool [T, R]): the
  // intranode layout kernel, which also counts the tokens per node and records the first expert id outside
  // [-1, num_experts) here (error()); the fresh dispatch's wait_counts raises it, or the next call.
  void dispatch_layout(int64_t topk_idx, int num_tokens, int num_topk, int num_experts, int64_t out_per_rank,
                       int64_t out_per_node, int64_t out_per_expert, int64_t out_in_rank, int64_t stream);

  // Fresh dispatch, step 1: this rank's count row (header, per-rank / per-node / per-expert counts, device
  // int32 tensors) into every rank's notify slot through the proxies. Then wait_counts (host): waits for
  // every rank's row (deadline), copies the R rows to host_out (int32 [R, row stride], see count_row_ints).
  void notify(const std::vector<int>& header, int64_t per_rank, int64_t per_node, int64_t per_expert,
              int num_experts, int64_t stream);
  void wait_counts(int64_t host_out);

  // A fresh dispatch's per-token positions from is_token_in_rank (device bool [T, R]): send_pos (int32 [T, R],
  // token t's row among this rank's tokens for rank r, -1) and node_head (int32 [T, N], the same per node: a
  // token goes to a node when it goes to any of its ranks), DeepEP's send_head / send_rdma_head. One launch.
  void send_positions(int64_t in_rank, int num_tokens, int64_t send_pos, int64_t node_head, int64_t stream);

  // Fresh dispatch, step 2 (on the caller's stream, after notify): the counts kernel waits on the GPU for every
  // rank's count row, checks them (CountChecks: the same verdict on every rank; a violation is recorded as
  // this rank's error, the info is zeroed so that no rows move, and the host raises it at its next check) and
  // writes the call info (device int32 [InfoOffsets::ints]) the dispatch, its cached dispatches and its
  // combines take. No host sync: a dispatch with num_worst_tokens needs no host copy of the counts.
  void counts(const CountChecks& checks, int64_t info, int64_t stream);

  // Dispatch after notify + counts (or cached): packs and sends rows to other nodes (RDMA), forwards rows over
  // NVLink to their final ranks, copies the landed rows out. info: the dispatch's call info (counts); every
  // kernel derives its tables from it on the GPU. send_pos: device int32 [T, R] (row of token t among rows
  // sent to r, -1); node_head: device int32 [T, N] (row of t among tokens sent to node n, -1). Outputs (0 to
  // skip), out_rows rows (the received rows, then padding up to num_worst_tokens): recv_x [out_rows, x_bytes],
  // recv_scales, recv_topk_idx (int64 local ids, -1), recv_topk_w (float32, 0 where -1), recv_src_meta
  // ([out_rows, 2] int32: source token, source rank), fwd_head (int32 [forwarded rows, L]).
  // Expert-major landing (em_x != 0, a fresh dispatch of every rank alike, num_topk <= kMaxExpertMajorTopk):
  // topk_pos (device int32 [T, K]: the slot's row among this rank's tokens for its expert, -1 for none)
  // travels in the rows' id words (em_word), and every received row is also stored at em_x row
  // em_base[source * experts_per_rank + local expert] + position (em_base: device int32 [R, experts per
  // rank]), em_map [out_rows, K] int32 naming that row (-1: no row), em_rows rows in all.
  void dispatch(int64_t info, int num_tokens, int64_t x, int64_t x_bytes, int64_t scales, int64_t scale_bytes,
                int64_t topk_idx, int64_t topk_w, int num_topk, int num_experts, int64_t send_pos, int64_t node_head,
                int64_t out_rows, int64_t recv_x, int64_t recv_scales, int64_t recv_topk_idx, int64_t recv_topk_w,
                int64_t recv_src_meta, int64_t fwd_head, int64_t topk_pos, int64_t em_base, int64_t em_x,
                int64_t em_map, int64_t em_rows, int num_sms, int chunk_rows, int64_t stream);

  // Combine: x [rows received, hidden] (dtype 0 bf16, 1 fp16, 2 fp32; at least the received rows, e.g. a
  // dispatch's padded outputs) in dispatch's receive order is staged, each forwarded row is reduced over the
  // node's ranks (float32, local order) and sent back to its source node's RDMA peer (one write per chunk),
  // and each token sums its nodes' rows (float32, node order) + bias0 + bias1. info / fwd_head / node_head
  // from the dispatch. out [num_tokens, hidden], out_w [num_tokens, K].
  void combine(int64_t info, int num_tokens, int64_t x, int dtype, int hidden, int64_t topk_w, int num_topk,
               int64_t x_rows, int64_t node_head, int64_t fwd_head, int64_t bias0, int64_t bias1, int64_t out,
               int64_t out_w, int num_sms, int chunk_rows, int64_t stream);

  int rank() const { return rank_; }

 private:
  void check_ready(const char* what) const;
  Common common() const;
  void alloc_rdma(int64_t bytes);
  std::string adopt_proxy_failure();
  const volatile ErrorRecord* record() const;
  std::vector<int*> node_claims() const;  // the node ranks' claim words as mapped here (report_error, abort)
  int device_ = 0, rank_ = 0, num_ranks_ = 1, local_ = 0, node_ = 0, ranks_per_node_ = 1, num_nodes_ = 1;
  int num_device_sms_ = 0;
  int64_t nvl_bytes_ = 0, rdma_bytes_ = 0;
  void* nvl_ = nullptr;                 // this rank's NVL buffer
  void* peers_[kMaxLocal] = {};         // node peers' NVL buffers as mapped here (own included)
  bool opened_ = false;
  void* rdma_ = nullptr;                // RDMA region (region 0)
  void* flags_host_ = nullptr;          // flag region (region 1), pinned + mapped
  void* flags_dev_ = nullptr;
  void* err_host_ = nullptr;            // error record, pinned + mapped
  void* err_dev_ = nullptr;
  const void* proxy_fail_host_ = nullptr;  // the proxies' failure record (set_rings), polled by wait_counts
  ErrorRecord adopted_{};                  // a copy of it once wait_counts adopted it (adopt_proxy_failure)
  void* notified_ = nullptr;            // event after the last notify kernel
  void* copy_stream_ = nullptr;         // the count rows' copy to the host (off the caller's stream)
  std::vector<uccl::RingDesc> rings_;
  int64_t timeout_cycles_ = 0;
  double timeout_s_ = 0;
  bool notify_issued_ = false;  // a notify was launched (counts / wait_counts need one before them)
  int num_experts_ = 0;         // the last notify's (its count rows' per-expert counts)
};

}  // namespace uccl_ep::internode
