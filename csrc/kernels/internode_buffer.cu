// InternodeBuffer: one rank's NVL buffer (IPC-shared in its node), RDMA region and flag region (both
// registered with the CPU proxies by Python), and the launchers of the internode ops (internode_api.h).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <thread>

#include "common/check.h"
#include "kernels/abort.h"
#include "kernels/host_args.h"
#include "kernels/internode_launch.cuh"
#include "kernels/ipc_handles.h"
#include "kernels/launch.cuh"

namespace uccl_ep::internode {

// dispatch_row_bytes, combine_row_bytes, count_row_ints, make_layout: layouts.cpp

InternodeBuffer::InternodeBuffer(int device, int rank, int num_ranks, int ranks_per_node, int64_t nvl_bytes,
                                 int64_t rdma_bytes, double timeout_s)
    : device_(device), rank_(rank), num_ranks_(num_ranks), ranks_per_node_(ranks_per_node), timeout_s_(timeout_s) {
  UCCL_CHECK(num_ranks >= 2 && num_ranks <= kMaxRanks, "internode buffer: num_ranks " << num_ranks << " outside [2, "
                                                                                      << kMaxRanks << "]");
  UCCL_CHECK(ranks_per_node >= 1 && ranks_per_node <= kMaxLocal && num_ranks % ranks_per_node == 0,
             "internode buffer: ranks_per_node " << ranks_per_node << " must be 1.." << kMaxLocal << " and divide "
                                                 << num_ranks);
  UCCL_CHECK(rank >= 0 && rank < num_ranks, "internode buffer: rank " << rank << " outside [0, " << num_ranks << ")");
  num_nodes_ = num_ranks / ranks_per_node;
  UCCL_CHECK(num_nodes_ <= kMaxNodes, "internode buffer: " << num_nodes_ << " nodes; at most " << kMaxNodes);
  node_ = rank / ranks_per_node;
  local_ = rank % ranks_per_node;
  nvl_bytes_ = std::max(nvl_bytes, kNvlHeaderBytes + (int64_t(1) << 20));
  UCCL_CHECK_GPU(gpuSetDevice(device));
  UCCL_CHECK_GPU(intranode::query_device(device, timeout_s, &num_device_sms_, &timeout_cycles_));
  try {
    UCCL_CHECK_GPU(gpuMalloc(&nvl_, (size_t)nvl_bytes_));
    UCCL_CHECK_GPU(gpuMemset(nvl_, 0, (size_t)nvl_bytes_));  // barrier words start at 0 before peers map it
    const size_t fb = (size_t)flag_bytes();
    UCCL_CHECK_GPU(gpuHostAlloc(&flags_host_, fb, gpuHostAllocMapped | gpuHostAllocPortable));
    std::memset(flags_host_, 0, fb);
    UCCL_CHECK_GPU(gpuHostGetDevicePointer(&flags_dev_, flags_host_, 0));
    UCCL_CHECK_GPU(gpuHostAlloc(&err_host_, sizeof(ErrorRecord), gpuHostAllocMapped | gpuHostAllocPortable));
    std::memset(err_host_, 0, sizeof(ErrorRecord));
    UCCL_CHECK_GPU(gpuHostGetDevicePointer(&err_dev_, err_host_, 0));
    alloc_rdma(rdma_bytes);
    gpuEvent_t ev;
    UCCL_CHECK_GPU(gpuEventCreateWithFlags(&ev, gpuEventDisableTiming));
    notified_ = ev;
    gpuStream_t st;
    UCCL_CHECK_GPU(gpuStreamCreateWithFlags(&st, gpuStreamNonBlocking));
    copy_stream_ = st;
    preload_kernels();
    UCCL_CHECK_GPU(gpuDeviceSynchronize());
  } catch (...) {
    destroy();
    throw;
  }
  peers_[local_] = nvl_;
}

InternodeBuffer::~InternodeBuffer() {
  try {
    destroy();
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "uccl_ep_train native: ~InternodeBuffer: %s\n", ex.what());
  }
}

int64_t InternodeBuffer::nvl_recv_off() const { return kNvlHeaderBytes; }
int64_t InternodeBuffer::nvl_stage_off() const { return kNvlHeaderBytes + (nvl_bytes_ - kNvlHeaderBytes) / 512 * 256; }

int64_t InternodeBuffer::flag_bytes() const { return 8 * flag_words(num_ranks_, num_nodes_); }

