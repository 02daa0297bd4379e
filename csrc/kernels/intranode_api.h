// Host-side interface of the intranode (NVLink / xGMI) high-throughput path.
//
// Plain C++ (no GPU headers), so the pybind11 bindings compile with the host compiler; the implementation
// lives in intranode_buffer.cu / layout.cu / intranode.cu and is built only when nvcc or hipcc is found, except
// the buffer's layout (the header below, make_row_layout: layouts.cpp), which every build has.
// Every pointer and stream crosses this boundary as an integer: the native module never sees torch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace uccl_ep::intranode {

constexpr int kMaxRanks = 8;  // ranks of one NVLink / xGMI domain
constexpr int kShapeInts = 8;  // a notify's shape header: the last ints of every counts slot (the host checks them)
// What the shape header's ints are (the host fills them in this order; the ranks must agree on all but the
// first). The top-k format is 1 when topk_weights are given, plus 2 when the top-k id words carry expert-major
// positions (a fresh expert-major dispatch that expands inside the kernel: its receivers must expect them).
// The last is the expert-major dispatch's expert_capacity (0: none), which notify also reads: with it, every
// (local expert, source rank) block of the expert-major rows has exactly that many rows.
constexpr const char* kShapeFields[kShapeInts] = {"num_tokens", "x row bytes", "FP8 scale bytes", "num_topk",
                                                   "top-k format (+1 weights, +2 expert-major ids)", "num_experts",
                                                   "x dtype", "expert_capacity"};
constexpr int kShapeExpertCapacity = kShapeInts - 1;
constexpr int kMaxExpertMajorTopk = 32;  // top-k slots per row in expert-major dispatch / fold combine (one warp)

// Header of every rank's IPC buffer (byte offsets). Signals are monotonically increasing counters:
//   arrive[s]  in the receiver's buffer: blocks of rank s that finished pushing into it
//   free_[r]   in the sender's buffer:   blocks of rank r that finished reading their own buffer
constexpr int64_t kArriveOffset = 0;
constexpr int64_t kFreeOffset = 256;
constexpr int64_t kErrorClaimOffset = 1024;  // int: the first error of a kernel claims the report
constexpr int64_t kSideWorkOffset = 2048;  // SideWork's counters (local use only): device_utils.cuh
constexpr int64_t kOpSeqOffset = 3072;     // OpSeq: the signal base of the next op (local use only)
// int[kMaxRanks][kShapeInts]: slot s is the shape of rank s's current dispatch / combine rows (see
// publish_shape), so that the calls without a notify (cached dispatch, combine) still check that the ranks agree
constexpr int64_t kShapeSlotsOffset = 3584;
constexpr int64_t kCountsOffset = 4096;
static_assert(kShapeSlotsOffset + kMaxRanks * kShapeInts * 4 <= kCountsOffset, "shape slots overlap the counts");
constexpr int64_t kCountsSlotInts = 32768;               // per source rank: R per-rank counts + local experts
constexpr int64_t kFlagsOffset = kCountsOffset + 8 * kCountsSlotInts * 4;
constexpr int64_t kMaxFlagRows = 1 << 20;                 // one uint32 "row landed" flag per receive row
// combine with fold blocks: one uint32 "row folded" flag per row this rank sends back (local use only)
constexpr int64_t kFoldReadyOffset = kFlagsOffset + kMaxFlagRows * 4;
constexpr int64_t kHeaderBytes = kFoldReadyOffset + kMaxFlagRows * 4;  // 9 MiB + 4 KiB

// Byte offsets of the per-row arrays inside the data region of a rank's buffer, for one call.
struct RowLayout {
  int64_t cap_rows = 0;  // rows that fit
  int64_t off_x = 0, off_scales = 0, off_topk_idx = 0, off_topk_w = 0, off_src = 0;
};

// Computes the layout of `rows` of (x_bytes, scale_bytes, topk*8, topk*4, 4) in `data_bytes` (layouts.cpp: host
// arithmetic, in every build, so that Python sizes buffers from it without GPU kernels).
RowLayout make_row_layout(int64_t data_bytes, int64_t x_bytes, int64_t scale_bytes, int num_topk,
                          bool with_src);

// get_dispatch_layout for `num_ranks` ranks (any number: the internode backend uses it too): outputs must
// be zeroed int32 [R], int32 [R / ranks_per_node] (0: not counted), int32 [E], and bool [T, R]; enqueued on
// `stream` of the current device.
void dispatch_layout(int64_t topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                     int ranks_per_node, int64_t out_per_rank, int64_t out_per_node, int64_t out_per_expert,
                     int64_t out_in_rank, int64_t stream);

class IntranodeBuffer {
 public:
  // Allocates `num_bytes` of device memory on `device` (header + data), zeroed, shareable by IPC.
  IntranodeBuffer(int device, int rank, int num_ranks, int64_t num_bytes, double timeout_s);
  ~IntranodeBuffer();
  IntranodeBuffer(const IntranodeBuffer&) = delete;
  IntranodeBuffer& operator=(const IntranodeBuffer&) = delete;

  std::string ipc_handle() const;                         // this rank's handle, as bytes
  void open_peers(const std::vector<std::string>& handles);  // every rank's handle, in rank order
  void destroy();                                          // closes peer mappings, frees everything
  bool is_open() const { return opened_; }

  int64_t header_bytes() const;
  int64_t data_bytes() const;
  int64_t local_ptr() const { return reinterpret_cast<int64_t>(base_); }

