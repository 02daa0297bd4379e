#include "transport/transport.h"
#include "common/check.h"
namespace uccl {
std::unique_ptr<Transport> make_ipc_transport(const TransportOptions&) {
  UCCL_THROW("ipc transport not compiled in: it needs CUDA or HIP (nvcc/hipcc at build time)");
}
}  // namespace uccl
