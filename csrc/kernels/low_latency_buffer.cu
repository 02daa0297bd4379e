// LowLatencyBuffer: one rank's low-latency regions (shared: IPC-exported and registered with the proxies;
// local; host flags), its error record, and the launchers of the two LL kernels (low_latency_api.h).
#include <algorithm>
#include <cstring>
#include <sstream>

#include "common/check.h"
#include "kernels/abort.h"
#include "kernels/host_args.h"
#include "kernels/ipc_handles.h"
#include "kernels/low_latency_launch.cuh"

namespace uccl_ep::low_latency {

namespace {

Layout to_layout(const std::vector<int64_t>& v) {
  UCCL_CHECK((int)v.size() == kLayoutFields, "low-latency layout: expected " << kLayoutFields << " fields, got "
                                                                             << v.size());
  Layout l;
  int64_t* f = &l.msg_bytes;  // Layout is kLayoutFields int64 in declaration order
  static_assert(sizeof(Layout) == kLayoutFields * sizeof(int64_t), "Layout is a flat list of int64");
  for (int i = 0; i < kLayoutFields; ++i) f[i] = v[i];
  return l;
}

}  // namespace

LowLatencyBuffer::LowLatencyBuffer(int device, int rank, int num_ranks, int ranks_per_node, int64_t bytes,
                                   int64_t flag_words, int num_blocks, double timeout_s)
    : device_(device), rank_(rank), num_ranks_(num_ranks), ranks_per_node_(ranks_per_node), num_blocks_(num_blocks),
      bytes_(bytes), flag_words_(flag_words), timeout_s_(timeout_s) {
  UCCL_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "low-latency buffer: num_ranks " << num_ranks << " outside [1, "
                                                                                        << kMaxRanks << "]");
  UCCL_CHECK(ranks_per_node >= 1 && ranks_per_node <= kMaxLocal && num_ranks % ranks_per_node == 0,
             "low-latency buffer: ranks_per_node " << ranks_per_node << " must be 1.." << kMaxLocal << " and divide "
                                                   << num_ranks);
  UCCL_CHECK(rank >= 0 && rank < num_ranks, "low-latency buffer: rank " << rank << " outside [0, " << num_ranks << ")");
  UCCL_CHECK(bytes > intranode::kErrorWordsBytes + kCounterBytes && flag_words > 0 && num_blocks > 0,
             "low-latency buffer: bad sizes (region " << bytes << ", flags " << flag_words << ", blocks " << num_blocks
                                                      << ")");
  UCCL_CHECK_GPU(gpuSetDevice(device));
  int sms = 0;
  UCCL_CHECK_GPU(intranode::query_device(device, timeout_s, &sms, &timeout_cycles_));
  try {
    UCCL_CHECK_GPU(gpuMalloc(&buf_, size_t(bytes)));
    UCCL_CHECK_GPU(gpuHostAlloc(&flags_host_, size_t(8 * flag_words), gpuHostAllocMapped | gpuHostAllocPortable));
    UCCL_CHECK_GPU(gpuHostGetDevicePointer(&flags_dev_, flags_host_, 0));
    UCCL_CHECK_GPU(gpuHostAlloc(&err_host_, sizeof(ErrorRecord), gpuHostAllocMapped | gpuHostAllocPortable));
    UCCL_CHECK_GPU(gpuHostGetDevicePointer(&err_dev_, err_host_, 0));
    clean();
    preload_kernels();
  } catch (...) {
    destroy();
    throw;
  }
  peers_[rank % ranks_per_node] = buf_;
}

int64_t LowLatencyBuffer::error_words_bytes() { return intranode::kErrorWordsBytes; }
int64_t LowLatencyBuffer::counter_bytes() { return kCounterBytes; }

LowLatencyBuffer::~LowLatencyBuffer() {
  try {
    destroy();
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "uccl_ep_train native: ~LowLatencyBuffer: %s\n", ex.what());
  }
}

void LowLatencyBuffer::clean() {
  UCCL_CHECK(buf_ != nullptr, "low-latency buffer: destroyed");
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  UCCL_CHECK_GPU(gpuDeviceSynchronize());
  UCCL_CHECK_GPU(gpuMemset(buf_, 0, size_t(bytes_)));
  std::memset(flags_host_, 0, size_t(8 * flag_words_));
  std::memset(err_host_, 0, sizeof(ErrorRecord));
  UCCL_CHECK_GPU(intranode::set_proxy_failure(claim_ptr(), failure_record_));
  if (opened_) UCCL_CHECK_GPU(intranode::set_peer_claims(claim_ptr(), node_claims()));  // the memset cleared it
  UCCL_CHECK_GPU(gpuDeviceSynchronize());
}

std::string LowLatencyBuffer::ipc_handle() const {
  UCCL_CHECK(buf_ != nullptr, "low-latency buffer: destroyed");
  return ipc_handle_bytes(buf_);
}

