// Python bindings for transports: what is compiled in, RDMA device queries (doctor's fallback when
// pyverbs does not load), and the ipc copy agent's entry point (the process the ipc transport spawns).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "transport/fabric_info.h"
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
  m.def("fabric_probe", [](const std::string& provider, const std::string& device, bool hmem) {
    const uccl::FabricProbe p = uccl::probe_fabric(provider, device, hmem);
    py::dict d;
    d["provider"] = p.provider;
    d["domain"] = p.domain;
    d["library_version"] = p.library_version;
    d["api_version"] = p.api_version;
    d["cq_data_size"] = p.cq_data_size;
    d["cq_data_bytes"] = p.cq_data_bytes;
    d["hmem"] = p.hmem;
    d["waits_for_default_stream"] = p.waits_for_default_stream;
    d["mr_mode"] = p.mr_mode;
    d["max_msg_size"] = p.max_msg_size;
    d["inject_size"] = p.inject_size;
    return d;
  }, py::arg("provider") = "", py::arg("device") = "", py::arg("hmem") = false,
        "what the fabric transport would open (provider, domain, CQ data, FI_HMEM); raises the transport's own "
        "sentence when nothing fits");
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
