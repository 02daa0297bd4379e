// pybind11 face of the intranode path: `_native.IntranodeBuffer` (+ `_native.intranode_row_capacity`,
// `_native.ipc_mappings_open`).
// Pointers and streams are plain integers (tensor.data_ptr(), stream.cuda_stream): no libtorch here.
// Without a GPU compiler only the buffer's layout is registered (host arithmetic, layouts.cpp: sizes for
// `uccl-ep-train plan`), and Python falls back to the reference backend.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "kernels/intranode_api.h"
#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)
#include "kernels/ipc_handles.h"
#endif

namespace py = pybind11;

void register_intranode(py::module_& m) {
  m.attr("INTRANODE_HEADER_BYTES") = uccl_ep::intranode::kHeaderBytes;
  m.def(
      "intranode_row_capacity",
      [](int64_t data_bytes, int64_t x_bytes, int64_t scale_bytes, int num_topk, bool with_src) {
        return uccl_ep::intranode::make_row_layout(data_bytes, x_bytes, scale_bytes, num_topk, with_src).cap_rows;
      },
      "rows of (x, scales, topk idx/weights, src idx) that fit in `data_bytes` of an intranode buffer (after its "
      "INTRANODE_HEADER_BYTES header)");
#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)
  using uccl_ep::intranode::IntranodeBuffer;
  m.attr("INTRANODE_MAX_RANKS") = uccl_ep::intranode::kMaxRanks;
  m.attr("INTRANODE_WARPS_PER_BLOCK") = IntranodeBuffer::warps_per_block();
  m.attr("INTRANODE_SHAPE_INTS") = uccl_ep::intranode::kShapeInts;
  {
    py::tuple fields(uccl_ep::intranode::kShapeInts);
    for (int i = 0; i < uccl_ep::intranode::kShapeInts; ++i) fields[i] = py::str(uccl_ep::intranode::kShapeFields[i]);
    m.attr("INTRANODE_SHAPE_FIELDS") = fields;
  }
  m.def(
      "ipc_mappings_open", [] { return uccl_ep::ipc_mappings().load(); },
      "peer buffers this process has mapped through IPC and not unmapped (intranode and internode buffers)");
  m.def("dispatch_layout", &uccl_ep::intranode::dispatch_layout, py::arg("topk_idx"), py::arg("num_tokens"),
        py::arg("num_topk"), py::arg("num_experts"), py::arg("num_ranks"), py::arg("ranks_per_node"),
        py::arg("out_per_rank"), py::arg("out_per_node"), py::arg("out_per_expert"), py::arg("out_in_rank"),
        py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
        "get_dispatch_layout's kernel on the current device (outputs zeroed by the caller)");
  py::class_<IntranodeBuffer>(m, "IntranodeBuffer",
                              "One rank's IPC-shared NVLink buffer and the intranode kernels that use it")
      .def(py::init<int, int, int, int64_t, double>(), py::arg("device"), py::arg("rank"), py::arg("num_ranks"),
           py::arg("num_bytes"), py::arg("timeout_s"))
      .def("ipc_handle", [](const IntranodeBuffer& b) { return py::bytes(b.ipc_handle()); })
      .def("open_peers", &IntranodeBuffer::open_peers, py::arg("handles"))
      .def("destroy", &IntranodeBuffer::destroy)
      .def("is_open", &IntranodeBuffer::is_open)
      .def("header_bytes", &IntranodeBuffer::header_bytes)
      .def("data_bytes", &IntranodeBuffer::data_bytes)
      .def("local_ptr", &IntranodeBuffer::local_ptr)
      .def("error", &IntranodeBuffer::error)
      .def("abort", &IntranodeBuffer::abort, py::arg("op"), py::call_guard<py::gil_scoped_release>(),
           "tell every rank of the node that this rank raised inside call `op` (their waits end, they raise)")
      .def("abort_source", &IntranodeBuffer::abort_source)
      .def("clear_error", &IntranodeBuffer::clear_error)
      .def("dispatch_layout", &IntranodeBuffer::dispatch_layout, py::call_guard<py::gil_scoped_release>())
      .def("notify", &IntranodeBuffer::notify, py::call_guard<py::gil_scoped_release>())
      .def("dispatch", &IntranodeBuffer::dispatch, py::call_guard<py::gil_scoped_release>())
      .def("combine", &IntranodeBuffer::combine, py::call_guard<py::gil_scoped_release>());
#endif
}
