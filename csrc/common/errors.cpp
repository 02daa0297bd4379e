#include "common/errors.h"

#include <sstream>

#include "kernels/intranode_api.h"  // kShapeFields: the names of the shape header's ints

namespace uccl_ep {
namespace {

// What a phase code says: the user's call, the phase's label, and (for timeouts) what a peer did not do.
// `what` takes the peer's name where "%" stands.
struct PhaseText {
  int phase;
  const char* op;
  const char* label;
  const char* what;
};

constexpr PhaseText kPhases[] = {
    {intranode::kPhaseNotify, "dispatch", "dispatch (notify)", "% never started this dispatch (its counts did not arrive)"},
    {intranode::kPhaseDispatch, "dispatch", "dispatch", "% did not deliver its dispatch rows (it never reached this dispatch, or stopped inside it)"},
    {intranode::kPhaseCombine, "combine", "combine", "% did not send back its combine rows (it never reached this combine, or stopped inside it)"},
    {intranode::kPhaseLayout, "get_dispatch_layout", "get_dispatch_layout", "% did not answer"},
    {internode::kPhaseNotify, "dispatch", "dispatch (notify)", "% never started this dispatch (its counts did not arrive)"},
    {internode::kPhaseDispatchSend, "dispatch", "dispatch (send)", "% never became ready for this dispatch"},
    {internode::kPhaseDispatchForward, "dispatch", "dispatch (forward)", "the dispatch rows from % did not arrive"},
    {internode::kPhaseDispatchCopyOut, "dispatch", "dispatch (copy-out)", "the dispatch rows forwarded by % did not arrive"},
    {internode::kPhaseCombineStage, "combine", "combine (stage)", "% never became ready for this combine"},
    {internode::kPhaseCombineForward, "combine", "combine (forward)", "the combine rows from % did not arrive"},
    {internode::kPhaseCombineReduce, "combine", "combine (reduce)", "the combine rows forwarded by % did not arrive"},
    {low_latency::kPhaseDispatchSend, "low_latency_dispatch", "low_latency_dispatch (send)", "% never became ready for this low_latency_dispatch"},
    {low_latency::kPhaseDispatchRecv, "low_latency_dispatch", "low_latency_dispatch (receive)", "the low_latency_dispatch tokens of % did not arrive"},
    {low_latency::kPhaseCombineSend, "low_latency_combine", "low_latency_combine (send)", "% never became ready for this low_latency_combine"},
    {low_latency::kPhaseCombineRecv, "low_latency_combine", "low_latency_combine (receive)", "the low_latency_combine rows of % did not arrive"},
};

const PhaseText& phase_text(int phase) {
  static constexpr PhaseText unknown{0, "the call", "an unknown phase", "% did not answer"};
  for (const PhaseText& p : kPhases)
    if (p.phase == phase) return p;
  return unknown;
}

bool is_low_latency(int phase) { return phase >= low_latency::kPhaseDispatchSend && phase <= low_latency::kPhaseCombineRecv; }
bool is_internode(int phase) { return phase >= internode::kPhaseNotify && phase <= internode::kPhaseCombineReduce; }

// "rank 3" or, across nodes, "rank 3 (node 1)".
std::string rank_name(int r, const ErrorContext& ctx) {
  std::ostringstream os;
  os << "rank " << r;
  if (ctx.ranks_per_node > 0 && r >= 0) os << " (node " << r / ctx.ranks_per_node << ")";
  return os.str();
}

std::string fill(const char* pattern, const std::string& who) {
  std::string s(pattern);
  const size_t at = s.find('%');
  if (at != std::string::npos) s.replace(at, 1, who);
  return s;
}

// Why a peer usually does not come, by call.
const char* usual_cause(const PhaseText& p) {
  const std::string op(p.op);
  if (op == "combine")
    return "Is every rank calling combine with the handle of the same dispatch? A rank that raised earlier, or "
           "exited, leaves its peers waiting here";
  if (op == "low_latency_dispatch" || op == "low_latency_combine")
    return "Is every rank making the same low-latency calls (the same num_max_dispatch_tokens_per_rank and "
           "num_experts)? A rank that raised earlier, or exited, leaves its peers waiting here";
  return "Is every rank calling dispatch, in the same order of Buffer calls? A rank that raised earlier, or exited, "
         "leaves its peers waiting here";
}

void timeout(std::ostream& os, const ErrorFields& e, const ErrorContext& ctx) {
  const PhaseText& p = phase_text(e.phase);
  const std::string peer = rank_name(e.peer, ctx);
  // where the wait was: a proxy channel, NVLink, or (intranode) a thread block, which only developers need
  const bool channel = is_internode(e.phase) || (is_low_latency(e.phase) && e.block >= 0 && e.peer != e.rank);
  os << rank_name(e.rank, ctx) << " timed out after " << ctx.timeout_s << " s in '" << p.label << "' waiting for "
     << peer;
  if (channel) os << " on channel " << e.block;
  else if (is_low_latency(e.phase)) os << " over NVLink";
  os << ": ";
  if (e.peer == e.rank && !is_low_latency(e.phase) && !is_internode(e.phase))
    os << "this rank's own side blocks did not finish (another kernel may hold the SMs they need, see "
          "docs/intranode.md)";
  else
    os << fill(p.what, peer) << ". " << usual_cause(p);
  if (channel)
    os << "; a dead proxy thread or link stops it too: look for the error " << peer << " raised, and run "
       << "`uccl-ep-train doctor --peers`";
  os << "; raise UCCL_EP_TIMEOUT_S if " << peer << " is only slow";
}

}  // namespace

std::string bad_expert_id(int row, int col, long long value, int num_experts) {
  std::ostringstream os;
  os << "topk_idx[" << row << ", " << col << "] = " << value << " is outside [-1, " << num_experts << ")";
  return os.str();
}

int abort_op_index(const std::string& op) {
  for (int i = 0; i < kNumAbortOps; ++i)
    if (op == kAbortOps[i]) return i;
  return -1;
}

std::string rank_aborted(int rank, const std::string& op, const std::string& message) {
  std::ostringstream os;
  os << "rank " << rank << " aborted '" << op << "': ";
  if (message.empty()) os << "see rank " << rank << "'s log for its error";
  else os << message;
  os << " (it raised on the host after its peers may have started this call, and told them; this Buffer must "
     << "be recreated: destroy it and make a new one on every rank)";
  return os.str();
}

std::string describe_error(const ErrorFields& e, const ErrorContext& ctx) {
  if (e.code == kErrNone) return "";
  const PhaseText& p = phase_text(e.phase);
  const std::string me = rank_name(e.rank, ctx);
  std::ostringstream os;
  bool numbers = true;  // the raw need/have go last (developers); some sentences already say them
  switch (e.code) {
    case kErrTimeout:
      timeout(os, e, ctx);
      break;
    case kErrCapacity:
      os << p.op << " on " << me << ": the buffer of " << rank_name(e.peer, ctx) << " holds " << e.have
         << " rows, the call needs " << e.need << ": the buffer grows only at a host sync, so a call without one "
         << "(num_worst_tokens, a cached dispatch, combine, a CUDA graph) needs a Buffer made with a larger "
         << "num_nvl_bytes";
      numbers = false;
      break;
    case kErrWorstTokens:
      os << "dispatch: " << me << " receives " << e.need << " tokens, more than num_worst_tokens=" << e.have
         << ": pass a num_worst_tokens of at least the most tokens a rank can receive (the number of ranks times "
         << "the most tokens a rank sends always suffices)";
      numbers = false;
      break;
    case kErrBadCounts:
      os << "dispatch on " << me << ": num_tokens_per_rank[" << e.peer << "] = " << e.need
         << " but is_token_in_rank sends " << e.have << " tokens to rank " << e.peer
         << ": pass the num_tokens_per_rank that get_dispatch_layout returned with this is_token_in_rank (found "
         << "on the GPU; UCCL_EP_CHECK_VALUES=1 checks on the host, before any communication)";
      numbers = false;
      break;
    case kErrBadExpert:
      os << bad_expert_id(e.peer, e.block, e.need, e.have) << " on " << me << ": expert ids are -1 (no expert) or "
         << "in [0, num_experts); found on the GPU by " << p.op
         << (e.phase == intranode::kPhaseLayout ? ", which left it out of the counts" : ", which moved nothing for it")
         << " (UCCL_EP_CHECK_VALUES=1 checks on the host, before any communication)";
      numbers = false;
      break;
    case kErrShape:
      os << (e.phase == intranode::kPhaseCombine ? "combine" : "dispatch") << ": ranks disagree on "
         << (e.block >= 0 && e.block < intranode::kShapeInts ? intranode::kShapeFields[e.block] : "the call's shape")
         << ": rank " << e.rank << "=" << e.need << ", rank " << e.peer << "=" << e.have
         << "; every rank must make the same call (hidden size, dtype, top-k, experts, weights given or not)";
      numbers = false;
      break;
    case kErrExpertCapacity:
      os << "dispatch_expert_major: rank " << e.peer << " sends " << e.need << " tokens to local expert " << e.block
         << " of rank " << e.rank << ", more than expert_capacity=" << e.have
         << ": pass a larger expert_capacity, or drop the excess tokens in the router (a capacity factor)";
      numbers = false;
      break;
    case kErrNodeRows:
      os << "dispatch: rank " << e.peer << " sends " << e.need << " tokens to node " << e.block << ", more than the "
         << e.have << " this dispatch without a host sync sized its buffers for (num_worst_tokens, expert_capacity, "
         << "num_max_tokens_per_rank): its num_tokens_per_rdma_rank disagrees with its num_tokens_per_rank; pass "
         << "what get_dispatch_layout returned";
      numbers = false;
      break;
    case kErrBadRow:
      os << p.label << " on " << me << ": a row from " << rank_name(e.peer, ctx) << " that landed here "
         << (e.need == -2 ? "names another source rank"
                          : "names receive row " + std::to_string(e.need) + " on local rank " +
                                std::to_string(e.block) + ", outside the " + std::to_string(e.have) +
                                " rows that rank receives from it")
         << ", and was not forwarded: either that rank's num_tokens_per_rank disagrees with its is_token_in_rank "
         << "(pass what get_dispatch_layout returned; UCCL_EP_CHECK_VALUES=1 checks it on the host), or the row "
         << "was read before its bytes landed or after they were overwritten (a transport fault or a bug in "
         << "uccl_ep_train: please report it with UCCL_EP_TRANSPORT, the provider and `uccl-ep-train doctor`)";
      numbers = false;
      break;
    case kErrRingFull:
      os << me << ": the proxy ring of channel " << e.block << " stayed full for " << ctx.timeout_s << " s in '"
         << p.label << "' (sending to " << rank_name(e.peer, ctx) << "): the proxy thread stopped draining it; "
         << "its own error, if it recorded one, follows; else it is stuck behind a transport or a peer that "
         << "stopped answering (`uccl-ep-train doctor --peers` checks the links)";
      break;
    case kErrExpertFull:
      os << "low_latency_dispatch on " << me << ": expert " << e.peer << " gets " << e.need
         << " rows from this rank, more than num_max_dispatch_tokens_per_rank=" << e.have
         << ": some token lists that expert more than once in topk_idx; the rows past " << e.have
         << " were dropped (give each token distinct experts, or -1)";
      numbers = false;
      break;
    case kErrProxyFailed:
      os << me << ": proxy thread " << e.block << " stopped (a transport error, a peer that is gone, or UCCL_EP_FAULT "
         << "die_after), so every wait on its traffic ended at once instead of at the " << ctx.timeout_s
         << " s deadline; the thread's own error follows (`proxy: ...`: peer, NIC and transport status); "
         << "`uccl-ep-train doctor --peers` checks the links";
      numbers = false;
      break;
    case kErrAborted:
      os << rank_aborted(e.rank, e.block >= 0 && e.block < kNumAbortOps ? kAbortOps[e.block] : "the call", "");
      numbers = false;
      break;
    default:
      os << "unknown error code " << e.code << " on " << me << " in '" << p.label << "': the native module and "
         << "the Python package may come from different builds; rebuild (python setup.py build_ext --inplace)";
  }
  if (e.rank != ctx.reader) os << " [rank " << e.rank << " reported it; rank " << ctx.reader << " stopped with it]";
  if (numbers) {
    os << " (";
    if (!is_internode(e.phase) && !is_low_latency(e.phase) && e.code == kErrTimeout) os << "block " << e.block << ", ";
    os << "need " << e.need << ", have " << e.have << ")";
  }
  return os.str();
}

}  // namespace uccl_ep
