// Kernel argument structs and launchers of the intranode path (internal to csrc/kernels).
#pragma once

#include <cstdint>

#include "common/portability.h"
#include "kernels/device_utils.cuh"
#include "kernels/intranode_api.h"

namespace uccl_ep::intranode {

constexpr int kDispatchThreads = 512;
constexpr int kCombineThreads = 512;
constexpr int kNotifyThreads = 1024;
constexpr int kLayoutThreads = 256;

struct PeerPtrs {
  char* p[kMaxRanks];  // every rank's buffer base as mapped on this GPU (own included)
};

// What a kernel's waits need (the signal base is not here but in the buffer: OpSeq).
struct SignalArgs {
  int64_t timeout_cycles;  // per wait
  ErrorRecord* err;        // pinned host memory, mapped
  int* claim;              // in this rank's device buffer (kErrorClaimOffset)
};

struct NotifyArgs {
  PeerPtrs peers;
  int rank, num_ranks, num_tokens, num_experts, num_worst_tokens;
  int shape[kShapeInts];  // pushed with the counts; every rank's lands in info after the handle matrices
  const int* per_rank;
  const int* per_expert;
  const bool* in_rank;
  int* send_pos;
  int* info;
  SignalArgs sig;
};

struct DispatchArgs {
  PeerPtrs peers;
  int rank, num_ranks, num_tokens, num_topk, experts_per_rank;
  const char* x;
  int64_t x_bytes;
  const char* scales;
  int64_t scale_bytes;
  const int64_t* topk_idx;
  const float* topk_w;
  const int* send_pos;
  const int* rank_prefix;
  char* recv_x;
  char* recv_scales;
  int64_t* recv_idx;
  float* recv_w;
  int* recv_src;
  int64_t out_rows;
  int push_warps;     // warps per block that push; the rest copy landed rows out from the start
  int flag_batch;     // tokens a push warp sends between two system fences (then releases their flags)
  bool with_topk;     // fresh dispatch with topk_idx: recv_idx / recv_w are written (w = 0 without weights)
  bool with_weights;  // topk_weights given
  bool with_src;      // fresh dispatch: recv_src is written
  // Expert-major mode (em_x != null): rows land at their expert-major rows of em_x [em_rows, x_bytes]
  // (one copy per local expert of the row) instead of recv_x. Fresh dispatch: the sender's topk_pos[t][k]
  // (row of token t among this rank's tokens for expert topk_idx[t][k]) travels in the upper half of the
  // id word, the receiver puts the row at em_base[source * experts_per_rank + local expert] + pos and
  // writes em_map [out_rows, em_k] (em_k = num_topk). Cached dispatch: em_map is read.
  char* em_x;
  int* em_map;
  const int* topk_pos;
  const int* em_base;
  int em_k;
  int64_t em_rows;
  // Expand blocks (expert-major mode): the grid's last expand_blocks blocks write the expert-major rows
  // (own tokens from x, landed rows from the buffer) while the others push and copy out the metadata; any
  // warp takes the rows no other has claimed (SideWork), and the buffer is released once all are written.
  int expand_blocks;
  int shape[kShapeInts];  // this call's rows (kShapeFields): published to the peers, compared by them
  RowLayout lay;
  SignalArgs sig;
};

enum CombineDtype : int { kDtypeBf16 = 0, kDtypeFp16 = 1, kDtypeFp32 = 2 };

struct CombineArgs {
  PeerPtrs peers;
  int rank, num_ranks, num_tokens, hidden, num_topk, dtype;
  const void* x;  // [rows, hidden] of dtype
  const float* topk_w;
  const int* send_pos;
  const int* rank_prefix;
  const void* bias0;  // [num_tokens, hidden] of dtype, or null
  const void* bias1;
  void* out;
  float* out_w;
  bool with_weights;  // topk_weights given: rows carry weights and out_w is written
  int push_warps;     // warps per block that push; the rest reduce from the start
  int flag_batch;     // rows a push warp sends between two system fences (then releases their flags)
  int variant;        // Config.combine_kernel: 1 = register reduce (default), 2 = staged reduce
  // Fold mode (fold_map != null): x holds expert-major rows [fold_rows, hidden]; received row i is the sum
  // (float32, slot order, rounded once) of rows fold_map[i][0..fold_k) (-1: none), formed while pushing.
  const int* fold_map;
  int fold_k;
  int64_t fold_rows;
  // Fold blocks (fold_out != null, with fold_map): the grid's last fold_blocks blocks form received row i
  // into fold_out[i] and flag it; the others push / reduce fold_out's rows as a plain combine, each once
  // flagged (the fold overlaps the communication instead of preceding it or running on the push warps).
  void* fold_out;
  int fold_blocks;
  int shape[kShapeInts];  // this call's rows (kShapeFields): published to the peers, compared by them
  RowLayout lay;  // off_x: rows of hidden bf16, off_topk_w: rows of num_topk float
  SignalArgs sig;
};

// Where the layout kernel reports expert ids out of range (null claim: it skips them silently).
struct LayoutReport {
  ErrorRecord* err = nullptr;
  int* claim = nullptr;
  int rank = 0;
};
// per_node (null: not counted): tokens with a destination rank on each node of ranks_per_node ranks.
void launch_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                            int ranks_per_node, int* per_rank, int* per_node, int* per_expert, bool* in_rank,
                            gpuStream_t stream, LayoutReport report);
void launch_notify(const NotifyArgs& a, gpuStream_t stream);
void launch_dispatch(const DispatchArgs& a, int num_blocks, gpuStream_t stream);
void launch_combine(const CombineArgs& a, int num_blocks, gpuStream_t stream);

}  // namespace uccl_ep::intranode
