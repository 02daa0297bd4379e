#include "transport/verbs_query.h"

#include <fstream>
#include <sstream>

#if defined(UCCL_EP_WITH_VERBS)
#include <dlfcn.h>
#include <infiniband/verbs.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#endif

namespace uccl {

bool nvidia_peer_memory_loaded() {
  std::ifstream f("/proc/modules");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("nvidia_peermem ", 0) == 0 || line.rfind("nv_peer_mem ", 0) == 0) return true;
  return false;
}

#if defined(UCCL_EP_WITH_VERBS)
bool verbs_compiled() { return true; }

std::vector<GidEntry> read_gid_table(ibv_context* ctx, const std::string& ibdev_path, int port, int table_len,
                                     bool ethernet) {
  std::vector<GidEntry> out;
  for (int i = 0; i < table_len && i < 1024; ++i) {
    GidEntry e;
    e.index = i;
    ibv_gid gid{};
    if (ibv_query_gid(ctx, uint8_t(port), i, &gid) != 0) continue;  // unreadable: as good as empty
    std::memcpy(e.raw.data(), gid.raw, 16);
    if (!ethernet) {
      e.type = GidType::kIB;
    } else {
      std::ifstream t(ibdev_path + "/ports/" + std::to_string(port) + "/gid_attrs/types/" + std::to_string(i));
      std::string text;
      if (t && std::getline(t, text)) e.type = gid_type_from_text(text);
    }
    out.push_back(e);
  }
  return out;
}

std::vector<VerbsDevice> query_verbs_devices() {
  std::vector<VerbsDevice> out;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list) return out;
  const bool dmabuf = dlsym(RTLD_DEFAULT, "ibv_reg_dmabuf_mr") != nullptr;
  const bool peer = nvidia_peer_memory_loaded();
  for (int i = 0; i < n; ++i) {
    VerbsDevice d;
    d.name = ibv_get_device_name(list[i]);
    char guid[32];
    std::snprintf(guid, sizeof(guid), "%016llx", (unsigned long long)be64toh(ibv_get_device_guid(list[i])));
    d.node_guid = guid;
    d.transport = list[i]->transport_type == IBV_TRANSPORT_IB ? "IB" : (list[i]->transport_type == IBV_TRANSPORT_IWARP ? "iWARP" : "other");
    d.dmabuf = dmabuf;
    d.peer_memory = peer;
    ibv_context* ctx = ibv_open_device(list[i]);
    if (!ctx) {
      d.error = "ibv_open_device failed";
      out.push_back(d);
      continue;
    }
    ibv_device_attr a{};
    if (ibv_query_device(ctx, &a) == 0) {
      d.vendor_id = int(a.vendor_id);
      d.vendor_part_id = int(a.vendor_part_id);
      d.fw_ver = a.fw_ver;
      d.max_qp = a.max_qp;
      d.atomic_cap = a.atomic_cap == IBV_ATOMIC_NONE ? "none" : (a.atomic_cap == IBV_ATOMIC_HCA ? "hca" : "glob");
      for (int p = 1; p <= a.phys_port_cnt; ++p) {
        ibv_port_attr pa{};
        if (ibv_query_port(ctx, uint8_t(p), &pa) != 0) continue;
        VerbsPort port;
        port.port = p;
        port.state = ibv_port_state_str(pa.state);
        port.link_layer = pa.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand";
        port.active_mtu = 128 << int(pa.active_mtu);
        port.lid = pa.lid;
        std::ostringstream sp;
        sp << "width " << int(pa.active_width) << " speed " << int(pa.active_speed);
        port.speed = sp.str();
        const bool eth = pa.link_layer == IBV_LINK_LAYER_ETHERNET;
        for (const GidEntry& e : read_gid_table(ctx, list[i]->ibdev_path, p, std::min(pa.gid_tbl_len, 16), eth))
          if (!gid_is_zero(e.raw))
            port.gids.push_back(std::to_string(e.index) + ":" + gid_type_name(e.type) + ":" + gid_to_string(e.raw));
        d.ports.push_back(port);
      }
    } else {
      d.error = "ibv_query_device failed";
    }
    ibv_close_device(ctx);
    out.push_back(d);
  }
  ibv_free_device_list(list);
  return out;
}
#else
bool verbs_compiled() { return false; }
std::vector<VerbsDevice> query_verbs_devices() { return {}; }
#endif

}  // namespace uccl
