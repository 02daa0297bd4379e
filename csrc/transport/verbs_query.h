// RDMA device discovery through libibverbs (doctor's fallback when pyverbs does not load).
#pragma once

#include <string>
#include <vector>

#include "transport/verbs_policy.h"

struct ibv_context;

namespace uccl {

struct VerbsPort {
  int port = 0;
  std::string state;       // PORT_ACTIVE, PORT_DOWN, ...
  std::string link_layer;  // InfiniBand / Ethernet
  int active_mtu = 0;
  int lid = 0;
  std::string speed;
  std::vector<std::string> gids;  // non-zero GIDs, "index:type:gid" (type: RoCE v2, RoCE v1, IB, unknown)
};

struct VerbsDevice {
  std::string name, node_guid, transport, fw_ver, atomic_cap, error;
  int vendor_id = 0, vendor_part_id = 0, max_qp = 0;
  bool dmabuf = false;       // ibv_reg_dmabuf_mr symbol present in this libibverbs
  bool peer_memory = false;  // an NVIDIA peer-memory client (nvidia_peermem / nv_peer_mem) is loaded
  std::vector<VerbsPort> ports;
};

bool verbs_compiled();
std::vector<VerbsDevice> query_verbs_devices();

// True when /proc/modules lists nvidia_peermem or nv_peer_mem: ibv_reg_mr then takes CUDA pointers. AMD
// GPUs have no such client on upstream drivers (amdgpu is the GPU driver, not one): they go through DMA-BUF.
bool nvidia_peer_memory_loaded();

#if defined(UCCL_EP_WITH_VERBS)
// The GID table of `port` (up to 1024 entries): addresses through ibv_query_gid (an empty entry reads as
// zeros), types from sysfs <ibdev_path>/ports/<port>/gid_attrs/types/<i> (kUnknown where unreadable; IB
// link layer: kIB).
std::vector<GidEntry> read_gid_table(ibv_context* ctx, const std::string& ibdev_path, int port, int table_len,
                                     bool ethernet);
#endif

}  // namespace uccl