void InternodeBuffer::alloc_rdma(int64_t bytes) {
  UCCL_CHECK(bytes > 0 && bytes <= kMaxRdmaBytes, "internode buffer: num_rdma_bytes " << bytes
                                                                                      << " must be in (0, 4 GiB)");
  UCCL_CHECK_GPU(gpuMalloc(&rdma_, (size_t)bytes));
  UCCL_CHECK_GPU(gpuMemset(rdma_, 0, (size_t)bytes));
  rdma_bytes_ = bytes;
}

void InternodeBuffer::resize_rdma(int64_t bytes) {
  UCCL_CHECK(nvl_ != nullptr, "internode buffer: destroyed");
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  UCCL_CHECK_GPU(gpuDeviceSynchronize());
  if (rdma_ != nullptr) UCCL_CHECK_GPU(gpuFree(rdma_));
  rdma_ = nullptr;
  rings_.clear();  // the proxies over the old region are gone
  alloc_rdma(bytes);
}

std::string InternodeBuffer::ipc_handle() const {
  UCCL_CHECK(nvl_ != nullptr, "internode buffer: destroyed");
  return ipc_handle_bytes(nvl_);
}

void InternodeBuffer::open_peers(const std::vector<std::string>& handles) {
  UCCL_CHECK(nvl_ != nullptr, "internode buffer: destroyed");
  UCCL_CHECK(!opened_, "internode buffer: peers already opened");
  UCCL_CHECK((int)handles.size() == ranks_per_node_, "internode buffer: expected " << ranks_per_node_
                                                                                   << " IPC handles, got " << handles.size());
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  for (int j = 0; j < ranks_per_node_; ++j) {
    if (j == local_) continue;
    gpuError_t e = gpuSuccess;
    void* p = ipc_open(handles[j], "internode buffer: IPC handle of local rank " + std::to_string(j), &e);
    UCCL_CHECK(p != nullptr, "internode buffer: rank " << rank_ << " could not map the NVL buffer of rank "
                                                          << node_ * ranks_per_node_ + j << " (cudaIpcOpenMemHandle: "
                                                          << gpuGetErrorString(e) << ")");
    peers_[j] = p;
  }
  int* claim = reinterpret_cast<int*>(static_cast<char*>(nvl_) + kClaimOffset);
  UCCL_CHECK_GPU(intranode::set_peer_claims(claim, node_claims()));
  opened_ = true;
}

void InternodeBuffer::destroy() {
  gpuError_t first = gpuSuccess;
  auto keep = [&first](gpuError_t e) {
    if (first == gpuSuccess) first = e;
  };
  if (nvl_ != nullptr || rdma_ != nullptr || flags_host_ != nullptr || err_host_ != nullptr || notified_ != nullptr)
    (void)gpuSetDevice(device_);
  for (int j = 0; j < kMaxLocal; ++j) {
    if (j != local_ && peers_[j] != nullptr) keep(ipc_close(peers_[j]));
    peers_[j] = nullptr;
  }
  opened_ = false;
  rings_.clear();
  if (nvl_ != nullptr) keep(gpuFree(nvl_));
  if (rdma_ != nullptr) keep(gpuFree(rdma_));
  if (flags_host_ != nullptr) keep(gpuFreeHost(flags_host_));
  if (err_host_ != nullptr) keep(gpuFreeHost(err_host_));
  if (notified_ != nullptr) keep(gpuEventDestroy(static_cast<gpuEvent_t>(notified_)));
  if (copy_stream_ != nullptr) keep(gpuStreamDestroy(static_cast<gpuStream_t>(copy_stream_)));
  nvl_ = rdma_ = flags_host_ = flags_dev_ = err_host_ = err_dev_ = notified_ = copy_stream_ = nullptr;
  if (first != gpuSuccess) UCCL_THROW("internode buffer: releasing resources failed: " << gpuGetErrorString(first));
}

void InternodeBuffer::set_rings(const std::vector<std::vector<int64_t>>& rings, int64_t failure_record,
                                int64_t failure_record_host) {
  UCCL_CHECK(!rings.empty() && (int)rings.size() <= kMaxRings, "internode buffer: " << rings.size() << " rings; 1.."
                                                                                    << kMaxRings << " supported");
  rings_.clear();
  for (const auto& r : rings) {
    UCCL_CHECK(r.size() == 8, "internode buffer: a ring descriptor has 8 fields, got " << r.size());
    int64_t f[8];
    std::copy(r.begin(), r.end(), f);
    rings_.push_back(uccl::ring_desc_from(f));
  }
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  int* claim = reinterpret_cast<int*>(static_cast<char*>(nvl_) + kClaimOffset);
  UCCL_CHECK_GPU(intranode::set_proxy_failure(claim, failure_record));
  proxy_fail_host_ = as_ptr<const void>(failure_record_host);
}

