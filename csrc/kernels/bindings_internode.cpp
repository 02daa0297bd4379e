// pybind11 face of the internode path: `_native.InternodeBuffer` and the layout helpers.
// Pointers and streams are plain integers (tensor.data_ptr(), stream.cuda_stream): no libtorch here.
// Without a GPU compiler only the layout helpers are registered (host arithmetic, layouts.cpp: sizes for
// `uccl-ep-train plan`), and Python uses the reference backend across nodes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "kernels/internode_api.h"

namespace py = pybind11;

void register_internode(py::module_& m) {
  namespace in = uccl_ep::internode;
  m.attr("INTERNODE_MAX_LOCAL") = in::kMaxLocal;
  m.attr("INTERNODE_MAX_NODES") = in::kMaxNodes;
  m.attr("INTERNODE_MAX_EXPERTS") = in::kMaxExperts;
  m.attr("INTERNODE_HEADER_INTS") = in::kHeaderInts;
  m.attr("INTERNODE_MAX_EM_POSITION") = in::kMaxEmPosition;
  m.attr("INTERNODE_MAX_RDMA_BYTES") = in::kMaxRdmaBytes;
  m.def("internode_count_row_ints", &in::count_row_ints, py::arg("num_ranks"), py::arg("num_experts"),
        py::arg("ranks_per_node"), "ints of a notify count row (num_experts=INTERNODE_MAX_EXPERTS: the row stride)");
  m.def(
      "internode_layout",
      [](const std::vector<int>& rd, int num_ranks, int ranks_per_node, int rank, int64_t x_bytes,
         int64_t scale_bytes, int num_topk, int64_t y_bytes, int64_t num_recv_rows) {
        // the bytes one rank needs for a dispatch (x_bytes > 0) or a combine (y_bytes > 0) of these counts
        const int64_t row = x_bytes > 0 ? in::dispatch_row_bytes(x_bytes, scale_bytes, num_topk, ranks_per_node) : 0;
        const int64_t crow = y_bytes > 0 ? in::combine_row_bytes(y_bytes, num_topk) : 0;
        const in::Layout l = in::make_layout(rd, num_ranks, ranks_per_node, rank, row, crow, num_recv_rows);
        py::dict d;
        d["rdma_bytes"] = l.rdma_bytes;
        d["nvl_bytes"] = l.nvl_bytes;
        d["row_bytes"] = row;
        d["crow_bytes"] = crow;
        d["areas"] = std::vector<int64_t>{l.notify_off, l.send_off, l.recv_off, l.csend_off, l.crecv_off, l.rdma_bytes};
        d["send_row0"] = std::vector<int64_t>(l.send_row0, l.send_row0 + l.num_nodes + 1);
        d["recv_row0"] = std::vector<int64_t>(l.recv_row0, l.recv_row0 + l.num_nodes + 1);
        return d;
      },
      py::arg("rd"), py::arg("num_ranks"), py::arg("ranks_per_node"), py::arg("rank"), py::arg("x_bytes"),
      py::arg("scale_bytes"), py::arg("num_topk"), py::arg("y_bytes"), py::arg("num_recv_rows"),
      "One rank's layout for one call (internode_api.h: make_layout): RDMA region / NVL buffer bytes, row sizes,\n"
      "the RDMA areas' offsets (notify, send, recv, csend, crecv, end), and each node's segment rows");
  m.def("internode_row_bytes", &in::dispatch_row_bytes, py::arg("x_bytes"), py::arg("scale_bytes"),
        py::arg("num_topk"), py::arg("ranks_per_node"), "bytes of one internode dispatch row");
  m.def("internode_combine_row_bytes", &in::combine_row_bytes, py::arg("y_bytes"), py::arg("num_topk"),
        "bytes of one internode combine row");
  m.def(
      "internode_info_offsets",
      [](int num_ranks, int ranks_per_node) {
        const in::InfoOffsets o = in::info_offsets(num_ranks, ranks_per_node);
        py::dict d;
        d["rd"] = o.rd;
        d["row_base"] = o.row_base;
        d["counts"] = o.counts;
        d["num_recv"] = o.num_recv;
        d["from_nodes"] = o.from_nodes;
        d["from_ends"] = o.from_ends;
        d["recv_starts"] = o.recv_starts;
        d["recv_ends"] = o.recv_ends;
        d["valid"] = o.valid;
        d["ints"] = o.ints;
        return d;
      },
      py::arg("num_ranks"), py::arg("ranks_per_node"),
      "Where each item of a dispatch's call info (device int32, internode_api.h: InfoOffsets) starts, and its ints");
#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)
  using in::InternodeBuffer;
  py::class_<InternodeBuffer>(m, "InternodeBuffer",
                              "One rank's NVL buffer, RDMA and flag regions, and the internode kernels")
      .def(py::init<int, int, int, int, int64_t, int64_t, double>(), py::arg("device"), py::arg("rank"),
           py::arg("num_ranks"), py::arg("ranks_per_node"), py::arg("nvl_bytes"), py::arg("rdma_bytes"),
           py::arg("timeout_s"))
      .def("ipc_handle", [](const InternodeBuffer& b) { return py::bytes(b.ipc_handle()); })
      .def("open_peers", &InternodeBuffer::open_peers, py::arg("handles"))
      .def("resize_rdma", &InternodeBuffer::resize_rdma, py::arg("bytes"))
      .def("destroy", &InternodeBuffer::destroy)
      .def("rdma_ptr", &InternodeBuffer::rdma_ptr)
      .def("rdma_bytes", &InternodeBuffer::rdma_bytes)
      .def("flag_ptr", &InternodeBuffer::flag_ptr)
      .def("flag_bytes", &InternodeBuffer::flag_bytes)
      .def("nvl_bytes", &InternodeBuffer::nvl_bytes)
      .def("set_rings", &InternodeBuffer::set_rings, py::arg("rings"), py::arg("failure_record"),
           py::arg("failure_record_host"))
      .def("error", &InternodeBuffer::error)
      .def("abort", &InternodeBuffer::abort, py::arg("op"), py::call_guard<py::gil_scoped_release>(),
           "tell every rank of the node that this rank raised inside call `op` (their waits end, they raise)")
      .def("abort_source", &InternodeBuffer::abort_source)
      .def("dispatch_layout", &InternodeBuffer::dispatch_layout, py::call_guard<py::gil_scoped_release>())
      .def("notify", &InternodeBuffer::notify, py::call_guard<py::gil_scoped_release>())
      .def("wait_counts", &InternodeBuffer::wait_counts, py::call_guard<py::gil_scoped_release>())
      .def("send_positions", &InternodeBuffer::send_positions, py::call_guard<py::gil_scoped_release>())
      .def(
          "counts",
          [](InternodeBuffer& b, int64_t num_worst_tokens, int expert_capacity, int64_t max_node_rows, int64_t info,
             int64_t stream) {
            in::CountChecks checks;
            checks.num_worst_tokens = num_worst_tokens;
            checks.expert_capacity = expert_capacity;
            checks.max_node_rows = max_node_rows;
            b.counts(checks, info, stream);
          },
          py::arg("num_worst_tokens"), py::arg("expert_capacity"), py::arg("max_node_rows"), py::arg("info"),
          py::arg("stream"),
          py::call_guard<py::gil_scoped_release>())
      .def("dispatch", &InternodeBuffer::dispatch, py::call_guard<py::gil_scoped_release>())
      .def("combine", &InternodeBuffer::combine, py::call_guard<py::gil_scoped_release>());
#endif
}
