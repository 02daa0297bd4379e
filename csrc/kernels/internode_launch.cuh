// Kernel arguments and launchers of the internode path (internal to csrc/kernels; see internode_api.h).
#pragma once

#include <cstdint>

#include "common/portability.h"
#include "kernels/device_utils.cuh"
#include "kernels/internode_api.h"
#include "proxy/ring.h"

namespace uccl_ep::internode {

using intranode::ErrorRecord;

constexpr int kThreads = 512;  // 16 warps (8 wavefronts on AMD)

// NVL buffer header: internode_api.h (kBarOffset ... kNvlHeaderBytes)
static_assert(kClaimOffset + intranode::kErrorWordsBytes <= kOpCountersOffset &&
                  kOpCountersOffset + int64_t(sizeof(OpCounters)) <= kChunkCountOffset,
              "the error words fit after the claim word, the op counters after them");
static_assert(kMaxLocal <= intranode::kMaxBoard, "a node's ranks fit its claim table and error board");
static_assert(kMaxExperts <= (1 << kEmIdBits), "an expert id fits the low bits of an expert-major id word");
static_assert(kHeaderInts == intranode::kShapeInts, "a count row's header is the call's shape (the counts kernel "
                                                    "compares it field by field)");

// Flag region (int64 words, pinned host memory): the proxies apply atomic adds there in sequence order.
//   [0, R)                notify rows arrived from rank s (cumulative)
//   [R, 2R)               READY markers from rank s (cumulative: one per op)
//   [2R + n*kMaxChunks+j] dispatch chunk j from node n landed (reset each op)
//   [2R + (N+n)*kMaxChunks + j] combine chunk j from node n landed (reset each op)
__host__ __device__ inline int64_t notify_flag(int s) { return s; }
__host__ __device__ inline int64_t ready_flag(int R, int s) { return R + s; }
__host__ __device__ inline int64_t dispatch_flag(int R, int n, int j) { return 2 * int64_t(R) + int64_t(n) * kMaxChunks + j; }
__host__ __device__ inline int64_t combine_flag(int R, int N, int n, int j) {
  return 2 * int64_t(R) + int64_t(N + n) * kMaxChunks + j;
}
inline int64_t flag_words(int R, int N) { return 2 * int64_t(R) + 2 * int64_t(N) * kMaxChunks; }

// Phases named in errors (ErrorRecord::phase) and the ring-full code: common/errors.h.

struct RingSet {
  uccl::RingDesc r[kMaxRings];
  int n;
};

// What every internode kernel gets.
struct Common {
  int rank, num_ranks, L, N, node, local;
  int64_t timeout_cycles;
  unsigned long long ring_spins;  // host-tail polls before a full ring is an error (~ the timeout)
  ErrorRecord* err;
  int* claim;
  uint64_t* flags;  // the flag region, device view
  RingSet rings;
  int data_channels;  // chunk j of a stream goes on channel 1 + j % data_channels; channel 0: control
  char* nvl[kMaxLocal];  // node peers' NVL buffers (own at [local])
  char* rdma;            // this rank's RDMA region
  uint64_t* done;        // local block-completion counter (last_block: zero between kernels)
  int* chunk_count;      // local [kMaxNodes * kMaxChunks]: zero when an op starts (clear_chunk_counts)
  OpCounters* counters;  // local (kOpCountersOffset)
};

struct NotifyArgs {
  Common c;
  int row_ints, stride, num_experts;  // ints sent; ints between rows
  int header[kHeaderInts];
  const int* per_rank;
  const int* per_node;
  const int* per_expert;
};

// What the counts kernel needs (InternodeBuffer::counts).
struct CountsArgs {
  Common c;
  int stride;         // ints between count rows
  int num_experts;
  CountChecks checks;
  int* info;          // out: the call info (InfoOffsets)
};

// Per-node tables of one call (row indices, byte offsets in the RDMA region): every block of every kernel
// computes them at its start from the call info (load_tables), so nothing of the call's counts comes from
// the host.
struct NodeTables {
  int64_t send_row0[kMaxNodes + 1];    // this rank's segment for node n (send area, crecv area)
  int64_t recv_row0[kMaxNodes + 1];    // rows forwarded from node n (recv area, csend area)
  int64_t remote_in[kMaxNodes];        // byte offset, in node n's RDMA peer, where this rank's rows land
  int nchunks_send[kMaxNodes];         // chunks of this rank's segment for node n
  int nchunks_recv[kMaxNodes];         // chunks coming from node n
  Areas areas;                         // this rank's RDMA areas
  int64_t num_recv;                    // rows this rank receives
  int valid;                           // the counts passed their checks (else no row of the caller's moves)
  uint64_t op;       // this op's number (OpCounters): the READY target, the arrival mirror's value
  uint64_t barrier;  // the node barrier the op's first kernel arrives at (its middle kernel at barrier + 1)
  int chunk_rows;  // rows per RDMA chunk: the requested count, grown until no stream has more than kMaxChunks
};

struct DispatchArgs {
  Common c;
  const int* info;  // the call info (InfoOffsets)
  int64_t row_bytes, nvl_recv_off;
  int requested_chunk_rows;
  int num_tokens, num_topk, experts_per_rank;
  const char* x;
  int64_t x_bytes;
  const char* scales;
  int64_t scale_bytes;
  const int64_t* topk_idx;
  const float* topk_w;
  const int* send_pos;   // [T, R]
  const int* node_head;  // [T, N]
  int64_t out_rows;
  char* recv_x;
  char* recv_scales;
  int64_t* recv_idx;
  float* recv_w;
  int* recv_src;  // [out_rows, 2]
  int* fwd_head;  // [forwarded rows, L]
  // expert-major landing (em_x != nullptr; see InternodeBuffer::dispatch)
  const int* topk_pos;  // [num_tokens, num_topk]
  const int* em_base;   // [R, experts_per_rank]
  char* em_x;           // [em_rows, x_bytes]
  int* em_map;          // [out_rows, num_topk]
  int64_t em_rows;
};

struct CombineArgs {
  Common c;
  const int* info;  // the dispatch's call info (InfoOffsets)
  int64_t crow_bytes, nvl_stage_off;
  int requested_chunk_rows;
  int num_tokens, num_topk, hidden, dtype;
  const char* x;
  const float* topk_w;
  const int* node_head;  // [T, N]
  const int* fwd_head;   // [forwarded rows, L]
  const char* bias0;
  const char* bias1;
  char* out;
  float* out_w;
};

// Loads every internode kernel now. Under lazy module loading (CUDA's default) a kernel's first launch
// loads it, and loading waits for the kernels already running: a launch made while a forwarder spins on
// arrivals would hang the host thread (and the proxy's copies behind it). Measured: two ranks on one H100
// timed out in the forward phase unless CUDA_MODULE_LOADING=EAGER.
void preload_kernels();
void launch_notify(const NotifyArgs& a, gpuStream_t stream);
// send_pos [T, R] and node_head [T, N] (int32) from is_token_in_rank [T, R] (InternodeBuffer::send_positions).
void launch_send_positions(const bool* in_rank, int num_tokens, int num_ranks, int ranks_per_node, int* send_pos,
                           int* node_head, gpuStream_t stream);
void launch_counts(const CountsArgs& a, gpuStream_t stream);
void launch_dispatch(const DispatchArgs& a, int num_sms, gpuStream_t stream);  // pack+send, forward, copy-out
void launch_combine(const CombineArgs& a, int num_sms, gpuStream_t stream);    // stage, forward, reduce

}  // namespace uccl_ep::internode
