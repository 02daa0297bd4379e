// What the fabric transport would open, without opening it: the provider and domain libfabric offers for the
// transport's needs (RDM, messages + RMA, GPU memory when asked), its remote CQ data and memory-registration
// modes, and the CQ-data layout the transport would use. `doctor` prints it; the transport uses the same
// selection (fabric.cpp), so what doctor says is what a Buffer gets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace uccl {

struct FabricProbe {
  std::string provider;        // e.g. "efa", "shm", "tcp;ofi_rxm"
  std::string domain;          // e.g. "rdmap16s27-rdm", "lo"
  std::string library_version; // the libfabric loaded at run time, "major.minor"
  std::string api_version;     // the API version the transport asks for (that of the headers it was built with)
  size_t cq_data_size = 0;     // bytes of remote CQ data the provider carries
  int cq_data_bytes = 0;       // what the transport uses: 8 (immediate + rank) or 4 (compact layout)
  bool hmem = false;           // FI_HMEM granted: GPU memory can be registered
  // GPU copies queue on the legacy default stream (Transport::calls_gpu_runtime), known by the provider's
  // name here (no endpoint open); efa without GPUDirect RDMA shows only on an open endpoint
  // (ProxyGroup.calls_gpu_runtime, doctor --peers)
  bool waits_for_default_stream = false;
  uint64_t mr_mode = 0;        // FI_MR_* bits the provider asks for
  size_t max_msg_size = 0;
  size_t inject_size = 0;
};

// Throws with a sentence when no provider fits (naming the provider, what is missing, and what to install or
// set). provider: FI_PROVIDER-style name ("" = libfabric's choice; "tcp" means tcp;ofi_rxm); device: a domain
// name ("" = the first); hmem: GPU memory wanted.
FabricProbe probe_fabric(const std::string& provider, const std::string& device, bool hmem);

}  // namespace uccl
