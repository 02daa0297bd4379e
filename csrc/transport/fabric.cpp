// FabricTransport: libfabric RDM endpoint. Writes go out as fi_writedata with remote CQ data: 8 bytes (the
// 32-bit immediate plus the writer's rank) where the provider carries them, else 4 bytes packed as
// transport.h's compact layout (libfabric's efa offers 4). Atomics, zero-length writes and markers go out as
// small two-sided messages that the receiver turns into ordered local updates (the transport has no
// atomics on tcp/shm, and EFA has none either). Regions may be GPU memory (FI_HMEM: CUDA, or ROCr on AMD),
// registered with fi_mr_regattr and their descriptors passed on every operation; a proxy fed by a GPU asks
// for FI_HMEM at creation and refuses, naming the provider, when the libfabric cannot carry device memory.
// Runs on tcp;ofi_rxm, shm and sockets here; efa on AWS.
#include "transport/transport.h"

#if defined(UCCL_EP_WITH_FABRIC)

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <optional>

#include "common/check.h"
#include "common/env.h"
#include "common/portability.h"
#include "common/raii.h"
#include "transport/fabric_info.h"

namespace uccl {
namespace {

struct RegionKey {
  uint64_t base;  // remote virtual address when the provider wants FI_MR_VIRT_ADDR, else 0
  uint64_t key;
  uint64_t size;
  uint64_t valid;
};

// A control message (atomic, marker, zero-length write, or the endpoint's goodbye). 32 bytes.
struct CtrlMsg {
  uint32_t kind;  // Completion::Kind, or kCtrlBye
  uint32_t imm;
  uint32_t region;
  int32_t src;
  uint64_t offset;
  int64_t value;
};

// The last message an endpoint sends each peer (FabricTransport::quiesce): everything it posted completed
// and it posts nothing more. Never reported as a completion.
constexpr uint32_t kCtrlBye = 0xb7e;
// How long one post, or a wait for a free control slot, retries on FI_EAGAIN (progressing meanwhile) before it
// fails: a peer that stopped draining its receives.
constexpr double kPostRetryS = 30.0;

enum CtxType : uint32_t { kCtxWrite = 1, kCtxSend = 2, kCtxRecv = 3 };

struct OpCtx {
  fi_context2 fi;  // must be first: libfabric hands this pointer back as op_context
  CtxType type;
  uint64_t wr_id;
  int slot;
};

void close_fid(fid_t f) {
  if (f) warn_release("fi_close", fi_close(f));
}

// The newest API the headers we were built with know: HMEM on several providers needs >= 1.18.
constexpr uint32_t kApiVersion = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);

#if defined(UCCL_EP_WITH_HIP)
constexpr fi_hmem_iface kGpuIface = FI_HMEM_ROCR;
constexpr const char* kGpuRuntime = "ROCm (--with-rocr)";
#else
constexpr fi_hmem_iface kGpuIface = FI_HMEM_CUDA;
constexpr const char* kGpuRuntime = "CUDA (--with-cuda)";
#endif

std::string version_str(uint32_t v) { return std::to_string(FI_MAJOR(v)) + "." + std::to_string(FI_MINOR(v)); }

using InfoPtr = Owned<fi_info*, void (*)(fi_info*)>;

// fi_getinfo for an RDM endpoint with messages + RMA (+ FI_HMEM when `hmem`): delivery-complete local
// completions where the provider offers them, transmit-complete otherwise. nullptr when nothing fits.
fi_info* query_info(const std::string& prov, const std::string& device, bool hmem, int* rc) {
  fi_info* hints = fi_allocinfo();
  UCCL_CHECK(hints != nullptr, "fi_allocinfo failed");
  auto hints_guard = own(hints, [](fi_info* h) { fi_freeinfo(h); });
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_MSG | FI_RMA | (hmem ? FI_HMEM : 0);
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  // Every mode we honour: descriptors on every operation (FI_MR_LOCAL, FI_MR_HMEM), remote virtual addresses,
  // provider keys, registration of allocated memory only, registrations bound to the endpoint.
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT |
                                (hmem ? FI_MR_HMEM : 0);
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->data_progress = FI_PROGRESS_MANUAL;
  if (!device.empty()) hints->domain_attr->name = strdup(device.c_str());
  if (!prov.empty()) hints->fabric_attr->prov_name = strdup(prov == "tcp" ? "tcp;ofi_rxm" : prov.c_str());
  fi_info* info = nullptr;
  for (uint64_t op_flags : {uint64_t(FI_DELIVERY_COMPLETE), uint64_t(0)}) {
    hints->tx_attr->op_flags = op_flags;
    *rc = fi_getinfo(kApiVersion, nullptr, nullptr, 0, hints, &info);
    if (*rc == 0 && info) return info;
  }
  return nullptr;
}

// The CQ-data layout: UCCL_EP_FABRIC_CQ_DATA_BYTES (4 or 8) forces one; unset, 8 where the provider carries 8.
int cq_data_bytes_for(const fi_info* info, int world) {
  const long want = env_long("UCCL_EP_FABRIC_CQ_DATA_BYTES", 0);
  const size_t offered = info->domain_attr->cq_data_size;
  const char* prov = info->fabric_attr->prov_name;
  if (want != 0 && want != 4 && want != 8)
    UCCL_THROW("fabric: UCCL_EP_FABRIC_CQ_DATA_BYTES=" << want << " must be 4 or 8 (unset: what the provider offers)");
  if (offered < 4)
    UCCL_THROW("fabric: provider " << prov << " carries " << offered << " bytes of remote CQ data; the transport needs "
               "at least 4 (pick another provider with FI_PROVIDER)");
  if (want == 8 && offered < 8)
    UCCL_THROW("fabric: UCCL_EP_FABRIC_CQ_DATA_BYTES=8 but provider " << prov << " carries only " << offered
               << " bytes of remote CQ data; unset it (the 4-byte layout is used there)");
  const int bytes = (want == 4 || offered < 8) ? 4 : 8;
  if (bytes == 4 && world > kCompactMaxRanks)
    UCCL_THROW("fabric: the 4-byte CQ-data layout of provider " << prov << " names at most " << kCompactMaxRanks
               << " ranks, this job has " << world);
  return bytes;
}

#if defined(UCCL_EP_WITH_CUDA)
constexpr bool kCudaBuild = true;
#else
constexpr bool kCudaBuild = false;
#endif

// Providers that move GPU memory with CPU-driven copies through the CUDA runtime (shm's IPC and bounce
// paths, tcp/sockets bounce buffers) rather than with a NIC's DMA: libfabric 2.x issues those as plain
// cudaMemcpy, which for device-to-device copies returns before the copy ran and queues it on the legacy
// default stream. By name: what the probe (no endpoint) and headers without FI_OPT_CUDA_API_PERMITTED go by
// (provider_calls_cuda; each of these refuses that option, so an open endpoint marks them by its answer).
bool copies_through_cuda_runtime(const std::string& prov) {
  for (const char* p : {"shm", "tcp", "sockets", "udp"})
    if (prov.compare(0, std::strlen(p), p) == 0) return true;
  return false;
}

// Whether the provider of `ep` (opened for GPU memory) may call the CUDA runtime in the endpoint's progress,
// i.e. in the proxy thread. It is asked not to (FI_OPT_CUDA_API_PERMITTED = false, as NCCL's libfabric plugin
// does; before fi_enable): one that agrees moves GPU memory by DMA alone (efa with GPUDirect RDMA). One that
// refuses copies with cudaMemcpy (shm; efa without GPUDirect RDMA and rxm over libfabric's verbs bounce
// through host memory), where a copy can queue behind the very kernels that spin until it lands
// (docs/internode.md, "Host copies and the fabric transport"). Headers older than the option (1.17): the
// providers known to copy, by name. (HIP builds: the ROCm runtime's copies are not tracked; false.)
bool provider_calls_cuda(fid_ep* ep, const std::string& prov) {
#if defined(UCCL_EP_WITH_CUDA) && (FI_MAJOR_VERSION > 1 || (FI_MAJOR_VERSION == 1 && FI_MINOR_VERSION >= 18))
  (void)prov;
  bool permitted = false;
  return fi_setopt(&ep->fid, FI_OPT_ENDPOINT, FI_OPT_CUDA_API_PERMITTED, &permitted, sizeof(permitted)) != 0;
#else
  (void)ep;
  return kCudaBuild && copies_through_cuda_runtime(prov);
#endif
}

// The transport's fi_info, or a sentence saying what is missing.
InfoPtr select_info(const std::string& provider, const std::string& device, bool hmem) {
  const std::string prov = provider.empty() ? env_str("FI_PROVIDER") : provider;
  const std::string lib = version_str(fi_version());
  int rc = 0;
  fi_info* info = query_info(prov, device, hmem, &rc);
  if (!info) {
    const std::string which = prov.empty() ? std::string("any provider") : "provider '" + prov + "'";
    const std::string on = device.empty() ? std::string() : " on domain '" + device + "'";
    int plain_rc = 0;
    fi_info* plain = hmem ? query_info(prov, device, false, &plain_rc) : nullptr;
    if (plain) {  // the provider is there, but not for GPU memory
      const std::string got = plain->fabric_attr->prov_name;
      fi_freeinfo(plain);
      UCCL_THROW("fabric: " << which << on << " (found '" << got << "', libfabric " << lib << ") cannot register GPU "
                 "memory (no FI_HMEM): the proxies of a GPU need it. Install a libfabric >= 1.18 built with "
                 << kGpuRuntime << " (scripts/build_libfabric.sh builds one; UCCL_EP_LIBFABRIC points the build at "
                 "it), or, with every rank on one host, set UCCL_EP_TRANSPORT=ipc");
    }
    UCCL_THROW("fabric: no libfabric provider offers an RDM endpoint with FI_MSG|FI_RMA for " << which << on
               << " (fi_getinfo: " << fi_strerror(-rc) << "; libfabric " << lib << ", API " << version_str(kApiVersion)
               << "; try FI_PROVIDER=tcp, shm or sockets; tcp needs FI_TCP_IFACE, e.g. lo)");
  }
  return InfoPtr(info, [](fi_info* i) { fi_freeinfo(i); });
}

}  // namespace