void LowLatencyBuffer::open_peers(const std::vector<std::string>& handles) {
  UCCL_CHECK(buf_ != nullptr, "low-latency buffer: destroyed");
  UCCL_CHECK(!opened_, "low-latency buffer: peers already opened");
  UCCL_CHECK((int)handles.size() == ranks_per_node_, "low-latency buffer: expected " << ranks_per_node_
                                                                                     << " IPC handles, got " << handles.size());
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  const int me = rank_ % ranks_per_node_, node = rank_ / ranks_per_node_;
  for (int j = 0; j < ranks_per_node_; ++j) {
    if (j == me) continue;
    gpuError_t e = gpuSuccess;
    void* p = ipc_open(handles[j], "low-latency buffer: IPC handle of local rank " + std::to_string(j), &e);
    UCCL_CHECK(p != nullptr, "low-latency buffer: rank " << rank_ << " could not map the buffer of rank "
                                                         << node * ranks_per_node_ + j << " (cudaIpcOpenMemHandle: "
                                                         << gpuGetErrorString(e) << ")");
    peers_[j] = p;
  }
  UCCL_CHECK_GPU(intranode::set_peer_claims(claim_ptr(), node_claims()));
  opened_ = true;
}

void LowLatencyBuffer::set_rings(const std::vector<std::vector<int64_t>>& rings, int64_t failure_record) {
  UCCL_CHECK((int)rings.size() <= kMaxRings, "low-latency buffer: " << rings.size() << " rings; at most " << kMaxRings);
  rings_.clear();
  for (const auto& r : rings) {
    UCCL_CHECK(r.size() == 8, "low-latency buffer: a ring descriptor has 8 fields, got " << r.size());
    int64_t f[8];
    std::copy(r.begin(), r.end(), f);
    rings_.push_back(uccl::ring_desc_from(f));
  }
  failure_record_ = failure_record;
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  UCCL_CHECK_GPU(intranode::set_proxy_failure(claim_ptr(), failure_record_));
}

void LowLatencyBuffer::destroy() {
  gpuError_t first = gpuSuccess;
  auto keep = [&first](gpuError_t e) {
    if (first == gpuSuccess) first = e;
  };
  if (buf_ != nullptr || flags_host_ != nullptr || err_host_ != nullptr) (void)gpuSetDevice(device_);
  const int me = rank_ % ranks_per_node_;
  for (int j = 0; j < kMaxLocal; ++j) {
    if (j != me && peers_[j] != nullptr) keep(ipc_close(peers_[j]));
    peers_[j] = nullptr;
  }
  opened_ = false;
  rings_.clear();
  if (buf_ != nullptr) keep(gpuFree(buf_));
  if (flags_host_ != nullptr) keep(gpuFreeHost(flags_host_));
  if (err_host_ != nullptr) keep(gpuFreeHost(err_host_));
  buf_ = flags_host_ = flags_dev_ = err_host_ = err_dev_ = nullptr;
  if (first != gpuSuccess) UCCL_THROW("low-latency buffer: releasing resources failed: " << gpuGetErrorString(first));
}

std::string LowLatencyBuffer::error() const {
  if (err_host_ == nullptr) return "";
  const volatile ErrorRecord* r = reinterpret_cast<const volatile ErrorRecord*>(err_host_);
  if (r->code <= 0) return "";
  // node names only when the ranks span nodes (one node: plain NVLink ranks)
  const int per_node = ranks_per_node_ < num_ranks_ ? ranks_per_node_ : 0;
  return describe_error(intranode::error_fields(r), ErrorContext{rank_, per_node, timeout_s_});
}

int* LowLatencyBuffer::claim_ptr() const {
  return reinterpret_cast<int*>(static_cast<char*>(buf_) + kClaimOffset);
}

void LowLatencyBuffer::abort(const std::string& op) {
  UCCL_CHECK(buf_ != nullptr, "abort: the low-latency buffer was destroyed");
  publish_abort("low-latency buffer", device_, node_claims(), rank_, rank_ % ranks_per_node_, op);
}

std::vector<int*> LowLatencyBuffer::node_claims() const {
  std::vector<int*> claims;  // by local index; nullptr for a peer not mapped (one rank per node: own only)
  for (int j = 0; j < ranks_per_node_; ++j)
    claims.push_back(peers_[j] == nullptr ? nullptr
                                          : reinterpret_cast<int*>(static_cast<char*>(peers_[j]) + kClaimOffset));
  return claims;
}

std::pair<int, std::string> LowLatencyBuffer::abort_source() const { return uccl_ep::abort_source(err_host_); }