void InternodeBuffer::check_ready(const char* what) const {
  UCCL_CHECK(nvl_ != nullptr && rdma_ != nullptr, what << ": the internode buffer was destroyed");
  UCCL_CHECK(opened_, what << ": the node peers' NVL buffers are not opened yet");
  UCCL_CHECK(!rings_.empty(), what << ": no proxy rings (set_rings)");
}

// The record to raise: the kernels' (err_host_), else the proxies' failure the host's count wait adopted.
const volatile ErrorRecord* InternodeBuffer::record() const {
  const volatile ErrorRecord* r = static_cast<const volatile ErrorRecord*>(err_host_);
  if (r != nullptr && r->code > 0) return r;
  return adopted_.code > 0 ? &adopted_ : nullptr;
}

std::string InternodeBuffer::error() const {
  const volatile ErrorRecord* r = record();
  if (r == nullptr) return "";
  return describe_error(intranode::error_fields(r), ErrorContext{rank_, ranks_per_node_, timeout_s_});
}

// The host's side of the kernels' proxy_failed: a failure this rank's proxies recorded (a peer's abort or
// failure message, a proxy thread that stopped) is kept as this rank's record when the kernels have none, so
// that the host raises it (and abort_source names an aborting peer). A copy in host memory of its own: the
// notify kernel may write err_host_ meanwhile (a timeout, a node peer's report), and that record wins. Returns
// the sentence to raise, or "".
std::string InternodeBuffer::adopt_proxy_failure() {
  if (adopted_.code == 0 && proxy_fail_host_ != nullptr) {
    const volatile ErrorRecord* pf = static_cast<const volatile ErrorRecord*>(proxy_fail_host_);
    const int code = pf->code;
    if (code != 0) {
      __atomic_thread_fence(__ATOMIC_ACQUIRE);  // the fields were written before the code (Proxy::record_failure)
      adopted_ = ErrorRecord{code, pf->rank, pf->peer, pf->block, pf->phase, pf->need, pf->have, 0};
    }
  }
  return error();
}

void InternodeBuffer::abort(const std::string& op) {
  UCCL_CHECK(nvl_ != nullptr, "abort: the internode buffer was destroyed");
  UCCL_CHECK(opened_, "abort: the node peers' NVL buffers are not opened yet");
  publish_abort("internode buffer", device_, node_claims(), rank_, local_, op);
}

std::vector<int*> InternodeBuffer::node_claims() const {
  std::vector<int*> claims;
  for (int j = 0; j < ranks_per_node_; ++j)
    claims.push_back(reinterpret_cast<int*>(static_cast<char*>(peers_[j]) + kClaimOffset));
  return claims;
}

std::pair<int, std::string> InternodeBuffer::abort_source() const {
  return uccl_ep::abort_source(const_cast<const ErrorRecord*>(record()));
}

void InternodeBuffer::dispatch_layout(int64_t topk_idx, int num_tokens, int num_topk, int num_experts,
                                      int64_t out_per_rank, int64_t out_per_node, int64_t out_per_expert,
                                      int64_t out_in_rank, int64_t stream) {
  UCCL_CHECK(nvl_ != nullptr, "get_dispatch_layout: the internode buffer was destroyed");
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  if (num_tokens == 0) return;
  intranode::launch_dispatch_layout(
      as_ptr<const int64_t>(topk_idx), num_tokens, num_topk, num_experts, num_ranks_, ranks_per_node_,
      as_ptr<int>(out_per_rank), as_ptr<int>(out_per_node), as_ptr<int>(out_per_expert), as_ptr<bool>(out_in_rank),
      as_stream(stream),
      intranode::LayoutReport{static_cast<ErrorRecord*>(err_dev_),
                              reinterpret_cast<int*>(static_cast<char*>(nvl_) + kClaimOffset), rank_});
}