FabricProbe probe_fabric(const std::string& provider, const std::string& device, bool hmem) {
  InfoPtr info = select_info(provider, device, hmem);
  const fi_info* i = info.get();
  FabricProbe p;
  p.provider = i->fabric_attr->prov_name ? i->fabric_attr->prov_name : "";
  p.domain = i->domain_attr->name ? i->domain_attr->name : "";
  p.library_version = version_str(fi_version());
  p.api_version = version_str(kApiVersion);
  p.cq_data_size = i->domain_attr->cq_data_size;
  p.cq_data_bytes = cq_data_bytes_for(i, 1);
  p.hmem = (i->caps & FI_HMEM) != 0;
  p.waits_for_default_stream = kCudaBuild && hmem && copies_through_cuda_runtime(p.provider);
  p.mr_mode = uint64_t(i->domain_attr->mr_mode);
  p.max_msg_size = i->ep_attr->max_msg_size;
  p.inject_size = i->tx_attr->inject_size;
  return p;
}

class FabricTransport final : public Transport {
 public:
  explicit FabricTransport(const TransportOptions& o)
      : opts_(o), peers_(o.world), connected_(o.world, 0), bye_from_(o.world, 0), remote_(o.world) {
    // The efa provider forks safely only when told before it opens a device (data loaders fork).
    if (o.provider == "efa" || env_str("FI_PROVIDER") == "efa") setenv("FI_EFA_FORK_SAFE", "1", 0);
    // A proxy fed by a GPU moves GPU memory: ask for FI_HMEM now, so a libfabric without it fails here, at
    // Buffer creation on every rank (the bootstrap carries the error), not inside a call.
    hmem_ = o.gpu >= 0;
    info_ = select_info(o.provider, o.device, hmem_);
    fi_info* info = info_.get();
    provider_name_ = info->fabric_attr->prov_name ? info->fabric_attr->prov_name : "";
    domain_name_ = info->domain_attr->name ? info->domain_attr->name : "";
    cq_data_bytes_ = cq_data_bytes_for(info, o.world);
    mr_mode_ = info->domain_attr->mr_mode;
    max_msg_ = info->ep_attr->max_msg_size;

    fid_fabric* fabric = nullptr;
    UCCL_CHECK_FI(fi_fabric(info->fabric_attr, &fabric, nullptr));
    fabric_ = own(&fabric->fid, close_fid);
    fid_domain* domain = nullptr;
    UCCL_CHECK_FI(fi_domain(fabric, info, &domain, nullptr));
    domain_ = own(&domain->fid, close_fid);
    domain_p_ = domain;

    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.size = 8192;
    cq_attr.wait_obj = FI_WAIT_NONE;
    fid_cq* cq = nullptr;
    UCCL_CHECK_FI(fi_cq_open(domain, &cq_attr, &cq, nullptr));
    cq_ = own(&cq->fid, close_fid);
    cq_p_ = cq;

    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    av_attr.count = size_t(o.world);
    fid_av* av = nullptr;
    UCCL_CHECK_FI(fi_av_open(domain, &av_attr, &av, nullptr));
    av_ = own(&av->fid, close_fid);
    av_p_ = av;

    fid_ep* ep = nullptr;
    UCCL_CHECK_FI(fi_endpoint(domain, info, &ep, nullptr));
    ep_ = own(&ep->fid, close_fid);
    ep_p_ = ep;
    UCCL_CHECK_FI(fi_ep_bind(ep, &av->fid, 0));
    UCCL_CHECK_FI(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
    // A provider's cudaMemcpy can return before its bytes landed (device to device; from host memory CUDA did
    // not pin, as a NIC's bounce buffers are): where it may call the runtime, arrivals wait behind the fence.
    copy_fence_ = hmem_ && provider_calls_cuda(ep, provider_name_);
    UCCL_CHECK_FI(fi_enable(ep));

    // Control-message buffers: kRecv posted receives + kSend send slots, one registration.
    ctrl_.resize(kRecv + kSend);
    ctrl_mr_ = register_raw(ctrl_.data(), ctrl_.size() * sizeof(CtrlMsg), 1000, false, &ctrl_desc_);
    ctx_.resize(kRecv + kSend);
    for (int i = 0; i < kRecv; ++i) post_recv(i);
    for (int i = 0; i < kSend; ++i) free_send_.push_back(kRecv + i);
  }

  ~FabricTransport() override { close(); }

  // Why: closing an rxm endpoint (libfabric 1.17, tcp;ofi_rxm) while a peer's fi_writedata is half received
  // makes the tcp provider cancel that write with a null context, which rxm dereferences inside fi_close:
  // the segfault a rank whose proxy thread died used to meet at teardown. So, before close(): (1) progress
  // until every operation this endpoint posted completed, (2) send each connected peer a goodbye (after those
  // operations, on the same connection), (3) progress until every peer's goodbye came and ours left. A
  // peer's goodbye follows everything it sent here, so nothing is half received when it came. Completions
  // read meanwhile are dropped: the proxy thread has stopped.
  std::string quiesce(double timeout_s) override {
    if (closed_ || !ep_) return "";
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(timeout_s));
    stop_deadline_ = deadline;  // the goodbyes' sends retry no longer than the quiesce may take
    size_t peers = 0;
    for (int p = 0; p < opts_.world; ++p) peers += connected_[p] ? 1 : 0;
    try {
      Completion sink[64];
      while (outstanding() > 0) {
        if (std::chrono::steady_clock::now() > deadline)
          return "fabric: " + std::to_string(outstanding()) + " operations of this endpoint did not complete "
                 "within " + std::to_string(timeout_s) + " s of stopping (a peer stopped progressing)";
        read_cq(sink, 64);
      }
      for (int p = 0; p < opts_.world; ++p)
        if (connected_[p]) send_ctrl(p, kCtrlBye, 0, kNoRegion, 0, 0, 0);
      while (byes_ < peers || outstanding() > 0) {
        if (std::chrono::steady_clock::now() > deadline) {
          std::string missing;
          for (int p = 0; p < opts_.world; ++p)
            if (connected_[p] && !bye_from_[p]) missing += (missing.empty() ? "" : ", ") + std::to_string(p);
          return "fabric: no goodbye from rank(s) " + (missing.empty() ? std::string("-") : missing) +
                 " within " + std::to_string(timeout_s) + " s of stopping (they did not close their proxies " +
                 "at the same time); their writes may be cut off by this close";
        }
        read_cq(sink, 64);
      }
      backlog_.clear();
    } catch (const std::exception& e) {
      return std::string("fabric: quiescing the endpoint failed: ") + e.what();
    }
    return "";
  }

