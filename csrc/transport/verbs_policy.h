// The verbs transport's decisions that need no NIC, as pure functions over plain data: which GID a port
// uses, the QP settings read from UCCL_IB_*, and how deep the CQ / SRQ / send queues must be. The transport
// (verbs.cpp) feeds them what the device reports; CPU tests (tests/test_verbs_policy.py) feed them GID
// tables and limits of real hosts through the `_native.verbs_*` bindings.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace uccl {

using Gid = std::array<uint8_t, 16>;

enum class GidType : uint8_t { kUnknown = 0, kIB, kRoCEv1, kRoCEv2 };

struct GidEntry {
  int index = 0;
  Gid raw{};  // all zero: an empty entry (the kernel has no address there)
  GidType type = GidType::kUnknown;
};

// sysfs ports/N/gid_attrs/types/I text ("IB/RoCE v1", "RoCE v2") -> type; anything else kUnknown.
GidType gid_type_from_text(const std::string& text);
const char* gid_type_name(GidType t);
std::string gid_to_string(const Gid& g);  // 8 colon-separated groups of 4 hex digits
bool gid_is_zero(const Gid& g);
bool gid_is_ipv4_mapped(const Gid& g);  // ::ffff:a.b.c.d
bool gid_is_link_local(const Gid& g);   // fe80::/10

struct GidChoice {
  int index = 0;
  std::string why;  // for the log: what made this entry the one
};

// The GID index a port uses. `ethernet`: RoCE link layer (else InfiniBand: GID 0, traffic routed by LID).
// `override_index` >= 0 is UCCL_IB_GID_INDEX: that entry must exist and be non-zero. Automatic choice on
// RoCE: a RoCE v2 entry with an IPv4-mapped address, else a RoCE v2 IPv6 one that is not link-local, the
// lowest index of the best kind; never a zero GID. `where` names the device and port in errors.
// Throws std::invalid_argument naming the index/device and what to do.
GidChoice choose_gid(const std::vector<GidEntry>& table, bool ethernet, int override_index, const std::string& where);

// QP settings mirroring NCCL's NCCL_IB_* (slurm/launch.sh carries those over). Defaults here, documented in
// uccl_ep_train/config.py SETTINGS (tests/test_verbs_policy.py checks the two agree).
struct VerbsSettings {
  int timeout = 20;    // UCCL_IB_TIMEOUT: local ACK timeout 4.096 us * 2^timeout (20: ~4.3 s), NCCL's default
  int retry_cnt = 7;   // UCCL_IB_RETRY_CNT: transport retries before IBV_WC_RETRY_EXC_ERR (12)
  // UCCL_IB_RNR_RETRY: 7 would retry forever. The SRQ holds every receive the peers can have in flight, so
  // an RNR NAK means this rank's proxy stopped reposting (stalled or dead); 6 retries of kMinRnrTimer
  // (~61 ms in all) turn that into IBV_WC_RNR_RETRY_EXC_ERR naming the peer instead of a silent hang.
  int rnr_retry = 6;
  int sl = 0;          // UCCL_IB_SL: InfiniBand service level
  int tc = 0;          // UCCL_IB_TC: RoCE traffic class (DSCP << 2)
  int gid_index = -1;  // UCCL_IB_GID_INDEX: -1 chooses (choose_gid)
};
// min_rnr_timer encoding 20 = 10.24 ms, the wait between RNR retries (IB spec table 45).
constexpr int kMinRnrTimer = 20;

// Reads the UCCL_IB_* settings through `get` (getenv-like: nullptr or "" = unset). A value that is not an
// integer in range throws std::invalid_argument naming the variable and its range.
VerbsSettings parse_verbs_settings(const std::function<const char*(const char*)>& get);

// Device limits the queue depths must fit (ibv_device_attr).
struct VerbsLimits {
  int max_cqe = 0, max_srq_wr = 0, max_qp_wr = 0;
};
struct VerbsDepths {
  int srq = 0;      // receive WQEs shared by every QP of the endpoint
  int cq = 0;       // send + receive completions
  int send_wr = 0;  // per QP
};
// Receives left for control traffic on top of the data worst case, and the floor of the SRQ.
constexpr int kRecvHeadroom = 256;
// Depths for one endpoint (one proxy thread) talking to `world` ranks with at most `max_inflight`
// operations in flight per destination (the proxy's UCCL_IB_MAX_INFLIGHT_*): every operation - write,
// emulated atomic, barrier marker - consumes one receive at the peer, and a native atomic posts two send
// WRs. The worst case must fit the device; above it the depths take the headroom the device allows.
// Throws std::invalid_argument naming the limit, the worst case and what to lower.
VerbsDepths verbs_queue_depths(int world, int max_inflight, const VerbsLimits& lim, const std::string& device);

}  // namespace uccl