// What every kernel of this rank gets for its next launch.
Common InternodeBuffer::common() const {
  Common c{};
  c.rank = rank_;
  c.num_ranks = num_ranks_;
  c.L = ranks_per_node_;
  c.N = num_nodes_;
  c.node = node_;
  c.local = local_;
  c.timeout_cycles = timeout_cycles_;
  c.ring_spins = (unsigned long long)(timeout_s_ * 1e6) + 1;  // a host-tail poll is >= ~1 us over PCIe
  c.err = static_cast<ErrorRecord*>(err_dev_);
  c.claim = reinterpret_cast<int*>(static_cast<char*>(nvl_) + kClaimOffset);
  c.flags = static_cast<uint64_t*>(flags_dev_);
  c.rings.n = (int)rings_.size();
  for (size_t i = 0; i < rings_.size(); ++i) c.rings.r[i] = rings_[i];
  // one data channel per ring (channel 0, control, shares ring 0), at most the 63 non-control channels
  c.data_channels = std::min<int>((int)rings_.size(), uccl::kMaxChannels - 1);
  for (int j = 0; j < ranks_per_node_; ++j) c.nvl[j] = static_cast<char*>(peers_[j]);
  c.rdma = static_cast<char*>(rdma_);
  c.done = reinterpret_cast<uint64_t*>(static_cast<char*>(nvl_) + kDoneOffset);
  c.chunk_count = reinterpret_cast<int*>(static_cast<char*>(nvl_) + kChunkCountOffset);
  c.counters = reinterpret_cast<OpCounters*>(static_cast<char*>(nvl_) + kOpCountersOffset);
  return c;
}

void InternodeBuffer::notify(const std::vector<int>& header, int64_t per_rank, int64_t per_node, int64_t per_expert,
                             int num_experts, int64_t stream) {
  check_ready("dispatch (notify)");
  UCCL_CHECK((int)header.size() == kHeaderInts, "notify: header has " << header.size() << " ints, expected "
                                                                       << kHeaderInts);
  UCCL_CHECK(num_experts >= num_ranks_ && num_experts <= kMaxExperts, "dispatch: num_experts " << num_experts
                                                                                                << " outside [" << num_ranks_ << ", " << kMaxExperts << "]");
  const int64_t row_ints = count_row_ints(num_ranks_, num_experts, ranks_per_node_);
  const int64_t stride = count_row_ints(num_ranks_, kMaxExperts, ranks_per_node_);
  const int64_t need = 4 * stride * notify_rows(num_ranks_);
  UCCL_CHECK(need <= rdma_bytes_, "notify: the RDMA region (" << rdma_bytes_ << " bytes) is smaller than the "
                                                              << need << " bytes the count rows need");
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  NotifyArgs a{};
  a.c = common();
  a.row_ints = (int)row_ints;
  a.num_experts = num_experts;
  num_experts_ = num_experts;
  for (int i = 0; i < kHeaderInts; ++i) a.header[i] = header[i];
  a.per_rank = as_ptr<const int>(per_rank);
  a.per_node = as_ptr<const int>(per_node);
  a.per_expert = as_ptr<const int>(per_expert);
  a.stride = (int)stride;
  launch_notify(a, as_stream(stream));
  UCCL_CHECK_GPU(gpuEventRecord(static_cast<gpuEvent_t>(notified_), as_stream(stream)));
  notify_issued_ = true;
}

void InternodeBuffer::wait_counts(int64_t host_out) {
  check_ready("dispatch (notify)");
  UCCL_CHECK(notify_issued_, "wait_counts: no notify was issued");
  const int64_t stride = count_row_ints(num_ranks_, kMaxExperts, ranks_per_node_);
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  // The notify kernel is done (it wrote this rank's own row; its pushes are on the rings): its count of notifies
  // (on the GPU, where graph replays advance it too) is the value every rank's flag reaches.
  UCCL_CHECK_GPU(gpuEventSynchronize(static_cast<gpuEvent_t>(notified_)));
  gpuStream_t copy = static_cast<gpuStream_t>(copy_stream_);
  OpCounters now{};
  UCCL_CHECK_GPU(gpuMemcpyAsync(&now, static_cast<char*>(nvl_) + kOpCountersOffset, sizeof(now),
                                gpuMemcpyDeviceToHost, copy));
  UCCL_CHECK_GPU(gpuStreamSynchronize(copy));
  const uint64_t notifies = now.notifies;
  const volatile int64_t* flags = static_cast<const volatile int64_t*>(flags_host_);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
  for (int s = 0; s < num_ranks_; ++s) {
    if (s == rank_) continue;
    uint32_t spins = 0;
    while ((uint64_t)flags[notify_flag(s)] < notifies) {
      const std::string e = adopt_proxy_failure();
      if (!e.empty()) UCCL_THROW(e);
      if ((++spins & 1023u) == 0) {
        if (std::chrono::steady_clock::now() > deadline) {  // the host's wait: the same sentence as a kernel's
          ErrorFields f;
          f.code = kErrTimeout;
          f.rank = rank_;
          f.peer = s;
          f.phase = kPhaseNotify;
          f.need = (int)notifies;
          f.have = (int)flags[notify_flag(s)];
          UCCL_THROW(describe_error(f, ErrorContext{rank_, ranks_per_node_, timeout_s_}));
        }
        std::this_thread::yield();
      }
    }
  }
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  const int64_t in_off = count_slots_off(stride, num_ranks_, notifies - 1);
  // the copy runs on a stream of its own, so that the caller's stream holds only kernels behind those that wait
  // for the proxies
  UCCL_CHECK_GPU(gpuMemcpyAsync(as_ptr<void>(host_out), static_cast<char*>(rdma_) + in_off,
                                (size_t)(4 * stride * num_ranks_), gpuMemcpyDeviceToHost, copy));
  UCCL_CHECK_GPU(gpuStreamSynchronize(copy));
  // The kernels before notify on this stream are done too: a bad expert id the layout kernel recorded (its
  // counts left it out) raises here, at the sync the dispatch has anyway, before any row moves.
  const std::string e = error();
  if (!e.empty()) UCCL_THROW(e);
}

