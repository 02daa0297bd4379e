// The one home of the kernels' error records on the host side: the codes and phases a record can carry
// (shared by the intranode, internode and low-latency kernels, which include this header) and the sentence
// each one becomes for the user (describe_error). Plain C++ (no GPU headers): the host-only build compiles
// it too, so the sentences are unit-tested without a GPU (`_native.describe_error`, tests/test_errors.py).
//
// A record is (code, rank, peer, block, phase, need, have): `rank` found it, about `peer`, in `block` (a
// channel on the proxied paths, a thread block otherwise, the shape field of kErrShape, the top-k column of
// kErrBadExpert), during `phase`; need/have are the numbers compared (a signal's target and value, rows
// needed and rows that fit, ...). Phase codes differ across the three paths, so a phase alone names the path.
#pragma once

#include <string>

namespace uccl_ep {

// ErrorRecord::code. kErrBadCounts: num_tokens_per_rank[peer] = need, is_token_in_rank sends have.
// kErrBadExpert: topk_idx[peer, block] = need, outside [-1, have). Both are the GPU's value checks (the host's
// are opt-in). kErrShape: field `block` of the call's shape is `need` here and `have` on rank `peer` (checked
// on the GPU when no host sync checks it). kErrExpertCapacity: rank `peer` sends `need` tokens to local expert
// `block`, more than the expert_capacity `have` of an expert-major dispatch. kErrNodeRows: rank `peer` sends
// `need` tokens to node `block`, more than the `have` a dispatch without a host sync sized the buffers for.
// kErrBadRow: a dispatch row that landed from rank `peer` names receive position `need` on local rank `block`,
// outside the `have` rows that rank receives from it (or `need` = -2: it names another source rank): a row read
// before its bytes landed or after they were overwritten, or counts that disagree with is_token_in_rank under
// trusted values; it is not forwarded (no write lands out of range).
enum ErrorCode : int {
  kErrNone = 0,
  kErrTimeout = 1,
  kErrCapacity = 2,
  kErrWorstTokens = 3,
  kErrBadCounts = 4,
  kErrBadExpert = 5,
  kErrShape = 6,
  kErrExpertCapacity = 7,
  kErrNodeRows = 8,
  kErrBadRow = 9,
  kErrRingFull = 10,    // a proxy ring stayed full for the whole timeout (proxy thread dead or stuck)
  kErrExpertFull = 11,  // low latency: more than max_tokens rows for one expert from one rank (repeated ids)
  kErrAborted = 12,     // rank `rank` raised on the host inside call kAbortOps[block] (abort(), kernels/abort.h)
  kErrProxyFailed = 13,  // proxy thread `block` of rank `rank` stopped (transport error, dead peer, die_after fault)
};

// The calls an abort names (kErrAborted's `block` indexes them): the Buffer's collective calls.
constexpr const char* kAbortOps[] = {"get_dispatch_layout",  "dispatch",           "combine",
                                     "dispatch_expert_major", "combine_expert_major", "low_latency_dispatch",
                                     "low_latency_combine"};
constexpr int kNumAbortOps = sizeof(kAbortOps) / sizeof(kAbortOps[0]);
// kAbortOps' index of `op`; -1 when it names none of them.
int abort_op_index(const std::string& op);

namespace intranode {
enum Phase : int { kPhaseNotify = 1, kPhaseDispatch = 2, kPhaseCombine = 3, kPhaseLayout = 4 };
}  // namespace intranode

namespace internode {
enum Phase : int {
  kPhaseNotify = 11,
  kPhaseDispatchSend = 12,
  kPhaseDispatchForward = 13,
  kPhaseDispatchCopyOut = 14,
  kPhaseCombineStage = 15,
  kPhaseCombineForward = 16,
  kPhaseCombineReduce = 17,
};
}  // namespace internode

namespace low_latency {
enum Phase : int { kPhaseDispatchSend = 31, kPhaseDispatchRecv = 32, kPhaseCombineSend = 33, kPhaseCombineRecv = 34 };
}  // namespace low_latency

struct ErrorFields {
  int code = 0, rank = 0, peer = 0, block = 0, phase = 0, need = 0, have = 0;
};

// The record itself, as it lies in memory both sides read: a buffer's error record and board slots (pinned or
// device memory the kernels write, kernels/device_utils.cuh) and the proxies' failure record (pinned host
// memory a stopping proxy thread fills and every kernel wait polls, Proxy::record_failure). `code` is written
// last, after a fence: a reader that sees it sees the other fields.
struct ErrorRecord {
  int code, rank, peer, block, phase, need, have, pad;
};

// A record as the host reads it (memory another writer fills) -> the fields describe_error takes.
inline ErrorFields error_fields(const volatile ErrorRecord* r) {
  ErrorFields f;
  f.code = r->code;
  f.rank = r->rank;
  f.peer = r->peer;
  f.block = r->block;
  f.phase = r->phase;
  f.need = r->need;
  f.have = r->have;
  return f;
}

// What the reader of a record knows beyond it.
struct ErrorContext {
  int reader = 0;          // the rank whose buffer holds the record (a peer's report, adopted, names another)
  int ranks_per_node = 0;  // > 0 when the ranks span nodes: ranks are then named with their node
  double timeout_s = 0;    // UCCL_EP_TIMEOUT_S as the kernels were given it
};

// The record as a sentence: what was being waited for (or found), from whom, why that usually happens and
// what to do; the raw numbers last, in parentheses. "" for kErrNone.
std::string describe_error(const ErrorFields& e, const ErrorContext& ctx);

// "topk_idx[row, col] = value is outside [-1, num_experts)": the words the host's check uses too
// (uccl_ep_train/validation.py), so every backend names a bad expert id alike.
std::string bad_expert_id(int row, int col, long long value, int num_experts);

// kErrAborted's sentence: "rank R aborted 'op': <message>; ..." (`message` empty: "see rank R's log");
// uccl_ep_train/errors.py builds the same with the message the aborting rank left in the store.
std::string rank_aborted(int rank, const std::string& op, const std::string& message);

}  // namespace uccl_ep
