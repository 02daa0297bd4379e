// Python bindings for transports: what is compiled in, RDMA device queries (doctor's fallback when
// pyverbs does not load), the verbs transport's NIC-free decisions (GID choice, UCCL_IB_* settings, queue
// depths: verbs_policy.h, for CPU tests), and the ipc copy agent's entry point (the process the ipc
// transport spawns).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <tuple>

#include "bindings.h"
#include "transport/fabric_info.h"
#include "transport/ipc_agent.h"
#include "transport/transport.h"
#include "transport/verbs_policy.h"
#include "transport/verbs_query.h"

namespace py = pybind11;

namespace {
void register_verbs_policy(py::module_& m) {
  m.def("verbs_choose_gid",
        [](const std::vector<std::tuple<int, py::bytes, std::string>>& table, bool ethernet, int override_index,
           const std::string& where) {
          std::vector<uccl::GidEntry> t;
          for (const auto& [index, raw, type] : table) {
            const std::string b = raw;
            if (b.size() != 16) throw py::value_error("verbs_choose_gid: GID " + std::to_string(index) + " is not 16 bytes");
            uccl::GidEntry e;
            e.index = index;
            std::copy(b.begin(), b.end(), e.raw.begin());
            e.type = uccl::gid_type_from_text(type);
            t.push_back(e);
          }
          const uccl::GidChoice c = uccl::choose_gid(t, ethernet, override_index, where);
          return py::make_tuple(c.index, c.why);
        },
        py::arg("table"), py::arg("ethernet"), py::arg("override_index") = -1, py::arg("where") = "device",
        "the GID index the verbs transport uses for a port's table [(index, 16 raw bytes, sysfs type text)]; "
        "ValueError when none fits");
  m.def("verbs_settings",
        [](const std::map<std::string, std::string>& env) {
          const uccl::VerbsSettings s = uccl::parse_verbs_settings([&](const char* n) -> const char* {
            auto it = env.find(n);
            return it == env.end() ? nullptr : it->second.c_str();
          });
          py::dict d;
          d["UCCL_IB_TIMEOUT"] = s.timeout;
          d["UCCL_IB_RETRY_CNT"] = s.retry_cnt;
          d["UCCL_IB_RNR_RETRY"] = s.rnr_retry;
          d["UCCL_IB_SL"] = s.sl;
          d["UCCL_IB_TC"] = s.tc;
          d["UCCL_IB_GID_INDEX"] = s.gid_index;
          return d;
        },
        py::arg("env"), "the UCCL_IB_* QP settings the verbs transport reads from `env`; ValueError naming a bad one");
  m.def("verbs_queue_depths",
        [](int world, int max_inflight, int max_cqe, int max_srq_wr, int max_qp_wr, const std::string& device) {
          const uccl::VerbsDepths d = uccl::verbs_queue_depths(world, max_inflight, {max_cqe, max_srq_wr, max_qp_wr}, device);
          py::dict out;
          out["srq"] = d.srq;
          out["cq"] = d.cq;
          out["send_wr"] = d.send_wr;
          return out;
        },
        py::arg("world"), py::arg("max_inflight"), py::arg("max_cqe"), py::arg("max_srq_wr"), py::arg("max_qp_wr"),
        py::arg("device") = "device",
        "CQ / SRQ / send-queue depths of one verbs endpoint; ValueError when the device cannot hold the worst case");
}
}  // namespace

void register_transport(py::module_& m) {
  m.def("compiled_transports", &uccl::compiled_transports, "transports compiled into this build");
  m.attr("WITH_VERBS") = uccl::verbs_compiled();
  register_verbs_policy(m);
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
