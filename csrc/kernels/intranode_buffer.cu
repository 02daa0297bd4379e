// IntranodeBuffer: the IPC-shared device buffer of one rank, its peers' mappings, and the op launchers.
#include <cstring>
#include <sstream>

#include "common/check.h"
#include "kernels/abort.h"
#include "kernels/host_args.h"
#include "kernels/ipc_handles.h"
#include "kernels/launch.cuh"

namespace uccl_ep::intranode {

// make_row_layout: layouts.cpp

IntranodeBuffer::IntranodeBuffer(int device, int rank, int num_ranks, int64_t num_bytes, double timeout_s)
    : device_(device), rank_(rank), num_ranks_(num_ranks), num_bytes_(num_bytes), timeout_s_(timeout_s) {
  UCCL_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks,
             "intranode buffer: num_ranks " << num_ranks << " outside [1, " << kMaxRanks << "] (one NVLink domain)");
  UCCL_CHECK(rank >= 0 && rank < num_ranks, "intranode buffer: rank " << rank << " outside [0, " << num_ranks << ")");
  UCCL_CHECK(num_bytes >= kHeaderBytes, "intranode buffer: num_nvl_bytes " << num_bytes << " is smaller than the "
                                                                            << kHeaderBytes << "-byte header");
  UCCL_CHECK_GPU(gpuSetDevice(device));
  UCCL_CHECK_GPU(query_device(device, timeout_s, &num_device_sms_, &timeout_cycles_));
  UCCL_CHECK_GPU(gpuMalloc(&base_, (size_t)num_bytes));
  // Zero before the handle leaves this process: peers rely on signals starting at 0.
  gpuError_t e = gpuMemset(base_, 0, (size_t)num_bytes);
  if (e == gpuSuccess) e = gpuHostAlloc(&err_host_, sizeof(ErrorRecord), gpuHostAllocMapped | gpuHostAllocPortable);
  if (e == gpuSuccess) {
    std::memset(err_host_, 0, sizeof(ErrorRecord));
    e = gpuHostGetDevicePointer(&err_dev_, err_host_, 0);
  }
  if (e == gpuSuccess) e = gpuGetLastError();
#if defined(UCCL_EP_WITH_HIP)
  if (e == gpuSuccess) e = hipDeviceSynchronize();
#else
  if (e == gpuSuccess) e = cudaDeviceSynchronize();
#endif
  if (e != gpuSuccess) {
    destroy();
    UCCL_THROW("intranode buffer: allocating " << num_bytes << " bytes on device " << device
                                               << " failed: " << gpuGetErrorString(e));
  }
  peers_[rank_] = base_;
}

IntranodeBuffer::~IntranodeBuffer() {
  try {
    destroy();
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "uccl_ep_train native: ~IntranodeBuffer: %s\n", ex.what());
  }
}

std::string IntranodeBuffer::ipc_handle() const {
  UCCL_CHECK(base_ != nullptr, "intranode buffer: destroyed");
  return ipc_handle_bytes(base_);
}

void IntranodeBuffer::open_peers(const std::vector<std::string>& handles) {
  UCCL_CHECK(base_ != nullptr, "intranode buffer: destroyed");
  UCCL_CHECK(!opened_, "intranode buffer: peers already opened");
  UCCL_CHECK((int)handles.size() == num_ranks_, "intranode buffer: expected " << num_ranks_ << " IPC handles, got "
                                                                               << handles.size());
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_) continue;
    gpuError_t e = gpuSuccess;
    void* p = ipc_open(handles[r], "intranode buffer: IPC handle of rank " + std::to_string(r), &e);
    if (p == nullptr) {
      for (int q = 0; q < r; ++q)
        if (q != rank_ && peers_[q] != nullptr) {
          (void)ipc_close(peers_[q]);
          peers_[q] = nullptr;
        }
      UCCL_THROW("intranode buffer: rank " << rank_ << " could not map the buffer of rank " << r
                                           << " (cudaIpcOpenMemHandle: " << gpuGetErrorString(e)
                                           << "); are all ranks on one node with peer access?");
    }
    peers_[r] = p;
  }
  // the peers' claim words as mapped here (report_error tells them of this rank's errors)
  static_assert(kMaxRanks <= kMaxBoard && kErrorClaimOffset + kErrorWordsBytes <= kSideWorkOffset &&
                    kSideWorkOffset + 24 <= kOpSeqOffset && kOpSeqOffset + 16 <= kCountsOffset,
                "the error words, side-work counters and op sequence fit before the counts");
  UCCL_CHECK_GPU(set_peer_claims(claim_ptr(), node_claims()));
  opened_ = true;
}

