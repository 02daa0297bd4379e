// Host side of CUDA/HIP IPC for the NVLink/xGMI buffers: a buffer's handle as the bytes ranks exchange, and
// the mapping of a peer's buffer from those bytes (the intranode and internode buffers both use them).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/check.h"
#include "common/portability.h"

namespace uccl_ep {

// Peer mappings this process holds (ipc_open minus ipc_close): leak tests read it (`_native.ipc_mappings_open`).
inline std::atomic<int64_t>& ipc_mappings() {
  static std::atomic<int64_t> n{0};
  return n;
}

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
  if (*err != gpuSuccess) return nullptr;
  ipc_mappings().fetch_add(1);
  return p;
}

// Unmaps a mapping ipc_open returned.
inline gpuError_t ipc_close(void* p) {
  ipc_mappings().fetch_sub(1);
  return gpuIpcCloseMemHandle(p);
}

}  // namespace uccl_ep
