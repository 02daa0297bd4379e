#include "transport/transport.h"

#include "common/check.h"

namespace uccl {

std::unique_ptr<Transport> make_fabric_transport(const TransportOptions& o);
std::unique_ptr<Transport> make_ipc_transport(const TransportOptions& o);
std::unique_ptr<Transport> make_verbs_transport(const TransportOptions& o);

std::unique_ptr<Transport> make_transport(const std::string& kind, const TransportOptions& o) {
  if (kind == "fabric") return make_fabric_transport(o);
  if (kind == "ipc") return make_ipc_transport(o);
  if (kind == "verbs") return make_verbs_transport(o);
  UCCL_THROW("unknown transport '" << kind << "' (known: fabric, ipc, verbs)");
}

std::vector<std::string> compiled_transports() {
  std::vector<std::string> v;
#if defined(UCCL_EP_WITH_FABRIC)
  v.push_back("fabric");
#endif
#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)
  v.push_back("ipc");
#endif
#if defined(UCCL_EP_WITH_VERBS)
  v.push_back("verbs");
#endif
  return v;
}

}  // namespace uccl
