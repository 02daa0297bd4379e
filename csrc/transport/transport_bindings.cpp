// Python bindings for transports: what is compiled in, RDMA device queries (doctor's fallback when
// pyverbs does not load), and the ipc copy agent's entry point (the process the ipc transport spawns).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "transport/ipc_agent.h"
#include "transport/transport.h"
#include "transport/verbs_query.h"

namespace py = pybind11;

void register_transport(py::module_& m) {
  m.def("compiled_transports", &uccl::compiled_transports, "transports compiled into this build");
  m.attr("WITH_VERBS") = uccl::verbs_compiled();
#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)
  m.def("ipc_copy_agent", &uccl::run_copy_agent, py::arg("segment"), py::arg("gpu"), py::arg("parent"),
        py::call_guard<py::gil_scoped_release>(),
        "main of the ipc transport's copy agent process (spawned by the transport itself; returns its exit code)");
#endif
  m.def("verbs_devices", []() {
    py::list out;
    for (const auto& d : uccl::query_verbs_devices()) {
      py::dict x;
      x["name"] = d.name;
      x["node_guid"] = d.node_guid;
      x["transport"] = d.transport;
      x["vendor_id"] = d.vendor_id;
      x["vendor_part_id"] = d.vendor_part_id;
      x["fw_ver"] = d.fw_ver;
      x["max_qp"] = d.max_qp;
      x["atomic_cap"] = d.atomic_cap;
      x["dmabuf"] = d.dmabuf;
      x["peer_memory"] = d.peer_memory;
      x["error"] = d.error;
      py::list ports;
      for (const auto& p : d.ports) {
        py::dict y;
        y["port"] = p.port;
        y["state"] = p.state;
        y["link_layer"] = p.link_layer;
        y["active_mtu"] = p.active_mtu;
        y["lid"] = p.lid;
        y["speed"] = p.speed;
        y["gids"] = p.gids;
        ports.append(y);
      }
      x["ports"] = ports;
      out.append(x);
    }
    return out;
  }, "RDMA devices seen by libibverbs: ports, GIDs, link layer, peer-memory / dma-buf support");
}
