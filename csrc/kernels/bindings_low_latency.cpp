// pybind11 face of the low-latency path: `_native.LowLatencyBuffer` (csrc/kernels/low_latency_api.h).
// Pointers and streams are plain integers (tensor.data_ptr(), stream.cuda_stream): no libtorch here.
// Without a GPU compiler nothing is registered, and Python serves low-latency calls with the reference backend.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)
#include "kernels/low_latency_api.h"
#endif

namespace py = pybind11;

void register_low_latency(py::module_& m) {
#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)
  namespace ll = uccl_ep::low_latency;
  using ll::LowLatencyBuffer;
  m.attr("LL_MAX_LOCAL") = ll::kMaxLocal;
  m.attr("LL_MAX_RANKS") = ll::kMaxRanks;
  m.attr("LL_MAX_EXPERTS") = ll::kMaxExperts;
  m.attr("LL_MAX_TOPK") = ll::kMaxTopk;
  m.attr("LL_MSG_HEADER_BYTES") = ll::kMsgHeaderBytes;
  m.attr("LL_LAYOUT_FIELDS") = ll::kLayoutFields;
  m.attr("LL_SEND_PHASE") = ll::kSendPhase;
  m.attr("LL_RECV_PHASE") = ll::kRecvPhase;
  m.attr("LL_ERROR_WORDS_BYTES") = LowLatencyBuffer::error_words_bytes();  // at 0, before Layout::counters
  m.attr("LL_COUNTER_BYTES") = LowLatencyBuffer::counter_bytes();
  py::class_<LowLatencyBuffer>(m, "LowLatencyBuffer",
                               "One rank's low-latency regions (shared, local, host flags) and the LL kernels")
      .def(py::init<int, int, int, int, int64_t, int64_t, int, double>(), py::arg("device"), py::arg("rank"),
           py::arg("num_ranks"), py::arg("ranks_per_node"), py::arg("bytes"), py::arg("flag_words"),
           py::arg("num_blocks"), py::arg("timeout_s"))
      .def("ipc_handle", [](const LowLatencyBuffer& b) { return py::bytes(b.ipc_handle()); })
      .def("open_peers", &LowLatencyBuffer::open_peers, py::arg("handles"))
      .def("set_rings", &LowLatencyBuffer::set_rings, py::arg("rings"), py::arg("failure_record"))
      .def("destroy", &LowLatencyBuffer::destroy)
      .def("clean", &LowLatencyBuffer::clean, py::call_guard<py::gil_scoped_release>())
      .def("error", &LowLatencyBuffer::error)
      .def("abort", &LowLatencyBuffer::abort, py::arg("op"), py::call_guard<py::gil_scoped_release>(),
           "tell every rank of the node that this rank raised inside call `op` (their waits end, they raise)")
      .def("abort_source", &LowLatencyBuffer::abort_source)
      .def("ptr", &LowLatencyBuffer::ptr)
      .def("bytes", &LowLatencyBuffer::bytes)
      .def("flag_ptr", &LowLatencyBuffer::flag_ptr)
      .def("flag_bytes", &LowLatencyBuffer::flag_bytes)
      .def("num_blocks", &LowLatencyBuffer::num_blocks)
      .def("dispatch", &LowLatencyBuffer::dispatch, py::call_guard<py::gil_scoped_release>())
      .def("combine", &LowLatencyBuffer::combine, py::call_guard<py::gil_scoped_release>());
#else
  (void)m;
#endif
}