  void close() override {
    if (closed_) return;
    closed_ = true;
    // Endpoint first (cancels posted receives), then registrations, then the rest.
    ep_.reset();
    for (auto& kv : mrs_) kv.second.reset();
    mrs_.clear();
    ctrl_mr_.reset();
    av_.reset();
    cq_.reset();
    domain_.reset();
    fabric_.reset();
    info_.reset();
#if UCCL_EP_WITH_GPU
    copy_stream_.reset();
#endif
#if defined(UCCL_EP_WITH_CUDA)
    for (gpuEvent_t ev : events_) {
      const gpuError_t e = gpuEventDestroy(ev);
      if (e != gpuSuccess) warn_release_gpu(e);
    }
    events_.clear();
    free_events_.clear();
    fences_.clear();
#endif
  }

  const char* name() const override { return "fabric"; }
  std::string opened_provider() const override { return provider_name_; }
  std::string opened_device() const override { return domain_name_; }

  std::string address() override {
    char buf[256];
    size_t len = sizeof(buf);
    UCCL_CHECK_FI(fi_getname(&ep_p_->fid, buf, &len));
    // provider NUL cq-data-bytes NUL raw address: peers check both before they talk.
    std::string prov = info_.get()->fabric_attr->prov_name;
    return prov + '\0' + std::to_string(cq_data_bytes_) + '\0' + std::string(buf, len);
  }