void IntranodeBuffer::destroy() {
  gpuError_t first = gpuSuccess;
  if (base_ != nullptr || err_host_ != nullptr) (void)gpuSetDevice(device_);
  for (int r = 0; r < kMaxRanks; ++r) {
    if (r != rank_ && peers_[r] != nullptr) {
      gpuError_t e = ipc_close(peers_[r]);
      if (first == gpuSuccess) first = e;
    }
    peers_[r] = nullptr;
  }
  opened_ = false;
  if (base_ != nullptr) {
    gpuError_t e = gpuFree(base_);
    if (first == gpuSuccess) first = e;
    base_ = nullptr;
  }
  if (err_host_ != nullptr) {
    gpuError_t e = gpuFreeHost(err_host_);
    if (first == gpuSuccess) first = e;
    err_host_ = err_dev_ = nullptr;
  }
  if (first != gpuSuccess) UCCL_THROW("intranode buffer: releasing resources failed: " << gpuGetErrorString(first));
}

int64_t IntranodeBuffer::header_bytes() const { return kHeaderBytes; }
int IntranodeBuffer::warps_per_block() { return kDispatchThreads / kWarpSize; }
int64_t IntranodeBuffer::data_bytes() const { return num_bytes_ - kHeaderBytes; }

std::string IntranodeBuffer::error() const {
  if (err_host_ == nullptr) return "";
  const volatile ErrorRecord* r = reinterpret_cast<const volatile ErrorRecord*>(err_host_);
  if (r->code <= 0) return "";
  return describe_error(error_fields(r), ErrorContext{rank_, 0, timeout_s_});
}

void IntranodeBuffer::clear_error() {
  if (err_host_ != nullptr) std::memset(err_host_, 0, sizeof(ErrorRecord));
  if (base_ != nullptr) {
    UCCL_CHECK_GPU(gpuSetDevice(device_));
    UCCL_CHECK_GPU(gpuMemset(claim_ptr(), 0, kPeerTableRel));  // claim word and board (not the peer table)
  }
}

void IntranodeBuffer::abort(const std::string& op) {
  check_open("abort");
  publish_abort("intranode buffer", device_, node_claims(), rank_, rank_, op);
}

std::vector<int*> IntranodeBuffer::node_claims() const {
  std::vector<int*> claims;
  for (int r = 0; r < num_ranks_; ++r)
    claims.push_back(reinterpret_cast<int*>(static_cast<char*>(peers_[r]) + kErrorClaimOffset));
  return claims;
}

std::pair<int, std::string> IntranodeBuffer::abort_source() const { return uccl_ep::abort_source(err_host_); }

int* IntranodeBuffer::claim_ptr() const {
  return reinterpret_cast<int*>(static_cast<char*>(base_) + kErrorClaimOffset);
}

void IntranodeBuffer::check_open(const char* what) const {
  UCCL_CHECK(base_ != nullptr, what << ": the intranode buffer was destroyed");
  UCCL_CHECK(opened_, what << ": peers' IPC buffers are not opened yet");
}

void dispatch_layout(int64_t topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                     int ranks_per_node, int64_t out_per_rank, int64_t out_per_node, int64_t out_per_expert,
                     int64_t out_in_rank, int64_t stream) {
  if (num_tokens == 0) return;
  launch_dispatch_layout(as_ptr<const int64_t>(topk_idx), num_tokens, num_topk, num_experts, num_ranks,
                         ranks_per_node, as_ptr<int>(out_per_rank), as_ptr<int>(out_per_node),
                         as_ptr<int>(out_per_expert), as_ptr<bool>(out_in_rank), as_stream(stream), LayoutReport{});
}

