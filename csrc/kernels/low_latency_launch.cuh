// Kernel arguments and launchers of the low-latency path (internal to csrc/kernels; see low_latency_api.h).
#pragma once

#include <cstdint>

#include "common/portability.h"
#include "kernels/device_utils.cuh"
#include "kernels/low_latency_api.h"
#include "proxy/ring.h"

namespace uccl_ep::low_latency {

using intranode::ErrorRecord;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / UCCL_WARP_SIZE;

// The region starts with the claim word and error words (intranode's board layout); Layout::counters is after.
constexpr int64_t kClaimOffset = 0;
static_assert(kMaxLocal <= intranode::kMaxBoard, "a node's ranks fit its claim table and error board");

// Counters at Layout::counters (the same place for every shape), all zero after clean():
//   uint32 d_done[kMaxRanks]      dispatch: blocks done with destination r (reset by the finisher)
//   uint32 c_done[kMaxRanks]      combine: the same
//   uint64 words[6]               0, 1: blocks done of the dispatch / combine receive (cumulative), then
//                                 seq[kind][half] (calls received so far) at kSeqWord
constexpr int64_t kDoneOffset = 0;
constexpr int64_t kCDoneOffset = kDoneOffset + 4 * kMaxRanks;
constexpr int64_t kWordsOffset = kCDoneOffset + 4 * kMaxRanks;
constexpr int kBlocksDoneWord = 0, kSeqWord = 2;
constexpr int64_t kCounterBytes = kWordsOffset + 8 * (kSeqWord + 4);

// Phases named in errors (ErrorRecord::phase), ring-full and expert-full codes: common/errors.h.

struct RingSet {
  uccl::RingDesc r[kMaxRings];
  int n;
};

struct Args {
  Layout lay;
  int rank, num_ranks, ranks_per_node, num_experts, num_local, max_tokens, hidden;
  int num_tokens, num_topk, half;
  int phases;  // kSendPhase | kRecvPhase (low_latency_api.h)
  int64_t timeout_cycles;
  unsigned long long ring_spins;
  ErrorRecord* err;
  int* claim;
  char* peers[kMaxLocal];  // node peers' regions by local index (own included)
  char* buf;               // this rank's region
  uint64_t* host_flags;  // device view
  RingSet rings;
  // call data
  const char* x;
  const int64_t* topk_idx;
  const float* topk_w;
  int* pair_pos;
  bool use_fp8, round_scale, use_ue8m0, fnuz;
  char* recv_x;
  char* recv_scales;
  int* src_info;
  int64_t* layout_range;
  int* recv_count;
  int* stats;
  char* out;
};

void preload_kernels();
void launch_dispatch(const Args& a, int blocks, gpuStream_t stream);  // the phases in Args::phases
void launch_combine(const Args& a, int blocks, gpuStream_t stream);

}  // namespace uccl_ep::low_latency