  uint32_t imm_seq_bits() const override { return cq_data_bytes_ == 4 ? kCompactSeqBits : kSeqBits; }

  bool calls_gpu_runtime() const override { return copy_fence_; }

  std::string register_region(const LocalRegion& r) override {
    if (r.id < 0 || r.id >= 256) UCCL_THROW("fabric: region id " << r.id << " out of range [0, 256)");
    if (r.device && !hmem_)
      UCCL_THROW("fabric: region " << r.id << " is GPU memory but this endpoint was opened for host memory only "
                 "(a proxy with gpu=-1); create the proxy with the GPU that owns the region");
    void* desc = nullptr;
    auto mr = register_raw(r.base, r.size, uint64_t(r.id) + 1, r.device, &desc);
    RegionKey k{};
    k.base = (mr_mode_ & FI_MR_VIRT_ADDR) ? uint64_t(reinterpret_cast<uintptr_t>(r.base)) : 0;
    k.key = fi_mr_key(reinterpret_cast<fid_mr*>(mr.get()));
    k.size = r.size;
    k.valid = 1;
    if (local_.size() <= size_t(r.id)) local_.resize(r.id + 1);
    local_[r.id] = r;
    if (descs_.size() <= size_t(r.id)) descs_.resize(r.id + 1, nullptr);
    descs_[r.id] = desc;
    mrs_[r.id] = std::move(mr);
    return std::string(reinterpret_cast<const char*>(&k), sizeof(k));
  }

