// RDMA device discovery through libibverbs (doctor's fallback when pyverbs does not load).
#pragma once

#include <string>
#include <vector>

namespace uccl {

struct VerbsPort {
  int port = 0;
  std::string state;       // PORT_ACTIVE, PORT_DOWN, ...
  std::string link_layer;  // InfiniBand / Ethernet
  int active_mtu = 0;
  int lid = 0;
  std::string speed;
  std::vector<std::string> gids;  // non-zero GIDs, "index:gid"
};

struct VerbsDevice {
  std::string name, node_guid, transport, fw_ver, atomic_cap, error;
  int vendor_id = 0, vendor_part_id = 0, max_qp = 0;
  bool dmabuf = false;       // ibv_reg_dmabuf_mr symbol present in this libibverbs
  bool peer_memory = false;  // nvidia-peermem / amdgpu peer-memory client loaded
  std::vector<VerbsPort> ports;
};

bool verbs_compiled();
std::vector<VerbsDevice> query_verbs_devices();

}  // namespace uccl
