// Host side of an abort (kErrAborted, common/errors.h): a rank that raises on the host after its node peers may
// have launched their kernels for the same call tells them through the claim/board words the kernels already
// poll (device_utils.cuh): it writes an "aborted" record into its slot of every node rank's board and raises
// their claim words (own included, so its own kernels of the call stop too). The peers' waits see the claim,
// adopt the record (adopt_peer_error) and end; their host raises "rank R aborted 'op'".
//
// The writes go through the copy engine on a stream of their own (non-blocking: no implicit order with the
// legacy default stream), never through a kernel: the peers' spinning kernels may hold every SM (ranks sharing
// a GPU under MPS), and a copy lands while they spin. Included by the buffers' .cu files (needs ErrorRecord).
#pragma once

#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/errors.h"
#include "common/portability.h"
#include "common/raii.h"
#include "kernels/device_utils.cuh"

namespace uccl_ep {

// How long the abort's copies may take before abort() raises instead (they are a few bytes each: seconds mean
// the device or a mapping is broken).
constexpr double kAbortCopyBoundS = 5.0;

// Writes the aborted record of `rank` (global rank; call `op`) into board slot `slot` after each of `claims`
// (every node rank's claim word as mapped in this process, nullptr entries skipped), then raises each claim
// word to 2 (a peer's error). Returns once the copies completed; raises naming `what` when `op` is not one of
// kAbortOps, a copy fails, or they do not complete within kAbortCopyBoundS.
inline void publish_abort(const char* what, int device, const std::vector<int*>& claims, int rank, int slot,
                          const std::string& op) {
  const int op_index = abort_op_index(op);
  if (op_index < 0) {
    std::string known;
    for (int i = 0; i < kNumAbortOps; ++i) known += std::string(i ? ", " : "") + kAbortOps[i];
    UCCL_THROW(what << ": abort: op '" << op << "' is none of the calls an abort names (" << known << ")");
  }
  UCCL_CHECK(slot >= 0 && slot < intranode::kMaxBoard,
             what << ": abort: board slot " << slot << " outside [0, " << intranode::kMaxBoard << ")");
  UCCL_CHECK_GPU(gpuSetDevice(device));
  gpuStream_t raw = nullptr;
  UCCL_CHECK_GPU(gpuStreamCreateWithFlags(&raw, gpuStreamNonBlocking));
  auto stream = uccl::own(raw, [](gpuStream_t s) {
    const gpuError_t e = gpuStreamDestroy(s);
    if (e != gpuSuccess) uccl::warn_release_gpu(e);
  });
  // pageable sources: each async copy stages them before it returns, so locals are safe
  const intranode::ErrorRecord rec{kErrAborted, rank, rank, op_index, 0, 0, 0, 0};
  const int raised = 2;  // a peer's error (report_error's value): the peers adopt the board's record
  for (int* c : claims) {
    if (c == nullptr) continue;
    char* board = reinterpret_cast<char*>(c) + intranode::kBoardRel + slot * sizeof(intranode::ErrorRecord);
    UCCL_CHECK_GPU(gpuMemcpyAsync(board, &rec, sizeof(rec), gpuMemcpyDefault, stream.get()));
  }
  for (int* c : claims)  // after every record (stream order): a raised claim always finds its record
    if (c != nullptr) UCCL_CHECK_GPU(gpuMemcpyAsync(c, &raised, sizeof(raised), gpuMemcpyDefault, stream.get()));
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const gpuError_t e = gpuStreamQuery(stream.get());
    if (e == gpuSuccess) return;
    if (e != gpuErrorNotReady)
      UCCL_THROW(what << ": abort: writing the aborted record into the node peers' buffers failed: "
                      << gpuGetErrorString(e));
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > kAbortCopyBoundS)
      UCCL_THROW(what << ": abort: the copies of the aborted record did not complete within " << kAbortCopyBoundS
                      << " s (the device or a peer mapping is unusable); the peers will time out instead");
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// Who aborted, from a buffer's host error record: (rank, op) when it is an aborted record, else (-1, "").
inline std::pair<int, std::string> abort_source(const void* err_host) {
  if (err_host == nullptr) return {-1, ""};
  const volatile intranode::ErrorRecord* r = static_cast<const volatile intranode::ErrorRecord*>(err_host);
  if (r->code != kErrAborted) return {-1, ""};
  const int op = r->block;
  return {r->rank, op >= 0 && op < kNumAbortOps ? kAbortOps[op] : "the call"};
}

}  // namespace uccl_ep