  void connect(int peer, const std::string& address, const std::vector<std::string>& keys) override {
    UCCL_CHECK(peer >= 0 && peer < opts_.world, "fabric: peer " << peer << " out of range");
    auto zero = address.find('\0');
    UCCL_CHECK(zero != std::string::npos, "fabric: malformed address blob from peer " << peer);
    auto zero2 = address.find('\0', zero + 1);
    UCCL_CHECK(zero2 != std::string::npos, "fabric: malformed address blob from peer " << peer);
    std::string prov = address.substr(0, zero), layout = address.substr(zero + 1, zero2 - zero - 1),
                raw = address.substr(zero2 + 1);
    std::string mine = info_.get()->fabric_attr->prov_name;
    if (prov != mine)
      UCCL_THROW("fabric: rank " << opts_.rank << " uses provider '" << mine << "' but peer " << peer << " uses '"
                 << prov << "'; set the same FI_PROVIDER on every rank");
    if (layout != std::to_string(cq_data_bytes_))
      UCCL_THROW("fabric: rank " << opts_.rank << " sends " << cq_data_bytes_ << " bytes of CQ data but peer " << peer
                 << " sends " << layout << "; set the same UCCL_EP_FABRIC_CQ_DATA_BYTES on every rank");
    if (peer != opts_.rank) {
      fi_addr_t a = FI_ADDR_UNSPEC;
      int n = fi_av_insert(av_p_, raw.data(), 1, &a, 0, nullptr);
      if (n != 1) UCCL_THROW("fabric: fi_av_insert of peer " << peer << " failed (" << n << ")");
      peers_[peer] = a;
      connected_[peer] = 1;
    }
    auto& rr = remote_[peer];
    rr.assign(keys.size(), RegionKey{});
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i].empty()) continue;
      UCCL_CHECK(keys[i].size() == sizeof(RegionKey), "fabric: bad key blob for region " << i << " of peer " << peer);
      std::memcpy(&rr[i], keys[i].data(), sizeof(RegionKey));
    }
  }

  void write(int peer, uint32_t region, uint64_t local_off, uint64_t remote_off, uint64_t len, uint32_t imm,
             uint64_t wr_id) override {
    const RegionKey& rk = remote_key(peer, region);
    const LocalRegion& lr = local_region(region);
    if (local_off + len > lr.size || remote_off + len > rk.size)
      UCCL_THROW("fabric: write out of bounds (region " << region << ", local " << local_off << "+" << len
                 << " of " << lr.size << ", remote " << remote_off << "+" << len << " of " << rk.size << ")");
    if (len == 0) return send_ctrl(peer, Completion::kArrival, imm, kNoRegion, 0, 0, wr_id);
    if (len > max_msg_) UCCL_THROW("fabric: write of " << len << " bytes exceeds the provider's max message size " << max_msg_);
    if (peer == opts_.rank) {  // loopback without the wire, through the same CQ-data encoding
      copy_local(local_[region].base + remote_off, lr.base + local_off, len, lr.device);
      backlog_.push_back(local_completion(wr_id));
      backlog_.push_back(arrival(cq_data(imm)));
      return;
    }
    OpCtx* ctx = new_ctx(kCtxWrite, wr_id, -1);
    const uint64_t data = cq_data(imm);
    post_retry([&] {
      return fi_writedata(ep_p_, lr.base + local_off, len, descs_[region], data, peers_[peer], rk.base + remote_off,
                          rk.key, ctx);
    }, "fi_writedata", peer);
  }

  void atomic_add(int peer, uint32_t region, uint64_t remote_off, int64_t value, uint32_t imm, uint64_t wr_id) override {
    if (region != kNoRegion) {
      const RegionKey& rk = remote_key(peer, region);
      if (remote_off + 8 > rk.size || (remote_off & 7))
        UCCL_THROW("fabric: atomic at offset " << remote_off << " of region " << region << " is out of bounds or not 8-byte aligned");
    }
    send_ctrl(peer, region == kNoRegion ? Completion::kMarker : Completion::kAtomic, imm, region, remote_off, value, wr_id);
  }

  void send_failure(int peer, int64_t value) override {
    send_ctrl(peer, Completion::kFailure, 0, kNoRegion, 0, value, kUntrackedWr);
  }

  size_t undelivered_arrivals() const override { return fenced_.size(); }

  int poll(Completion* out, int max) override {
    int n = 0;
    while (n < max && !backlog_.empty()) {
      out[n++] = backlog_.front();
      backlog_.pop_front();
    }
    if (n < max) n += read_cq(out + n, max - n);
    if (copy_fence_) n += release_fenced(out + n, max - n);
    return n;
  }

 private:
  static constexpr int kRecv = 512;
  static constexpr int kSend = 512;

  using Fid = Owned<fid_t, void (*)(fid_t)>;

  // Registers host memory, or GPU memory of opts_.gpu (FI_HMEM), as one region.
  Fid register_raw(void* buf, size_t len, uint64_t requested_key, bool device, void** desc) {
    fid_mr* mr = nullptr;
    iovec iov{buf, len};
    fi_mr_attr attr{};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
    attr.requested_key = requested_key;
    attr.iface = device ? kGpuIface : FI_HMEM_SYSTEM;
    if (device && kGpuIface == FI_HMEM_CUDA) attr.device.cuda = opts_.gpu;
    // Device-only memory (cudaMalloc / hipMalloc, never managed): shm may then move it device to device
    // through IPC instead of bouncing it through host buffers.
    const int rc = fi_mr_regattr(domain_p_, &attr, device ? FI_HMEM_DEVICE_ONLY : 0, &mr);
    if (rc != 0)
      UCCL_THROW("fabric: registering " << len << " bytes of " << (device ? "GPU" : "host") << " memory with provider "
                 << info_.get()->fabric_attr->prov_name << " failed: " << fi_strerror(-rc)
                 << (device ? " (GPU memory needs a libfabric built with GPU support and, on a NIC, peer memory or "
                              "DMA-BUF)" : ""));
    Fid owned(&mr->fid, close_fid);
    if (mr_mode_ & FI_MR_ENDPOINT) {
      UCCL_CHECK_FI(fi_mr_bind(mr, &ep_p_->fid, 0));
      UCCL_CHECK_FI(fi_mr_enable(mr));
    }
    *desc = fi_mr_desc(mr);
    return owned;
  }

  const RegionKey& remote_key(int peer, uint32_t region) const {
    UCCL_CHECK(peer >= 0 && peer < opts_.world, "fabric: peer " << peer << " out of range");
    const auto& rr = remote_[peer];
    if (region >= rr.size() || !rr[region].valid)
      UCCL_THROW("fabric: peer " << peer << " has no region " << region << " (not registered or not connected)");
    return rr[region];
  }
  const LocalRegion& local_region(uint32_t region) const {
    if (region >= local_.size() || local_[region].id < 0) UCCL_THROW("fabric: local region " << region << " not registered");
    return local_[region];
  }

  // Remote CQ data of a write carrying `imm` from this rank: 8 bytes (rank << 32 | imm) or the 4-byte layout.
  uint64_t cq_data(uint32_t imm) const {
    return cq_data_bytes_ == 4 ? uint64_t(pack_compact_cq_data(opts_.rank, imm))
                               : (uint64_t(uint32_t(opts_.rank)) << 32) | imm;
  }

  // The arrival a remote write's CQ data announces (writer and immediate), checked.
  Completion arrival(uint64_t data) const {
    Completion a;
    a.kind = Completion::kArrival;
    a.peer = cq_data_bytes_ == 4 ? compact_cq_sender(uint32_t(data)) : int(data >> 32);
    a.imm = cq_data_bytes_ == 4 ? compact_cq_imm(uint32_t(data)) : uint32_t(data);
    if (a.peer < 0 || a.peer >= opts_.world)
      UCCL_THROW("fabric: remote write carries sender rank " << a.peer << " (CQ data 0x" << std::hex << data << ")");
    return a;
  }

  // A loopback write: host memcpy, or a copy on a stream of our own for GPU memory (never the legacy default
  // stream, which would wait for kernels of this process that spin until this very write lands).
  void copy_local(char* dst, const char* src, uint64_t len, bool device) {
    if (!device) {
      std::memcpy(dst, src, len);
      return;
    }
#if UCCL_EP_WITH_GPU
    if (!copy_stream_) {
      gpuStream_t st = nullptr;
      UCCL_CHECK_GPU(gpuStreamCreateWithFlags(&st, gpuStreamNonBlocking));
      copy_stream_ = Owned<gpuStream_t, void (*)(gpuStream_t)>(
          st, [](gpuStream_t x) {
            const gpuError_t e = gpuStreamDestroy(x);
            if (e != gpuSuccess) warn_release_gpu(e);
          });
    }
    UCCL_CHECK_GPU(gpuMemcpyAsync(dst, src, len, gpuMemcpyDefault, copy_stream_.get()));
    UCCL_CHECK_GPU(gpuStreamSynchronize(copy_stream_.get()));
#else
    UCCL_THROW("fabric: a loopback write of GPU memory in a build without GPU support");
#endif
  }

  Completion local_completion(uint64_t wr_id) {
    Completion c;
    c.kind = Completion::kLocal;
    c.peer = opts_.rank;
    c.wr_id = wr_id;
    return c;
  }

  OpCtx* new_ctx(CtxType t, uint64_t wr_id, int slot) {
    OpCtx* c;
    if (!free_ctx_.empty()) {
      c = free_ctx_.back();
      free_ctx_.pop_back();
    } else {
      ctx_pool_.emplace_back(new OpCtx());
      c = ctx_pool_.back().get();
    }
    std::memset(&c->fi, 0, sizeof(c->fi));
    c->type = t;
    c->wr_id = wr_id;
    c->slot = slot;
    return c;
  }

  void post_recv(int slot) {
    OpCtx* c = &ctx_[slot];
    std::memset(&c->fi, 0, sizeof(c->fi));
    c->type = kCtxRecv;
    c->slot = slot;
    post_retry([&] { return fi_recv(ep_p_, &ctrl_[slot], sizeof(CtrlMsg), ctrl_desc_, FI_ADDR_UNSPEC, c); }, "fi_recv", -1);
  }

  // Operations posted and not yet completed: writes (their contexts in use) and control sends (their slots).
  size_t outstanding() const { return (ctx_pool_.size() - free_ctx_.size()) + (size_t(kSend) - free_send_.size()); }

  // kind: a Completion::Kind the peer reports, or kCtrlBye (never to this rank itself).
  void send_ctrl(int peer, uint32_t kind, uint32_t imm, uint32_t region, uint64_t off, int64_t value, uint64_t wr_id) {
    if (peer == opts_.rank) {
      backlog_.push_back(local_completion(wr_id));
      Completion a;
      a.kind = Completion::Kind(kind);
      a.peer = peer;
      a.imm = imm;
      a.region = region;
      a.offset = off;
      a.value = value;
      backlog_.push_back(a);
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = post_deadline(start);
    while (free_send_.empty()) {  // progress until a send slot frees up
      Completion tmp[64];
      int n = read_cq(tmp, 64);
      for (int i = 0; i < n; ++i) backlog_.push_back(tmp[i]);
      if (std::chrono::steady_clock::now() > deadline)
        UCCL_THROW("fabric: no free control slot for " << seconds_since(start) << " s (peer " << peer << ")");
    }
    int slot = free_send_.back();
    free_send_.pop_back();
    CtrlMsg& m = ctrl_[slot];
    m.kind = kind;
    m.imm = imm;
    m.region = region;
    m.src = opts_.rank;
    m.offset = off;
    m.value = value;
    OpCtx* c = &ctx_[slot];
    std::memset(&c->fi, 0, sizeof(c->fi));
    c->type = kCtxSend;
    c->wr_id = wr_id;
    c->slot = slot;
    post_retry([&] { return fi_send(ep_p_, &m, sizeof(CtrlMsg), ctrl_desc_, peers_[peer], c); }, "fi_send", peer);
  }

  // Posts with retry on -FI_EAGAIN, driving progress in between (completions go to the backlog).
  template <typename F>
  void post_retry(F&& post, const char* what, int peer) {
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = post_deadline(start);
    for (;;) {
      ssize_t rc = post();
      if (rc == 0) return;
      if (rc != -FI_EAGAIN) UCCL_THROW("fabric: " << what << " to peer " << peer << " failed: " << fi_strerror(int(-rc)));
      Completion tmp[64];
      int n = read_cq(tmp, 64);
      for (int i = 0; i < n; ++i) backlog_.push_back(tmp[i]);
      if (std::chrono::steady_clock::now() > deadline)
        UCCL_THROW("fabric: " << what << " to peer " << peer << " kept returning FI_EAGAIN for " << seconds_since(start)
                              << " s");
    }
  }

  // How long a post (or a wait for a control slot) begun at `start` may retry: kPostRetryS, or less while
  // quiesce() runs (its own deadline bounds everything it calls).
  std::chrono::steady_clock::time_point post_deadline(std::chrono::steady_clock::time_point start) const {
    const auto own = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double>(kPostRetryS));
    return stop_deadline_ && *stop_deadline_ < own ? *stop_deadline_ : own;
  }

  static double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  int read_cq(Completion* out, int max) {
    fi_cq_data_entry e[64];
    int want = max < 64 ? max : 64;
    ssize_t rc = fi_cq_read(cq_p_, e, size_t(want));
    if (rc == -FI_EAGAIN) return 0;
    if (rc == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      fi_cq_readerr(cq_p_, &err, 0);
      char buf[256];
      const char* s = fi_cq_strerror(cq_p_, err.prov_errno, err.err_data, buf, sizeof(buf));
      UCCL_THROW("fabric: completion error: " << fi_strerror(err.err) << " (" << (s ? s : "") << ")");
    }
    if (rc < 0) UCCL_THROW("fabric: fi_cq_read failed: " << fi_strerror(int(-rc)));
    int n = 0;
    for (ssize_t i = 0; i < rc; ++i) {
      const fi_cq_data_entry& x = e[i];
      OpCtx* c = static_cast<OpCtx*>(x.op_context);
      if (debug_)
        std::fprintf(stderr, "[fabric r%d] cq flags=0x%llx data=0x%llx len=%zu ctx=%p type=%d\n", opts_.rank,
                     (unsigned long long)x.flags, (unsigned long long)x.data, x.len, (void*)c,
                     (c && c >= ctx_.data() && c < ctx_.data() + ctx_.size()) ? int(c->type) : -1);
      // A control message lands in one of our posted receives (some providers also flag those with
      // FI_REMOTE_CQ_DATA, data 0); anything else carrying CQ data is a remote write.
      const bool ctrl_recv = c && c >= ctx_.data() && c < ctx_.data() + ctx_.size() && c->type == kCtxRecv &&
                             !(x.flags & (FI_RMA | FI_REMOTE_WRITE));
      // Local write completions may carry FI_REMOTE_CQ_DATA too (sockets): those have FI_WRITE set.
      const bool remote_write = (x.flags & FI_REMOTE_WRITE) ||
                                ((x.flags & FI_REMOTE_CQ_DATA) && !(x.flags & (FI_WRITE | FI_SEND)) && !ctrl_recv);
      if (remote_write) {
        if (copy_fence_) {
          fenced_.push_back(arrival(x.data));
          continue;
        }
        out[n++] = arrival(x.data);
        continue;
      }
      if (!c) UCCL_THROW("fabric: completion without context (flags 0x" << std::hex << x.flags << ")");
      if (c->type == kCtxRecv) {
        const CtrlMsg m = ctrl_[c->slot];
        post_recv(c->slot);
        if (m.kind == kCtrlBye) {  // a peer's goodbye (quiesce): noted, not reported
          if (m.src < 0 || m.src >= opts_.world) UCCL_THROW("fabric: goodbye from rank " << m.src << " out of range");
          byes_ += bye_from_[m.src] ? 0 : 1;
          bye_from_[m.src] = 1;
          continue;
        }
        Completion a;
        a.kind = Completion::Kind(m.kind);
        a.peer = m.src;
        a.imm = m.imm;
        a.region = m.region;
        a.offset = m.offset;
        a.value = m.value;
        out[n++] = a;
      } else if (c->type == kCtxSend) {
        free_send_.push_back(c->slot);
        out[n++] = local_completion(c->wr_id);
      } else {
        free_ctx_.push_back(c);
        out[n++] = local_completion(c->wr_id);
      }
    }
    if (copy_fence_ && fenced_marked_ < fenced_seen()) mark_fence();
    return n;
  }

  // The copy fence (providers that copy GPU memory through the CUDA runtime): an arrival's bytes are in place
  // only once the copy libfabric queued on the legacy default stream ran, so arrivals wait for an event
  // recorded there after them. Kernels waiting for them must therefore not sit on that stream, nor may it wait
  // for them (Transport::calls_gpu_runtime; the Python backends refuse such calls).
  uint64_t fenced_seen() const { return fenced_released_ + fenced_.size(); }

  void mark_fence() {
#if defined(UCCL_EP_WITH_CUDA)
    gpuEvent_t ev = nullptr;
    if (!free_events_.empty()) {
      ev = free_events_.back();
      free_events_.pop_back();
    } else {
      UCCL_CHECK_GPU(gpuEventCreateWithFlags(&ev, gpuEventDisableTiming));
      events_.push_back(ev);
    }
    UCCL_CHECK_GPU(gpuEventRecord(ev, cudaStreamLegacy));  // where libfabric's cudaMemcpy copies queue
    fences_.push_back({ev, fenced_seen()});
    fenced_marked_ = fenced_seen();
    if (debug_)
      std::fprintf(stderr, "[fabric r%d] fence marked at %llu arrivals (%zu fences pending)\n", opts_.rank,
                   (unsigned long long)fenced_marked_, fences_.size());
#endif
  }

  int release_fenced(Completion* out, int max) {
    int n = 0;
#if defined(UCCL_EP_WITH_CUDA)
    while (!fences_.empty()) {
      const gpuError_t e = gpuEventQuery(fences_.front().first);
      if (e == gpuErrorNotReady) break;
      UCCL_CHECK_GPU(e);
      fence_done_ = fences_.front().second;
      if (debug_)
        std::fprintf(stderr, "[fabric r%d] fence passed: %llu arrivals released\n", opts_.rank,
                     (unsigned long long)fence_done_);
      free_events_.push_back(fences_.front().first);
      fences_.pop_front();
    }
    while (n < max && fenced_released_ < fence_done_) {
      out[n++] = fenced_.front();
      fenced_.pop_front();
      ++fenced_released_;
    }
#else
    (void)out;
    (void)max;
#endif
    return n;
  }

  TransportOptions opts_;
  InfoPtr info_;
  std::string provider_name_, domain_name_;  // of info_, kept past close()
  Fid fabric_, domain_, cq_, av_, ep_, ctrl_mr_;
  fid_domain* domain_p_ = nullptr;
  fid_cq* cq_p_ = nullptr;
  fid_av* av_p_ = nullptr;
  fid_ep* ep_p_ = nullptr;
  uint64_t mr_mode_ = 0;
  bool hmem_ = false;       // FI_HMEM granted: regions may be GPU memory
  // The provider may call the CUDA runtime in this endpoint's progress (provider_calls_cuda), so arrivals
  // wait for its copies (mark_fence)
  bool copy_fence_ = false;
  std::deque<Completion> fenced_;                            // arrivals not yet released, in CQ order
  uint64_t fenced_released_ = 0, fenced_marked_ = 0, fence_done_ = 0;
