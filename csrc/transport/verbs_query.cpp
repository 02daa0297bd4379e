#include "transport/verbs_query.h"

#include <fstream>
#include <sstream>

#if defined(UCCL_EP_WITH_VERBS)
#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <cstdio>
#endif

namespace uccl {

namespace {
bool peer_memory_loaded() {
  std::ifstream f("/proc/modules");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("nvidia_peermem ", 0) == 0 || line.rfind("nv_peer_mem ", 0) == 0 || line.rfind("amdgpu ", 0) == 0 ||
        line.rfind("ib_peer_mem ", 0) == 0)
      return true;
  return false;
}
}  // namespace

#if defined(UCCL_EP_WITH_VERBS)
bool verbs_compiled() { return true; }

std::vector<VerbsDevice> query_verbs_devices() {
  std::vector<VerbsDevice> out;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list) return out;
  const bool dmabuf = dlsym(RTLD_DEFAULT, "ibv_reg_dmabuf_mr") != nullptr;
  const bool peer = peer_memory_loaded();
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
        for (int g = 0; g < pa.gid_tbl_len && g < 16; ++g) {
          ibv_gid gid{};
          if (ibv_query_gid(ctx, uint8_t(p), g, &gid) != 0) break;
          bool zero = true;
          for (int k = 0; k < 16; ++k) zero = zero && gid.raw[k] == 0;
          if (zero) continue;
          char s[64];
          std::snprintf(s, sizeof(s), "%d:", g);
          std::string str(s);
          for (int k = 0; k < 16; k += 2) {
            std::snprintf(s, sizeof(s), "%02x%02x%s", gid.raw[k], gid.raw[k + 1], k < 14 ? ":" : "");
            str += s;
          }
          port.gids.push_back(str);
        }
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
std::vector<VerbsDevice> query_verbs_devices() {
  (void)peer_memory_loaded;
  return {};
}
#endif

}  // namespace uccl
