// Host side of CUDA/HIP IPC for the NVLink/xGMI buffers: a buffer's handle as the bytes ranks exchange, and
// the mapping of a peer's buffer from those bytes (the intranode and internode buffers both use them).
#pragma once

#include <cstring>
#include <string>

#include "common/check.h"
#include "common/portability.h"

namespace uccl_ep {

// The IPC handle of the allocation starting at `base`, as bytes.
inline std::string ipc_handle_bytes(void* base) {
  gpuIpcMemHandle_t h;
  UCCL_CHECK_GPU(gpuIpcGetMemHandle(&h, base));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

// Maps the buffer whose handle bytes are `bytes` (`what` names them in the error on a malformed handle).
// Returns the mapping, or nullptr with *err set when the driver refuses: the caller cleans up and reports.
inline void* ipc_open(const std::string& bytes, const std::string& what, gpuError_t* err) {
  UCCL_CHECK(bytes.size() == sizeof(gpuIpcMemHandle_t), what << " has the wrong size");
  gpuIpcMemHandle_t h;
  std::memcpy(&h, bytes.data(), sizeof(h));
  void* p = nullptr;
  *err = gpuIpcOpenMemHandle(&p, h, gpuIpcMemLazyEnablePeerAccess);
  return *err == gpuSuccess ? p : nullptr;
}

}  // namespace uccl_ep