void InternodeBuffer::send_positions(int64_t in_rank, int num_tokens, int64_t send_pos, int64_t node_head,
                                     int64_t stream) {
  UCCL_CHECK(nvl_ != nullptr, "dispatch (send positions): the internode buffer was destroyed");
  UCCL_CHECK(num_tokens >= 0, "dispatch (send positions): num_tokens " << num_tokens << " < 0");
  if (num_tokens == 0) return;
  UCCL_CHECK(in_rank != 0 && send_pos != 0 && node_head != 0, "dispatch (send positions): a null tensor");
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  launch_send_positions(as_ptr<const bool>(in_rank), num_tokens, num_ranks_, ranks_per_node_, as_ptr<int>(send_pos),
                        as_ptr<int>(node_head), as_stream(stream));
}

void InternodeBuffer::counts(const CountChecks& checks, int64_t info, int64_t stream) {
  check_ready("dispatch (counts)");
  UCCL_CHECK(notify_issued_, "counts: no notify was issued");
  UCCL_CHECK(info != 0, "counts: no call info tensor");
  UCCL_CHECK(checks.num_worst_tokens >= 0 && checks.expert_capacity >= 0 && checks.max_node_rows >= 0,
             "counts: num_worst_tokens " << checks.num_worst_tokens << ", expert_capacity " << checks.expert_capacity
                                         << " and max_node_rows " << checks.max_node_rows << " must be >= 0");
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  const int64_t stride = count_row_ints(num_ranks_, kMaxExperts, ranks_per_node_);
  CountsArgs a{};
  a.c = common();
  a.stride = (int)stride;
  a.num_experts = num_experts_;
  a.checks = checks;
  a.info = as_ptr<int>(info);
  launch_counts(a, as_stream(stream));
}