#if defined(UCCL_EP_WITH_CUDA)
  std::deque<std::pair<gpuEvent_t, uint64_t>> fences_;       // (event, arrivals seen when it was recorded)
  std::vector<gpuEvent_t> events_, free_events_;             // every event created / those not in flight
#endif
  int cq_data_bytes_ = 8;   // 8: rank << 32 | imm; 4: transport.h's compact layout
#if UCCL_EP_WITH_GPU
  Owned<gpuStream_t, void (*)(gpuStream_t)> copy_stream_;
#endif
  bool debug_ = env_long("UCCL_EP_DEBUG_FABRIC", 0) != 0;
  size_t max_msg_ = 0;
  std::map<int, Fid> mrs_;
  std::vector<LocalRegion> local_;
  std::vector<void*> descs_;
  std::vector<fi_addr_t> peers_;
  std::vector<char> connected_;  // per rank: connect() inserted its address (this rank itself excluded)
  std::vector<char> bye_from_;   // per rank: its goodbye arrived (quiesce)
  // set by quiesce(): no post or control-slot wait retries past it
  std::optional<std::chrono::steady_clock::time_point> stop_deadline_;
  size_t byes_ = 0;
  std::vector<std::vector<RegionKey>> remote_;
  std::vector<CtrlMsg> ctrl_;
  void* ctrl_desc_ = nullptr;
  std::vector<OpCtx> ctx_;
  std::vector<int> free_send_;
  std::vector<std::unique_ptr<OpCtx>> ctx_pool_;
  std::vector<OpCtx*> free_ctx_;
  std::deque<Completion> backlog_;
  bool closed_ = false;
};

std::unique_ptr<Transport> make_fabric_transport(const TransportOptions& o) {
  return std::unique_ptr<Transport>(new FabricTransport(o));
}

}  // namespace uccl

#else  // !UCCL_EP_WITH_FABRIC

#include "common/check.h"

#include "transport/fabric_info.h"

namespace uccl {
std::unique_ptr<Transport> make_fabric_transport(const TransportOptions&) {
  UCCL_THROW("fabric transport not compiled in: install libfabric-dev (rdma/fabric.h) and rebuild");
}
FabricProbe probe_fabric(const std::string&, const std::string&, bool) {
  UCCL_THROW("fabric transport not compiled in: install libfabric-dev (rdma/fabric.h) and rebuild");
}
}  // namespace uccl

#endif