void IntranodeBuffer::dispatch_layout(int64_t topk_idx, int num_tokens, int num_topk, int num_experts,
                                      int64_t out_per_rank, int64_t out_per_expert, int64_t out_in_rank,
                                      int64_t stream) {
  UCCL_CHECK(base_ != nullptr, "get_dispatch_layout: the intranode buffer was destroyed");
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  if (num_tokens == 0) return;
  // ids out of range are reported (to every rank: this rank's next notify then moves nothing)
  launch_dispatch_layout(as_ptr<const int64_t>(topk_idx), num_tokens, num_topk, num_experts, num_ranks_, num_ranks_,
                         as_ptr<int>(out_per_rank), nullptr, as_ptr<int>(out_per_expert), as_ptr<bool>(out_in_rank),
                         as_stream(stream), LayoutReport{static_cast<ErrorRecord*>(err_dev_), claim_ptr(), rank_});
}

static PeerPtrs peer_ptrs(void* const* peers) {
  PeerPtrs p{};
  for (int r = 0; r < kMaxRanks; ++r) p.p[r] = static_cast<char*>(peers[r]);
  return p;
}

void IntranodeBuffer::notify(int64_t num_tokens_per_rank, int64_t num_tokens_per_expert, int64_t is_token_in_rank,
                             int num_tokens, int num_experts, int64_t out_send_pos, int64_t out_info,
                             int num_worst_tokens, const std::vector<int>& shape, int64_t stream) {
  check_open("dispatch (notify)");
  UCCL_CHECK(num_experts % num_ranks_ == 0, "num_experts " << num_experts << " not divisible by " << num_ranks_);
  UCCL_CHECK(num_ranks_ + num_experts / num_ranks_ <= kCountsSlotInts - kShapeInts,
             "num_experts " << num_experts << " too large for the counts exchange");
  UCCL_CHECK(int(shape.size()) == kShapeInts, "notify: shape has " << shape.size() << " ints, expected " << kShapeInts);
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  NotifyArgs a{};
  a.peers = peer_ptrs(peers_);
  a.rank = rank_;
  a.num_ranks = num_ranks_;
  a.num_tokens = num_tokens;
  a.num_experts = num_experts;
  a.num_worst_tokens = num_worst_tokens;
  for (int i = 0; i < kShapeInts; ++i) a.shape[i] = shape[i];
  a.per_rank = as_ptr<const int>(num_tokens_per_rank);
  a.per_expert = as_ptr<const int>(num_tokens_per_expert);
  a.in_rank = as_ptr<const bool>(is_token_in_rank);
  a.send_pos = as_ptr<int>(out_send_pos);
  a.info = as_ptr<int>(out_info);
  a.sig = SignalArgs{timeout_cycles_, static_cast<ErrorRecord*>(err_dev_), claim_ptr()};
  launch_notify(a, as_stream(stream));
}