void InternodeBuffer::dispatch(int64_t info, int num_tokens, int64_t x, int64_t x_bytes, int64_t scales,
                               int64_t scale_bytes, int64_t topk_idx, int64_t topk_w, int num_topk, int num_experts,
                               int64_t send_pos, int64_t node_head, int64_t out_rows, int64_t recv_x,
                               int64_t recv_scales, int64_t recv_topk_idx, int64_t recv_topk_w, int64_t recv_src_meta,
                               int64_t fwd_head, int64_t topk_pos, int64_t em_base, int64_t em_x, int64_t em_map,
                               int64_t em_rows, int num_sms, int chunk_rows, int64_t stream) {
  check_ready("dispatch");
  UCCL_CHECK(info != 0, "dispatch: no call info (the handle's)");
  UCCL_CHECK(num_sms >= 1 && num_sms <= num_device_sms_, "dispatch: num_sms " << num_sms << " outside [1, "
                                                                               << num_device_sms_ << "]");
  UCCL_CHECK(num_experts % num_ranks_ == 0, "dispatch: num_experts " << num_experts << " not divisible by " << num_ranks_);
  UCCL_CHECK(out_rows >= 0, "dispatch: out_rows " << out_rows << " < 0");
  UCCL_CHECK(x_bytes % 16 == 0 && scale_bytes % 4 == 0, "dispatch: row bytes " << x_bytes << " (x) must be a multiple "
                                                                               << "of 16 and " << scale_bytes << " (scales) of 4");
  UCCL_CHECK(em_x == 0 || ((topk_idx != 0 || num_tokens == 0) && topk_pos != 0 && em_base != 0 && em_map != 0 &&
                            num_topk <= kMaxExpertMajorTopk && num_tokens <= kMaxEmPosition + 1),
             "dispatch: an expert-major dispatch needs topk_idx, topk_pos, em_base and em_map, at most "
                 << kMaxExpertMajorTopk << " top-k slots (got " << num_topk << ") and at most "
                 << kMaxEmPosition + 1 << " tokens (got " << num_tokens << ")");
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  DispatchArgs a{};
  a.c = common();
  a.info = as_ptr<const int>(info);
  a.row_bytes = dispatch_row_bytes(x_bytes, scale_bytes, num_topk, ranks_per_node_);
  a.nvl_recv_off = nvl_recv_off();
  a.requested_chunk_rows = chunk_rows;
  a.num_tokens = num_tokens;
  a.num_topk = num_topk;
  a.experts_per_rank = num_experts / num_ranks_;
  a.x = as_ptr<const char>(x);
  a.x_bytes = x_bytes;
  a.scales = as_ptr<const char>(scales);
  a.scale_bytes = scale_bytes;
  a.topk_idx = as_ptr<const int64_t>(topk_idx);
  a.topk_w = as_ptr<const float>(topk_w);
  a.send_pos = as_ptr<const int>(send_pos);
  a.node_head = as_ptr<const int>(node_head);
  a.out_rows = out_rows;
  a.recv_x = as_ptr<char>(recv_x);
  a.recv_scales = as_ptr<char>(recv_scales);
  a.recv_idx = as_ptr<int64_t>(recv_topk_idx);
  a.recv_w = as_ptr<float>(recv_topk_w);
  a.recv_src = as_ptr<int>(recv_src_meta);
  a.fwd_head = as_ptr<int>(fwd_head);
  a.topk_pos = as_ptr<const int>(topk_pos);
  a.em_base = as_ptr<const int>(em_base);
  a.em_x = as_ptr<char>(em_x);
  a.em_map = as_ptr<int>(em_map);
  a.em_rows = em_rows;
  launch_dispatch(a, num_sms, as_stream(stream));
}

void InternodeBuffer::combine(int64_t info, int num_tokens, int64_t x, int dtype, int hidden, int64_t topk_w,
                              int num_topk, int64_t x_rows, int64_t node_head, int64_t fwd_head, int64_t bias0,
                              int64_t bias1, int64_t out, int64_t out_w, int num_sms, int chunk_rows, int64_t stream) {
  check_ready("combine");
  UCCL_CHECK(info != 0, "combine: no call info (the handle's)");
  UCCL_CHECK(num_sms >= 1 && num_sms <= num_device_sms_, "combine: num_sms " << num_sms << " outside [1, "
                                                                              << num_device_sms_ << "]");
  UCCL_CHECK(dtype >= 0 && dtype <= 2, "combine: dtype code " << dtype << " (0 bf16, 1 fp16, 2 fp32)");
  // Presence is num_topk (the weights' columns, the same on every rank: it sizes every rank's combine rows),
  // never the pointer: a rank that received no rows passes a [0, num_topk] tensor, whose data pointer is 0.
  // The pointer is needed only for rows this rank reads (Buffer.combine checked their count beforehand).
  UCCL_CHECK(topk_w != 0 || num_topk == 0 || x_rows == 0,
             "combine: topk_weights has " << num_topk << " columns but no data for the " << x_rows << " rows of x");
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  CombineArgs a{};
  a.c = common();
  a.info = as_ptr<const int>(info);
  a.crow_bytes = combine_row_bytes(int64_t(hidden) * (dtype == 2 ? 4 : 2), num_topk);
  a.nvl_stage_off = nvl_stage_off();
  a.requested_chunk_rows = chunk_rows;
  a.num_tokens = num_tokens;
  a.num_topk = num_topk;
  a.hidden = hidden;
  a.dtype = dtype;
  a.x = as_ptr<const char>(x);
  a.topk_w = as_ptr<const float>(topk_w);
  a.node_head = as_ptr<const int>(node_head);
  a.fwd_head = as_ptr<const int>(fwd_head);
  a.bias0 = as_ptr<const char>(bias0);
  a.bias1 = as_ptr<const char>(bias1);
  a.out = as_ptr<char>(out);
  a.out_w = as_ptr<float>(out_w);
  launch_combine(a, num_sms, as_stream(stream));
}

}  // namespace uccl_ep::internode
