#include "transport/transport.h"
#include "common/check.h"
namespace uccl {
std::unique_ptr<Transport> make_verbs_transport(const TransportOptions&) {
  UCCL_THROW("verbs transport not compiled in: install libibverbs-dev (infiniband/verbs.h) and rebuild");
}
}  // namespace uccl
