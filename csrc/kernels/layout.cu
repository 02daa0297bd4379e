// get_dispatch_layout: per-rank and per-expert token counts and the token-in-rank mask from topk_idx.
#include "common/check.h"
#include "kernels/launch.cuh"

namespace uccl_ep::intranode {

// Counts in shared memory, then one global atomic per non-zero counter per block (outputs start zeroed). Any
// number of ranks (the internode backend uses it with all ranks of every node, and per_node then counts each
// token once per node it has a destination rank on: DeepEP's num_tokens_per_rdma_rank, in the same pass).
__global__ void __launch_bounds__(kLayoutThreads) dispatch_layout_kernel(const int64_t* topk_idx, int num_tokens,
                                                                         int num_topk, int num_experts,
                                                                         int num_ranks, int ranks_per_node,
                                                                         int* per_rank, int* per_node,
                                                                         int* per_expert, bool* in_rank,
                                                                         LayoutReport report) {
  extern __shared__ int s_counts[];  // [num_experts + num_ranks + num_nodes]
  const int num_nodes = per_node == nullptr ? 0 : num_ranks / ranks_per_node;
  const int num_counters = num_experts + num_ranks + num_nodes;
  for (int i = threadIdx.x; i < num_counters; i += blockDim.x) s_counts[i] = 0;
  __syncthreads();
  const int experts_per_rank = num_experts / num_ranks;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < num_tokens; t += gridDim.x * blockDim.x) {
    const int64_t* ids = topk_idx + (int64_t)t * num_topk;
    bool* row = in_rank + (int64_t)t * num_ranks;
    for (int r = 0; r < num_ranks; ++r) row[r] = false;
    for (int k = 0; k < num_topk; ++k) {
      const int64_t e = ids[k];
      if (e < 0 || e >= num_experts) {  // -1: no selection
        if (e != -1 && report.claim != nullptr)  // topk_idx[t, k]: the column rides in the record's block
          report_error(report.err, report.claim, kErrBadExpert, report.rank, t, kPhaseLayout, saturate_int(e),
                       num_experts, k);
        continue;
      }
      atomicAdd(&s_counts[e], 1);
      const int r = (int)(e / experts_per_rank);
      bool first = true;  // the first of the token's slots on rank r counts the token there
      for (int j = 0; j < k && first; ++j) first = !(ids[j] >= 0 && ids[j] < num_experts && ids[j] / experts_per_rank == r);
      if (first) {
        row[r] = true;
        atomicAdd(&s_counts[num_experts + r], 1);
        const int n = r / ranks_per_node;  // and the first of its ranks on node n counts it there
        bool first_on_node = num_nodes > 0;
        for (int j = 0; j < k && first_on_node; ++j)
          first_on_node = !(ids[j] >= 0 && ids[j] < num_experts && ids[j] / experts_per_rank / ranks_per_node == n);
        if (first_on_node) atomicAdd(&s_counts[num_experts + num_ranks + n], 1);
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < num_counters; i += blockDim.x) {
    const int c = s_counts[i];
    if (c == 0) continue;
    if (i < num_experts)
      atomicAdd(&per_expert[i], c);
    else if (i < num_experts + num_ranks)
      atomicAdd(&per_rank[i - num_experts], c);
    else
      atomicAdd(&per_node[i - num_experts - num_ranks], c);
  }
}

void launch_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                            int ranks_per_node, int* per_rank, int* per_node, int* per_expert, bool* in_rank,
                            gpuStream_t stream, LayoutReport report) {
  UCCL_CHECK(num_ranks >= 1, "num_ranks " << num_ranks << " must be >= 1");
  UCCL_CHECK(num_experts % num_ranks == 0, "num_experts " << num_experts << " not divisible by " << num_ranks);
  UCCL_CHECK(ranks_per_node >= 1 && num_ranks % ranks_per_node == 0,
             "ranks_per_node " << ranks_per_node << " does not divide num_ranks " << num_ranks);
  const int num_nodes = per_node == nullptr ? 0 : num_ranks / ranks_per_node;
  const int smem = (num_experts + num_ranks + num_nodes) * (int)sizeof(int);
  UCCL_CHECK(smem <= 48 * 1024, "num_experts " << num_experts << " too large for the layout kernel");
  int blocks = (num_tokens + kLayoutThreads - 1) / kLayoutThreads;
  blocks = blocks < 1 ? 1 : (blocks > 128 ? 128 : blocks);
  dispatch_layout_kernel<<<blocks, kLayoutThreads, smem, stream>>>(topk_idx, num_tokens, num_topk, num_experts,
                                                                   num_ranks, ranks_per_node, per_rank, per_node,
                                                                   per_expert, in_rank, report);
  UCCL_CHECK_GPU(gpuGetLastError());
}

}  // namespace uccl_ep::intranode
