// The ipc transport's copy agent: the emulated NIC's DMA engine, in a process of its own.
//
// Why a process: a copy the proxy thread issued on a stream of the rank's own process shares that process's
// hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS of them, shared by all its streams; one under Megatron's
// usual setting). A queue is FIFO: a copy or kernel that the application queued behind an internode kernel
// (which spins until the proxies' copies land) blocks every later entry of the same queue, the proxy's copy
// included, and the ranks deadlock. A real NIC has no such tie to the GPU's queues; a separate process (a
// separate MPS client, with queues of its own) restores that independence. Measured on one H100 under MPS:
// with the copies in-process, ops queued back to back hang as soon as the application queues a host-to-device
// copy behind them, and every op hangs with CUDA_DEVICE_MAX_CONNECTIONS=1.
//
// Protocol: one POSIX shared-memory segment per transport endpoint (proxy thread), created by the client
// (IpcTransport), mapped by the agent it spawns. Requests go through a single-producer single-consumer ring;
// the agent finishes them in order and publishes how many are done (copies complete in stream order, so one
// counter is the whole completion queue). The agent exits when asked, when its parent dies, or on an error,
// which it writes into the segment for the client to report.
#pragma once

#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "common/portability.h"

namespace uccl {

// A GPU region as its owner exports it (the ipc transport's memory key).
struct IpcKey {
  int32_t pid;
  int32_t device;  // 1: GPU memory, 0: host memory (not reachable through the agent)
  uint64_t ptr;    // region pointer in the owner's address space
  uint64_t base;   // allocation base (ipc handles name whole allocations)
  uint64_t size;
  gpuIpcMemHandle_t handle;
};

struct AgentRequest {
  enum Kind : uint32_t { kOpen = 1, kCopy = 2, kStop = 3 };
  uint32_t kind;
  uint32_t dst_slot;  // kOpen: the slot to map; kCopy: destination slot
  uint32_t src_slot;  // kCopy
  uint32_t pad;
  uint64_t dst_off, src_off, len;
  IpcKey key;  // kOpen
};

// The agent's whole main: maps segment `name`, serves it on `gpu`, returns the process exit code.
int run_copy_agent(const std::string& name, int gpu, pid_t parent);

struct AgentSegment;

// Client side: spawns the agent (this interpreter running the native module's `ipc_copy_agent`) and feeds it.
// Tickets number requests from 1; ticket t is finished once done() >= t.
class CopyAgent {
 public:
  CopyAgent(const std::string& name, int gpu);
  CopyAgent(const CopyAgent&) = delete;
  CopyAgent& operator=(const CopyAgent&) = delete;
  ~CopyAgent() { stop(); }

  uint64_t open(uint32_t slot, const IpcKey& key);
  uint64_t copy(uint32_t dst_slot, uint64_t dst_off, uint32_t src_slot, uint64_t src_off, uint64_t len);
  // Requests finished so far; throws with the agent's message when it failed or died.
  uint64_t done();
  // Waits until ticket `t` is finished (throws after `timeout`, naming `what`).
  void wait(uint64_t t, std::chrono::duration<double> timeout, const char* what);
  // Asks the agent to finish what it has and exit; kills it after 10 s. Idempotent.
  void stop();

 private:
  uint64_t push(const AgentRequest& r);
  [[noreturn]] void fail(const std::string& why);
  void check_alive();

  std::string name_;
  AgentSegment* seg_ = nullptr;
  size_t bytes_ = 0;
  pid_t pid_ = -1;
  uint64_t head_ = 0;
  std::chrono::steady_clock::time_point next_alive_check_{};
};

}  // namespace uccl

#endif