void IntranodeBuffer::dispatch(int64_t x, int64_t x_bytes, int64_t scales, int64_t scale_bytes, int64_t topk_idx,
                               int64_t topk_weights, int flags, int num_topk, int experts_per_rank, int num_tokens,
                               int64_t send_pos, int64_t rank_prefix, int64_t recv_x, int64_t recv_scales,
                               int64_t recv_topk_idx, int64_t recv_topk_weights, int64_t recv_src_idx,
                               int64_t out_rows, int64_t em_x, int64_t em_map, int64_t topk_pos, int64_t em_base,
                               int em_k, int64_t em_rows, int expand_blocks, int num_sms, int push_warps,
                               int flag_batch, int64_t stream) {
  check_open("dispatch");
  UCCL_CHECK(num_sms >= 1 && num_sms <= num_device_sms_, "dispatch: num_sms " << num_sms << " outside [1, "
                                                                               << num_device_sms_ << "]");
  UCCL_CHECK(scale_bytes % 4 == 0, "dispatch: scale row bytes " << scale_bytes << " not a multiple of 4");
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  DispatchArgs a{};
  a.with_topk = (flags & kWithTopk) != 0;
  a.with_weights = a.with_topk && (flags & kWithWeights) != 0;
  a.with_src = (flags & kWithSrc) != 0;
  a.peers = peer_ptrs(peers_);
  a.rank = rank_;
  a.num_ranks = num_ranks_;
  a.num_tokens = num_tokens;
  a.num_topk = a.with_topk ? num_topk : 0;
  a.experts_per_rank = experts_per_rank;
  a.x = as_ptr<const char>(x);
  a.x_bytes = x_bytes;
  a.scales = as_ptr<const char>(scales);
  a.scale_bytes = scale_bytes;
  a.topk_idx = as_ptr<const int64_t>(topk_idx);
  a.topk_w = as_ptr<const float>(topk_weights);
  a.send_pos = as_ptr<const int>(send_pos);
  a.rank_prefix = as_ptr<const int>(rank_prefix);
  a.recv_x = as_ptr<char>(recv_x);
  a.recv_scales = as_ptr<char>(recv_scales);
  a.recv_idx = as_ptr<int64_t>(recv_topk_idx);
  a.recv_w = as_ptr<float>(recv_topk_weights);
  a.recv_src = as_ptr<int>(recv_src_idx);
  a.out_rows = out_rows;
  a.em_x = as_ptr<char>(em_x);
  if (a.em_x != nullptr) {
    UCCL_CHECK(em_map != 0, "dispatch: expert-major mode needs em_map");
    UCCL_CHECK(scale_bytes == 0, "dispatch: expert-major mode moves bf16/fp16/fp32 rows (no FP8 scales)");
    UCCL_CHECK(em_rows >= 0, "dispatch: em_rows " << em_rows << " < 0");
    if (a.with_topk) {
      UCCL_CHECK(topk_pos != 0 && em_base != 0, "dispatch: a fresh expert-major dispatch needs topk_pos and em_base");
      UCCL_CHECK(em_k == num_topk, "dispatch: em_k " << em_k << " != num_topk " << num_topk);
    }
    UCCL_CHECK(em_k >= 1 && em_k <= kMaxExpertMajorTopk,
               "dispatch: expert-major mode takes 1.." << kMaxExpertMajorTopk << " top-k slots, got " << em_k);
  }
  a.em_map = as_ptr<int>(em_map);
  a.topk_pos = as_ptr<const int>(topk_pos);
  a.em_base = as_ptr<const int>(em_base);
  a.em_k = em_k;
  a.em_rows = em_rows;
  if (expand_blocks != 0) {
    UCCL_CHECK(a.em_x != nullptr, "dispatch: expand blocks need expert-major mode");
    UCCL_CHECK(expand_blocks >= 1 && num_sms + expand_blocks <= num_device_sms_,
               "dispatch: expand_blocks " << expand_blocks << " outside [1, " << num_device_sms_ - num_sms
                                          << "] (num_sms " << num_sms << " of " << num_device_sms_ << " SMs)");
    a.expand_blocks = expand_blocks;
  }
  UCCL_CHECK(push_warps >= 1 && push_warps <= warps_per_block(),
             "dispatch: push_warps " << push_warps << " outside [1, " << warps_per_block() << "]");
  a.push_warps = push_warps;
  UCCL_CHECK(flag_batch >= 1, "dispatch: flag_batch " << flag_batch << " must be >= 1");
  a.flag_batch = flag_batch;
  a.lay = make_row_layout(data_bytes(), x_bytes, scale_bytes, a.num_topk, a.with_src);
  // what the rows carry, in kShapeFields order (the peers compare it: a cached dispatch has no notify)
  a.shape[1] = (int)x_bytes;
  a.shape[2] = (int)scale_bytes;
  a.shape[3] = a.num_topk;
  a.shape[4] = a.with_weights ? 1 : 0;  // the top-k format's weights bit (notify compared the expert-major bit)
  a.sig = SignalArgs{timeout_cycles_, static_cast<ErrorRecord*>(err_dev_), claim_ptr()};
  launch_dispatch(a, num_sms + a.expand_blocks, as_stream(stream));
}