void LowLatencyBuffer::check_ready(const char* what) const {
  UCCL_CHECK(buf_ != nullptr, what << ": the low-latency buffer was destroyed");
  UCCL_CHECK(opened_ || ranks_per_node_ == 1, what << ": the node peers' buffers are not opened yet");
  UCCL_CHECK(num_ranks_ == ranks_per_node_ || !rings_.empty(), what << ": ranks on other nodes but no proxy rings");
}

// What every LL launch of this rank gets for the call's half and phases.
Args LowLatencyBuffer::make_args(const std::vector<int64_t>& layout, int num_experts, int half, int phases,
                                 const char* what) const {
  check_ready(what);
  UCCL_CHECK(phases >= kSendPhase && phases <= (kSendPhase | kRecvPhase), what << ": phases " << phases);
  Args a{};
  a.phases = phases;
  a.lay = to_layout(layout);
  a.rank = rank_;
  a.num_ranks = num_ranks_;
  a.ranks_per_node = ranks_per_node_;
  a.num_experts = num_experts;
  a.num_local = num_experts / num_ranks_;
  a.half = half;
  a.timeout_cycles = timeout_cycles_;
  a.ring_spins = (unsigned long long)(timeout_s_ * 1e6) + 1;  // a host-tail poll is >= ~1 us over PCIe
  a.err = static_cast<ErrorRecord*>(err_dev_);
  a.claim = claim_ptr();
  a.buf = static_cast<char*>(buf_);
  a.host_flags = static_cast<uint64_t*>(flags_dev_);
  for (int j = 0; j < ranks_per_node_; ++j) a.peers[j] = static_cast<char*>(peers_[j]);
  a.rings.n = (int)rings_.size();
  for (size_t i = 0; i < rings_.size(); ++i) a.rings.r[i] = rings_[i];
  return a;
}

void LowLatencyBuffer::dispatch(const std::vector<int64_t>& layout, int64_t x, int64_t topk_idx, int num_tokens,
                                int num_topk, int num_experts, int max_tokens, int hidden, bool use_fp8,
                                bool round_scale, bool use_ue8m0, bool fnuz, int half, int64_t pair_pos, int64_t recv_x,
                                int64_t recv_scales, int64_t src_info, int64_t layout_range, int64_t recv_count,
                                int64_t stats, int phases, int64_t stream) {
  UCCL_CHECK(num_experts <= kMaxExperts && num_experts % num_ranks_ == 0,
             "low_latency_dispatch: num_experts " << num_experts << " must divide by the ranks and be <= "
                                                  << kMaxExperts);
  UCCL_CHECK(num_topk >= 1 && num_topk <= kMaxTopk, "low_latency_dispatch: num_topk " << num_topk << " outside [1, "
                                                                                      << kMaxTopk << "]");
  UCCL_CHECK(hidden % 128 == 0, "low_latency_dispatch: hidden " << hidden << " must be a multiple of 128");
  Args a = make_args(layout, num_experts, half, phases, "low_latency_dispatch");
  a.num_tokens = num_tokens;
  a.num_topk = num_topk;
  a.max_tokens = max_tokens;
  a.hidden = hidden;
  a.x = as_ptr<const char>(x);
  a.topk_idx = as_ptr<const int64_t>(topk_idx);
  a.pair_pos = as_ptr<int>(pair_pos);
  a.use_fp8 = use_fp8;
  a.round_scale = round_scale;
  a.use_ue8m0 = use_ue8m0;
  a.fnuz = fnuz;
  a.recv_x = as_ptr<char>(recv_x);
  a.recv_scales = as_ptr<char>(recv_scales);
  a.src_info = as_ptr<int>(src_info);
  a.layout_range = as_ptr<int64_t>(layout_range);
  a.recv_count = as_ptr<int>(recv_count);
  a.stats = as_ptr<int>(stats);
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  launch_dispatch(a, num_blocks_, as_stream(stream));
}

void LowLatencyBuffer::combine(const std::vector<int64_t>& layout, int64_t x, int64_t layout_range, int64_t topk_idx,
                               int64_t topk_weights, int64_t pair_pos, int num_tokens, int num_topk, int num_experts,
                               int max_tokens, int hidden, int half, int64_t out, int phases, int64_t stream) {
  Args a = make_args(layout, num_experts, half, phases, "low_latency_combine");
  a.num_tokens = num_tokens;
  a.num_topk = num_topk;
  a.max_tokens = max_tokens;
  a.hidden = hidden;
  a.x = as_ptr<const char>(x);
  a.layout_range = as_ptr<int64_t>(layout_range);
  a.topk_idx = as_ptr<const int64_t>(topk_idx);
  a.topk_w = as_ptr<const float>(topk_weights);
  a.pair_pos = as_ptr<int>(pair_pos);
  a.out = as_ptr<char>(out);
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  launch_combine(a, num_blocks_, as_stream(stream));
}

}  // namespace uccl_ep::low_latency
