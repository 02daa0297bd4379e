// Entry point of `uccl_ep_train._native`. The module never links libcuda (only cudart, when built with
// CUDA), so it imports on machines without a GPU driver; GPU calls then fail with a clear error.
#include "bindings.h"

#include "common/portability.h"

PYBIND11_MODULE(_native, m) {
  m.doc() = "uccl-ep-train native module: GPU->CPU command rings, CPU proxies, transports, kernels";
  m.attr("WITH_CUDA") = bool(
#if defined(UCCL_EP_WITH_CUDA)
      true
#else
      false
#endif
  );
  m.attr("WITH_HIP") = bool(
#if defined(UCCL_EP_WITH_HIP)
      true
#else
      false
#endif
  );
  // the GPU targets the kernels were compiled for ("" without GPU kernels): "90", "gfx942,gfx950", ...
#if defined(UCCL_EP_GPU_ARCHS)
  m.attr("GPU_ARCHS") = std::string(UCCL_EP_GPU_ARCHS);
#else
  m.attr("GPU_ARCHS") = std::string();
#endif
  register_proxy(m);
  register_transport(m);
  if (register_proxy_gpu) register_proxy_gpu(m);
  // GPU kernels (csrc/kernels/) register here when compiled in.
  if (register_intranode) register_intranode(m);
  if (register_permute) register_permute(m);
  if (register_internode) register_internode(m);
  if (register_low_latency) register_low_latency(m);
}