void IntranodeBuffer::combine(int64_t x, int dtype, int hidden, int64_t topk_weights, bool with_weights, int num_topk, int num_tokens,
                              int64_t send_pos, int64_t rank_prefix, int64_t bias0, int64_t bias1, int64_t out,
                              int64_t out_topk_weights, int64_t fold_map, int fold_k, int64_t fold_rows,
                              int64_t fold_out, int64_t fold_out_rows, int fold_blocks, int num_sms, int push_warps,
                              int flag_batch, int variant, int64_t stream) {
  check_open("combine");
  UCCL_CHECK(num_sms >= 1 && num_sms <= num_device_sms_, "combine: num_sms " << num_sms << " outside [1, "
                                                                              << num_device_sms_ << "]");
  UCCL_CHECK_GPU(gpuSetDevice(device_));
  CombineArgs a{};
  a.peers = peer_ptrs(peers_);
  a.rank = rank_;
  a.num_ranks = num_ranks_;
  a.num_tokens = num_tokens;
  a.hidden = hidden;
  a.with_weights = with_weights;
  UCCL_CHECK(push_warps >= 1 && push_warps <= warps_per_block(),
             "combine: push_warps " << push_warps << " outside [1, " << warps_per_block() << "]");
  a.push_warps = push_warps;
  UCCL_CHECK(flag_batch >= 1, "combine: flag_batch " << flag_batch << " must be >= 1");
  a.flag_batch = flag_batch;
  // variant (Config.combine_kernel, 0 when None): 1 reduce (and fold) through registers, 2 staged through
  // shared memory with cp.async (CUDA; HIP runs 1). Default: 1 for plain combines (measured faster on 2xH200
  // at 8-24 SMs: 433 vs 359 GB/s at 24), 2 in fused fold mode (each pushed row reads ~k/R expert rows: see
  // intranode.cu), 1 with fold blocks.
  a.variant = variant > 0 ? variant : (fold_map != 0 && fold_out == 0 ? 2 : 1);
  UCCL_CHECK(a.variant >= 1 && a.variant <= 2, "combine: variant " << variant << " (Config.combine_kernel: 1 or 2)");
  a.num_topk = with_weights ? num_topk : 0;
  UCCL_CHECK(dtype == kDtypeBf16 || dtype == kDtypeFp16 || dtype == kDtypeFp32,
             "combine: dtype code " << dtype << " (0 bf16, 1 fp16, 2 fp32)");
  a.dtype = dtype;
  a.x = as_ptr<const void>(x);
  a.topk_w = as_ptr<const float>(topk_weights);
  a.send_pos = as_ptr<const int>(send_pos);
  a.rank_prefix = as_ptr<const int>(rank_prefix);
  a.bias0 = as_ptr<const void>(bias0);  // 0 -> nullptr: no bias
  a.bias1 = as_ptr<const void>(bias1);
  a.out = as_ptr<void>(out);
  a.out_w = as_ptr<float>(out_topk_weights);
  a.fold_map = as_ptr<const int>(fold_map);
  if (a.fold_map != nullptr)
    UCCL_CHECK(fold_k >= 1 && fold_k <= kMaxExpertMajorTopk && fold_rows >= 0,
               "combine: fold mode takes 1.." << kMaxExpertMajorTopk << " slots per row, got " << fold_k
                                              << " (fold_rows " << fold_rows << ")");
  a.fold_k = fold_k;
  a.fold_rows = fold_rows;
  if (fold_out != 0) {
    UCCL_CHECK(a.fold_map != nullptr, "combine: fold_out needs a fold map");
    UCCL_CHECK(fold_out_rows >= 0 && fold_out_rows <= kMaxFlagRows,
               "combine: fold_out has " << fold_out_rows << " rows; fold blocks flag at most " << kMaxFlagRows);
    UCCL_CHECK(fold_blocks >= 1 && num_sms + fold_blocks <= num_device_sms_,
               "combine: fold_blocks " << fold_blocks << " outside [1, " << num_device_sms_ - num_sms
                                       << "] (num_sms " << num_sms << " of " << num_device_sms_ << " SMs)");
    a.fold_out = as_ptr<void>(fold_out);
    a.fold_blocks = fold_blocks;
  }
  const int64_t elem = dtype == kDtypeFp32 ? 4 : 2;
  a.lay = make_row_layout(data_bytes(), (int64_t)hidden * elem, 0, a.num_topk, false);
  // combine uses off_x for rows and off_topk_w for weights: keep them where make_row_layout put them
  // what the rows carry, in kShapeFields order (the peers compare it: a combine has no notify)
  a.shape[1] = hidden * (int)elem;
  a.shape[3] = a.num_topk;
  a.shape[4] = with_weights ? 1 : 0;
  a.shape[6] = dtype;
  a.sig = SignalArgs{timeout_cycles_, static_cast<ErrorRecord*>(err_dev_), claim_ptr()};
  launch_combine(a, num_sms + a.fold_blocks, as_stream(stream));
}

}  // namespace uccl_ep::intranode
