// Expert-major permutation on the receiving rank (host-side launchers; kernels in permute.cu).
//
// A dispatch delivers each token once per destination rank; the rank's experts want their rows grouped
// by expert. `dst[i * num_topk + j]` (int32) is the expert-major row of received row i's j-th top-k slot,
// or -1 when that slot names another rank's expert (or none). With it:
//   expand_rows   out[dst[i, j]] = x[i]             (dispatch side; read each row once, write it k' times)
//   reduce_rows   out[i] = sum_j y[dst[i, j]]       (combine side; float32 sum in slot order, no atomics)
// Each is the other's backward, so neither forward nor backward needs atomics or a sort.
#pragma once

#include <cstdint>

#include "common/portability.h"

namespace uccl_ep::permute {

enum Dtype : int { kBf16 = 0, kFp16 = 1, kFp32 = 2 };

// dst[i, j] for every received row i and top-k slot j: rows of expert e start at the sum of counts[0..e)
// and keep row order (the ids of a row are distinct; should one repeat, its first slot is mapped, the others
// get -1); slots naming no local expert (< 0 or >= num_experts) get -1. Every slot is written (dst needs no
// fill). counts: int32 device array of num_experts (rows per local expert, as the dispatch returned them).
void launch_expert_major_map(const int64_t* topk_idx, int64_t num_rows, int num_topk, int num_experts,
                             const int* counts, int* dst, gpuStream_t stream);
// Copies row i of `x` (row_bytes each) to every destination row of `out` (num_out rows) that dst names.
void launch_expand_rows(const void* x, const int* dst, void* out, int64_t num_rows, int num_topk,
                        int64_t row_bytes, int64_t num_out, gpuStream_t stream);
// Sums, per row i, the rows of `y` (num_in rows) named by dst[i, :] (zeros when none) into out[i]; float32
// accumulation. Destinations outside [0, num_out) / [0, num_in) are skipped, never accessed.
void launch_reduce_rows(const void* y, const int* dst, void* out, int64_t num_rows, int num_topk, int64_t hidden,
                        int64_t num_in, int dtype, gpuStream_t stream);

// Megatron's routing (a bool map [num_tokens, num_experts] and probabilities of the same shape) to top-k form:
// each token's first num_topk selected experts in expert order (topk_idx int64; -1 pads a token with fewer,
// e.g. dropped by a capacity factor) and their float32 probabilities (0 in padded slots). One warp per token.
void launch_routing_topk(const bool* routing_map, const float* probs, int64_t num_tokens, int num_experts,
                         int num_topk, int64_t* topk_idx, float* topk_weights, gpuStream_t stream);

}  // namespace uccl_ep::permute
