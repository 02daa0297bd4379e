#include "transport/verbs_policy.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace uccl {

GidType gid_type_from_text(const std::string& text) {
  std::string t = text;
  while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.pop_back();
  if (t == "RoCE v2") return GidType::kRoCEv2;
  if (t == "IB/RoCE v1" || t == "RoCE v1") return GidType::kRoCEv1;
  if (t == "IB") return GidType::kIB;
  return GidType::kUnknown;
}

const char* gid_type_name(GidType t) {
  switch (t) {
    case GidType::kIB: return "IB";
    case GidType::kRoCEv1: return "RoCE v1";
    case GidType::kRoCEv2: return "RoCE v2";
    default: return "unknown";
  }
}

std::string gid_to_string(const Gid& g) {
  std::string out;
  char s[8];
  for (int k = 0; k < 16; k += 2) {
    std::snprintf(s, sizeof(s), "%02x%02x%s", g[k], g[k + 1], k < 14 ? ":" : "");
    out += s;
  }
  return out;
}

bool gid_is_zero(const Gid& g) {
  return std::all_of(g.begin(), g.end(), [](uint8_t b) { return b == 0; });
}

bool gid_is_ipv4_mapped(const Gid& g) {
  return std::all_of(g.begin(), g.begin() + 10, [](uint8_t b) { return b == 0; }) && g[10] == 0xff && g[11] == 0xff;
}

bool gid_is_link_local(const Gid& g) { return g[0] == 0xfe && (g[1] & 0xc0) == 0x80; }

namespace {
std::string describe(const std::vector<GidEntry>& table) {
  std::ostringstream os;
  int shown = 0;
  for (const auto& e : table) {
    if (gid_is_zero(e.raw)) continue;
    os << (shown++ ? ", " : "") << e.index << ": " << gid_type_name(e.type) << " " << gid_to_string(e.raw);
  }
  return shown ? os.str() : "all entries empty";
}
}  // namespace

GidChoice choose_gid(const std::vector<GidEntry>& table, bool ethernet, int override_index, const std::string& where) {
  if (override_index >= 0) {
    auto it = std::find_if(table.begin(), table.end(), [&](const GidEntry& e) { return e.index == override_index; });
    if (it == table.end() || gid_is_zero(it->raw))
      throw std::invalid_argument("UCCL_IB_GID_INDEX=" + std::to_string(override_index) + ": GID " +
                                  std::to_string(override_index) + " of " + where +
                                  (it == table.end() ? " does not exist" : " is empty") +
                                  "; unset it to choose automatically or pick one of: " + describe(table));
    return {override_index, std::string("UCCL_IB_GID_INDEX (") + gid_type_name(it->type) + ")"};
  }
  if (!ethernet) return {0, "InfiniBand link layer: GID 0, routed by LID"};
  const GidEntry* best = nullptr;
  int best_rank = 0;
  for (const auto& e : table) {
    if (e.type != GidType::kRoCEv2 || gid_is_zero(e.raw) || gid_is_link_local(e.raw)) continue;
    const int rank = gid_is_ipv4_mapped(e.raw) ? 2 : 1;
    if (rank > best_rank || (rank == best_rank && e.index < best->index)) best = &e, best_rank = rank;
  }
  if (!best)
    throw std::invalid_argument("verbs: " + where + " has no RoCE v2 GID with a routable address (" + describe(table) +
                                "); give its netdev an IPv4 or global IPv6 address, or set UCCL_IB_GID_INDEX to the "
                                "entry to use");
  return {best->index, best_rank == 2 ? "RoCE v2, IPv4-mapped" : "RoCE v2, IPv6 (no IPv4-mapped RoCE v2 entry)"};
}

namespace {
int setting(const std::function<const char*(const char*)>& get, const char* name, int dflt, int lo, int hi,
            const char* what) {
  const char* v = get(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (!end || *end != 0 || x < lo || x > hi) {
    std::ostringstream os;
    os << name << "=" << v << " must be an integer in [" << lo << ", " << hi << "] (" << what << "); unset it for "
       << dflt;
    throw std::invalid_argument(os.str());
  }
  return int(x);
}
}  // namespace

VerbsSettings parse_verbs_settings(const std::function<const char*(const char*)>& get) {
  VerbsSettings d, s;
  s.timeout = setting(get, "UCCL_IB_TIMEOUT", d.timeout, 1, 31, "ACK timeout exponent: 4.096 us * 2^value");
  s.retry_cnt = setting(get, "UCCL_IB_RETRY_CNT", d.retry_cnt, 0, 7, "transport retries");
  s.rnr_retry = setting(get, "UCCL_IB_RNR_RETRY", d.rnr_retry, 0, 7, "receiver-not-ready retries, 7 = forever");
  s.sl = setting(get, "UCCL_IB_SL", d.sl, 0, 15, "InfiniBand service level");
  s.tc = setting(get, "UCCL_IB_TC", d.tc, 0, 255, "traffic class");
  s.gid_index = setting(get, "UCCL_IB_GID_INDEX", d.gid_index, -1, 65535, "GID table entry, -1 = choose");
  return s;
}

VerbsDepths verbs_queue_depths(int world, int max_inflight, const VerbsLimits& lim, const std::string& device) {
  if (world < 1 || max_inflight < 1)
    throw std::invalid_argument("verbs: world (" + std::to_string(world) + ") and the in-flight limit (" +
                                std::to_string(max_inflight) + ") must be >= 1");
  auto fail = [&](const char* limit, long have, const char* need_what, long need) {
    std::ostringstream os;
    os << "verbs: " << device << " allows " << limit << "=" << have << ", the worst case needs " << need << " ("
       << need_what << " with " << world << " ranks and " << max_inflight
       << " operations in flight per destination); lower UCCL_IB_MAX_INFLIGHT_NORMAL / UCCL_IB_MAX_INFLIGHT_LOW_LATENCY";
    throw std::invalid_argument(os.str());
  };
  const long ops = long(world) * max_inflight;  // operations that may be in flight to or from this endpoint
  VerbsDepths d;
  const long recv_need = ops + kRecvHeadroom;
  if (recv_need > lim.max_srq_wr) fail("max_srq_wr", lim.max_srq_wr, "one receive per incoming operation + control", recv_need);
  d.srq = int(recv_need);
  const long cq_need = ops + recv_need;  // one signaled send per operation, one receive completion per arrival
  if (cq_need > lim.max_cqe) fail("max_cqe", lim.max_cqe, "send + receive completions", cq_need);
  d.cq = int(std::min<long>(2 * cq_need, lim.max_cqe));  // headroom: completions polled late
  const long send_need = 2L * max_inflight;                // a native atomic is two WRs
  if (send_need > lim.max_qp_wr) fail("max_qp_wr", lim.max_qp_wr, "send WRs per QP", send_need);
  d.send_wr = int(send_need);
  return d;
}

}  // namespace uccl