  // Device-side error record (timeouts, capacity): "" when none.
  std::string error() const;
  void clear_error();
  // Host-side abort of call `op` (kernels/abort.h): every rank of the node (this one too) stops waiting and
  // raises this rank's aborted record. abort_source: (rank, op) of an aborted record held here, else (-1, "").
  void abort(const std::string& op);
  std::pair<int, std::string> abort_source() const;

  // get_dispatch_layout: outputs must be zeroed int32 [R], int32 [E], and bool [N, R].
  void dispatch_layout(int64_t topk_idx, int num_tokens, int num_topk, int num_experts, int64_t out_per_rank,
                       int64_t out_per_expert, int64_t out_in_rank, int64_t stream);

  // Counts exchange. Writes send_pos [N, R] int32 (row of token t among rows sent to r, -1 if none) and
  // info int32 [R*R + epr + R*epr + 2R] (epr = experts per rank): the rank prefix matrix, this rank's
  // per-local-expert counts, the expert-major base row of each (source rank, local expert) block
  // (experts in order, within an expert source ranks in order: the order the alltoall dispatcher uses),
  // then the handle's one-channel matrices: rows sent to each rank, first row of each source rank here,
  // then every rank's `shape` (INTRANODE_SHAPE_INTS each, what the host passed: it checks that they agree).
  void notify(int64_t num_tokens_per_rank, int64_t num_tokens_per_expert, int64_t is_token_in_rank,
              int num_tokens, int num_experts, int64_t out_send_pos, int64_t out_info, int num_worst_tokens,
              const std::vector<int>& shape, int64_t stream);

  // Push dispatch. flags: kWithTopk (topk_idx given: recv ids/weights written), kWithWeights,
  // kWithSrc (fresh dispatch: recv_src_idx written). Cached dispatch passes 0. Scales when scale_bytes > 0.
  // Expert-major mode (em_x != 0): rows go to em_x [em_rows, x_bytes] instead of recv_x; a fresh dispatch
  // takes topk_pos [N, num_topk] int32 and em_base (notify's info + R*R + epr) and writes em_map
  // [out_rows, num_topk]; a cached one reads em_map [out_rows, em_k]. expand_blocks more blocks beside the
  // num_sms write the expert-major rows while those push (0: the push / copy-out warps write them); the
  // num_sms blocks write the rows nobody has taken, so the call completes whether or not those blocks run.
  static constexpr int kWithTopk = 1, kWithWeights = 2, kWithSrc = 4;
  void dispatch(int64_t x, int64_t x_bytes, int64_t scales, int64_t scale_bytes, int64_t topk_idx,
                int64_t topk_weights, int flags, int num_topk, int experts_per_rank, int num_tokens, int64_t send_pos,
                int64_t rank_prefix, int64_t recv_x, int64_t recv_scales, int64_t recv_topk_idx,
                int64_t recv_topk_weights, int64_t recv_src_idx, int64_t out_rows, int64_t em_x, int64_t em_map,
                int64_t topk_pos, int64_t em_base, int em_k, int64_t em_rows, int expand_blocks, int num_sms,
                int push_warps, int flag_batch, int64_t stream);

  // Push combine: rows (dtype 0 bf16, 1 fp16, 2 fp32) back to their sources, summed in float32 in rank
  // order, then + bias_0 + bias_1 (same dtype as x), rounded once. Fold mode (fold_map != 0): x is
  // expert-major [fold_rows, hidden] and each received row is first folded from x's rows fold_map[i][:]
  // (float32 sum in slot order, rounded once: exactly permute.reduce_rows), own rows included. With
  // fold_out (fold mode; [rows of the fold map, hidden], at most 2^20 rows) fold_blocks more blocks
  // beside the num_sms form the rows there while the num_sms blocks push them (and form the rows they
  // need that nobody has taken, so the call completes whether or not those blocks run); else the push
  // warps fold.
  // variant: 1 reduce through registers, 2 staged through shared memory, 0 the default for the mode.
  void combine(int64_t x, int dtype, int hidden, int64_t topk_weights, bool with_weights, int num_topk, int num_tokens, int64_t send_pos,
               int64_t rank_prefix, int64_t bias0, int64_t bias1, int64_t out, int64_t out_topk_weights,
               int64_t fold_map, int fold_k, int64_t fold_rows, int64_t fold_out, int64_t fold_out_rows,
               int fold_blocks, int num_sms, int push_warps, int flag_batch, int variant, int64_t stream);

  // Warps per block of the dispatch / combine kernels (push_warps may be 1..this).
  static int warps_per_block();

  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }

 private:
  void check_open(const char* what) const;
  int* claim_ptr() const;
  std::vector<int*> node_claims() const;  // every rank's claim word as mapped here (report_error, abort)
  int device_ = 0, rank_ = 0, num_ranks_ = 1;
  int64_t num_bytes_ = 0;
  void* base_ = nullptr;            // this rank's device buffer
  void* peers_[kMaxRanks] = {};     // every rank's buffer as mapped here (own included)
  bool opened_ = false;
  void* err_host_ = nullptr;        // pinned, mapped error record
  void* err_dev_ = nullptr;
  int64_t timeout_cycles_ = 0;
  double timeout_s_ = 0;            // UCCL_EP_TIMEOUT_S as given (named in the error sentences)
  int num_device_sms_ = 0;
};

}  // namespace uccl_ep::intranode
