// Low-latency (LL) dispatch / combine: host API of csrc/kernels/low_latency{,_buffer}.cu.
//
// Every token goes straight to each rank its experts live on, once per rank (no per-node aggregation): node
// peers are written over NVLink/xGMI (CUDA/HIP IPC), ranks of other nodes through the CPU proxies (per
// destination rank and call: a dispatch writes the counts header, then the messages, each followed by an
// ordered atomic; a combine one write and one atomic). Sizes are fixed by (max tokens, hidden, ranks, experts),
// so there is no host synchronisation and the calls replay exactly in a CUDA graph: every
// signal is a counter that only grows, and the value a receiver waits for lives in device memory and
// advances with each call (never in the captured arguments). docs/low_latency.md has the design.
//
// The layout of both regions is computed in one place, Python's `low_latency_layout`
// (uccl_ep_train/backends/low_latency.py), and handed over per call as `Layout`.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/portability.h"
#include "proxy/ring.h"

namespace uccl_ep::low_latency {

struct Args;  // kernel arguments (low_latency_launch.cuh)

constexpr int kMaxLocal = 8;       // node peers reached over NVLink/xGMI
constexpr int kMaxRanks = 256;     // a proxy command's destination is one byte
constexpr int kMaxExperts = 1024;  // counts and offsets of every (rank, local expert) pair sit in shared memory
constexpr int kMaxTopk = 32;       // a combine block holds tokens x min(top-k, local experts) rows
constexpr int kMaxRings = 16;
constexpr int kSendPhase = 1, kRecvPhase = 2;  // a call's phases (one launch, or the send now, the receive in the hook)
constexpr int kMsgHeaderBytes = 16;  // a dispatch message: {source token, -, -, -} then x (and FP8 scales)

// Offsets (bytes) of one call's half in the rank's region, which holds everything: error words and counters
// (fixed places), the signals node peers raise, the areas the proxies read and write (first, so that their
// offsets fit a command's 32 bits), then the zero-copy combine input only this rank touches. The host flag
// offsets count uint64 words. Mirrors `LowLatencyLayout.kernel_args()` in Python, field for field.
// A dispatch block (source -> destination) is: counts header [L] int32 (hdr_bytes), the message index of
// each row (int32, rows in (local expert, source token) order; idx_bytes), then the messages, one per token
// that has any expert on the destination (a token crosses a link once per rank, not once per expert; the
// receiver expands it into its experts' rows while unpacking). A combine block holds one BF16 row per row.
struct Layout {
  int64_t msg_bytes, block_bytes, cblock_bytes, hdr_bytes, idx_bytes;  // a message, a dispatch / combine
                                                                       // block, its counts and row index
  int64_t d_send, d_recv, c_send, c_recv;                              // this half's areas, R blocks each
  int64_t gpu_dsig, gpu_csig;    // this half's signals raised by node peers: uint64 [R]
  int64_t host_dsig, host_csig;  // the same raised by the proxies, in the host flag region
  int64_t c_zero;                // zero-copy combine input [L][R*M][H]
  int64_t counters;              // the counters the kernels keep (low_latency_launch.cuh)
};
constexpr int kLayoutFields = 15;

// The buffer of one rank: its region (GPU, IPC-exported, registered with the proxies), host flag region
// (pinned, GPU-mapped), error record; launchers of the two kernels (dispatch, combine).
class LowLatencyBuffer {
 public:
  LowLatencyBuffer(int device, int rank, int num_ranks, int ranks_per_node, int64_t bytes, int64_t flag_words,
                   int num_blocks, double timeout_s);
  ~LowLatencyBuffer();
  LowLatencyBuffer(const LowLatencyBuffer&) = delete;
  LowLatencyBuffer& operator=(const LowLatencyBuffer&) = delete;

  std::string ipc_handle() const;
  void open_peers(const std::vector<std::string>& handles);  // the node's ranks by local index (own ignored)
  // failure_record: the proxies' failure record as the GPU sees it (Proxy::failure_record), which every wait polls
  // (kept across clean()).
  void set_rings(const std::vector<std::vector<int64_t>>& rings, int64_t failure_record);
  void destroy();
  void clean();  // zero every signal, counter and area (the caller makes it collective)
  std::string error() const;
  // Host-side abort of call `op` (kernels/abort.h): every rank of the node (this one too) stops waiting and
  // raises this rank's aborted record; ranks on other nodes learn nothing from it (they time out).
  // abort_source: (rank, op) of an aborted record held here, else (-1, "").
  void abort(const std::string& op);
  std::pair<int, std::string> abort_source() const;

  int64_t ptr() const { return reinterpret_cast<int64_t>(buf_); }
  int64_t bytes() const { return bytes_; }
  int64_t flag_ptr() const { return reinterpret_cast<int64_t>(flags_host_); }
  int64_t flag_bytes() const { return 8 * flag_words_; }
  int num_blocks() const { return num_blocks_; }
  static int64_t error_words_bytes();  // the region's first bytes: claim word and error words
  static int64_t counter_bytes();      // the counters' bytes at Layout::counters

  // A dispatch: the send phase sends every rank its counts header, writes each token (BF16 or FP8-cast) once
  // to each rank of its experts and signals every rank; pair_pos [T, K] int32 (out) gets where each (token,
  // top-k slot) landed in its destination block (-1: nowhere). The receive phase waits for every rank and
  // unpacks into DeepEP's packed per-expert layout. `phases`: kSendPhase | kRecvPhase, one launch.
  void dispatch(const std::vector<int64_t>& layout, int64_t x, int64_t topk_idx, int num_tokens, int num_topk,
                int num_experts, int max_tokens, int hidden, bool use_fp8, bool round_scale, bool use_ue8m0,
                bool fnuz, int half, int64_t pair_pos, int64_t recv_x, int64_t recv_scales, int64_t src_info,
                int64_t layout_range, int64_t recv_count, int64_t stats, int phases, int64_t stream);
  // A combine: the send phase returns every expert output row to its source; the receive phase waits for every
  // rank and writes out = the weighted sum over each token's top-k rows.
  void combine(const std::vector<int64_t>& layout, int64_t x, int64_t layout_range, int64_t topk_idx,
               int64_t topk_weights, int64_t pair_pos, int num_tokens, int num_topk, int num_experts, int max_tokens,
               int hidden, int half, int64_t out, int phases, int64_t stream);

 private:
  void check_ready(const char* what) const;
  Args make_args(const std::vector<int64_t>& layout, int num_experts, int half, int phases, const char* what) const;

  int device_, rank_, num_ranks_, ranks_per_node_, num_blocks_;
  int64_t bytes_, flag_words_;
  double timeout_s_;
  int64_t timeout_cycles_ = 0;
  void* buf_ = nullptr;
  void* flags_host_ = nullptr;
  void* flags_dev_ = nullptr;
  void* err_host_ = nullptr;
  void* err_dev_ = nullptr;
  void* peers_[kMaxLocal] = {};
  int64_t failure_record_ = 0;  // set_rings'
  int* claim_ptr() const;       // the claim word (and the error words after it) in buf_
  std::vector<int*> node_claims() const;  // the node ranks' claim words as mapped here (report_error, abort)
  bool opened_ = false;
  std::vector<uccl::RingDesc> rings_;
};

}  // namespace uccl_ep::low_latency
