// Entry point of `uccl_ep_train._native`. The module never links libcuda (only cudart, when built with
// CUDA), so it imports on machines without a GPU driver; GPU calls then fail with a clear error.
#include "bindings.h"

#include "common/errors.h"
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
  // The kernels' error records as sentences (common/errors.h), for tests and tools: the codes and phases by
  // name, and the formatter every native buffer's error() uses.
  pybind11::dict codes, phases;
  codes["timeout"] = int(uccl_ep::kErrTimeout);
  codes["capacity"] = int(uccl_ep::kErrCapacity);
  codes["worst_tokens"] = int(uccl_ep::kErrWorstTokens);
  codes["bad_counts"] = int(uccl_ep::kErrBadCounts);
  codes["bad_expert"] = int(uccl_ep::kErrBadExpert);
  codes["shape"] = int(uccl_ep::kErrShape);
  codes["expert_capacity"] = int(uccl_ep::kErrExpertCapacity);
  codes["node_rows"] = int(uccl_ep::kErrNodeRows);
  codes["bad_row"] = int(uccl_ep::kErrBadRow);
  codes["ring_full"] = int(uccl_ep::kErrRingFull);
  codes["expert_full"] = int(uccl_ep::kErrExpertFull);
  codes["aborted"] = int(uccl_ep::kErrAborted);
  codes["proxy_failed"] = int(uccl_ep::kErrProxyFailed);
  phases["intranode_notify"] = int(uccl_ep::intranode::kPhaseNotify);
  phases["intranode_dispatch"] = int(uccl_ep::intranode::kPhaseDispatch);
  phases["intranode_combine"] = int(uccl_ep::intranode::kPhaseCombine);
  phases["intranode_layout"] = int(uccl_ep::intranode::kPhaseLayout);
  phases["internode_notify"] = int(uccl_ep::internode::kPhaseNotify);
  phases["internode_dispatch_send"] = int(uccl_ep::internode::kPhaseDispatchSend);
  phases["internode_dispatch_forward"] = int(uccl_ep::internode::kPhaseDispatchForward);
  phases["internode_dispatch_copy_out"] = int(uccl_ep::internode::kPhaseDispatchCopyOut);
  phases["internode_combine_stage"] = int(uccl_ep::internode::kPhaseCombineStage);
  phases["internode_combine_forward"] = int(uccl_ep::internode::kPhaseCombineForward);
  phases["internode_combine_reduce"] = int(uccl_ep::internode::kPhaseCombineReduce);
  phases["low_latency_dispatch_send"] = int(uccl_ep::low_latency::kPhaseDispatchSend);
  phases["low_latency_dispatch_recv"] = int(uccl_ep::low_latency::kPhaseDispatchRecv);
  phases["low_latency_combine_send"] = int(uccl_ep::low_latency::kPhaseCombineSend);
  phases["low_latency_combine_recv"] = int(uccl_ep::low_latency::kPhaseCombineRecv);
  m.attr("ERROR_CODES") = codes;
  m.attr("ERROR_PHASES") = phases;
  m.def(
      "describe_error",
      [](int code, int rank, int peer, int block, int phase, int need, int have, int reader, int ranks_per_node,
         double timeout_s) {
        uccl_ep::ErrorFields f;
        f.code = code;
        f.rank = rank;
        f.peer = peer;
        f.block = block;
        f.phase = phase;
        f.need = need;
        f.have = have;
        return uccl_ep::describe_error(f, uccl_ep::ErrorContext{reader, ranks_per_node, timeout_s});
      },
      pybind11::arg("code"), pybind11::arg("rank"), pybind11::arg("peer"), pybind11::arg("block"),
      pybind11::arg("phase"), pybind11::arg("need"), pybind11::arg("have"), pybind11::arg("reader"),
      pybind11::arg("ranks_per_node") = 0, pybind11::arg("timeout_s") = 300.0,
      "An error record (common/errors.h) as the sentence the native buffers raise; reader: the rank whose buffer "
      "holds it; ranks_per_node > 0 names nodes");
  {
    pybind11::tuple ops(uccl_ep::kNumAbortOps);
    for (int i = 0; i < uccl_ep::kNumAbortOps; ++i) ops[i] = pybind11::str(uccl_ep::kAbortOps[i]);
    m.attr("ABORT_OPS") = ops;
  }
  m.def("rank_aborted", &uccl_ep::rank_aborted, pybind11::arg("rank"), pybind11::arg("op"),
        pybind11::arg("message"),
        "The sentence a peer raises after `rank` aborted `op` (its message; \"\": where to find it instead)");
  register_proxy(m);
  register_transport(m);
  if (register_proxy_gpu) register_proxy_gpu(m);
  // GPU kernels (csrc/kernels/) register here when compiled in.
  if (register_intranode) register_intranode(m);
  if (register_permute) register_permute(m);
  if (register_internode) register_internode(m);
  if (register_low_latency) register_low_latency(m);
}
