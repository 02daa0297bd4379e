// pybind11 face of the expert-major permutation kernels: `_native.expert_major_map`, `expand_rows`, `reduce_rows`,
// and `routing_topk` (Megatron's routing map to top-k form).
// Pointers and streams are plain integers (tensor.data_ptr(), stream.cuda_stream), as for the intranode path.
#include <pybind11/pybind11.h>

#include "bindings.h"

#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)
#include "kernels/permute_api.h"
#endif

namespace py = pybind11;

void register_permute(py::module_& m) {
#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)
  using namespace uccl_ep::permute;
  m.def(
      "expert_major_map",
      [](uintptr_t topk_idx, int64_t num_rows, int num_topk, int num_experts, uintptr_t counts, uintptr_t dst,
         uintptr_t stream) {
        launch_expert_major_map(reinterpret_cast<const int64_t*>(topk_idx), num_rows, num_topk, num_experts,
                                reinterpret_cast<const int*>(counts), reinterpret_cast<int*>(dst),
                                reinterpret_cast<gpuStream_t>(stream));
      },
      py::arg("topk_idx"), py::arg("num_rows"), py::arg("num_topk"), py::arg("num_experts"), py::arg("counts"),
      py::arg("dst"), py::arg("stream"),
      "dst[i, j]: expert-major row of row i's slot j (int64 local expert ids, int32 counts; every slot written)");
  m.def(
      "expand_rows",
      [](uintptr_t x, uintptr_t dst, uintptr_t out, int64_t num_rows, int num_topk, int64_t row_bytes,
         int64_t num_out, uintptr_t stream) {
        launch_expand_rows(reinterpret_cast<const void*>(x), reinterpret_cast<const int*>(dst),
                           reinterpret_cast<void*>(out), num_rows, num_topk, row_bytes, num_out,
                           reinterpret_cast<gpuStream_t>(stream));
      },
      py::arg("x"), py::arg("dst"), py::arg("out"), py::arg("num_rows"), py::arg("num_topk"), py::arg("row_bytes"),
      py::arg("num_out"), py::arg("stream"), "out[dst[i, j]] = x[i] for every valid (>= 0) int32 destination");
  m.def(
      "reduce_rows",
      [](uintptr_t y, uintptr_t dst, uintptr_t out, int64_t num_rows, int num_topk, int64_t hidden, int64_t num_in,
         int dtype, uintptr_t stream) {
        launch_reduce_rows(reinterpret_cast<const void*>(y), reinterpret_cast<const int*>(dst),
                           reinterpret_cast<void*>(out), num_rows, num_topk, hidden, num_in, dtype,
                           reinterpret_cast<gpuStream_t>(stream));
      },
      py::arg("y"), py::arg("dst"), py::arg("out"), py::arg("num_rows"), py::arg("num_topk"), py::arg("hidden"),
      py::arg("num_in"), py::arg("dtype"), py::arg("stream"),
      "out[i] = sum_j y[dst[i, j]] (float32 accumulation; dtype bf16=0, fp16=1, fp32=2)");
  m.def(
      "routing_topk",
      [](uintptr_t routing_map, uintptr_t probs, int64_t num_tokens, int num_experts, int num_topk, uintptr_t topk_idx,
         uintptr_t topk_weights, uintptr_t stream) {
        launch_routing_topk(reinterpret_cast<const bool*>(routing_map), reinterpret_cast<const float*>(probs),
                            num_tokens, num_experts, num_topk, reinterpret_cast<int64_t*>(topk_idx),
                            reinterpret_cast<float*>(topk_weights), reinterpret_cast<gpuStream_t>(stream));
      },
      py::arg("routing_map"), py::arg("probs"), py::arg("num_tokens"), py::arg("num_experts"), py::arg("num_topk"),
      py::arg("topk_idx"), py::arg("topk_weights"), py::arg("stream"),
      "first num_topk selected experts per token in expert order (-1 pads) and their float32 probabilities");
#else
  (void)m;
#endif
}
