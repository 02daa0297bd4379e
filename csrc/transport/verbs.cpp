// VerbsTransport: libibverbs RC queue pairs (ConnectX, Broadcom, Pollara). One CQ and one shared receive
// queue per proxy thread, one RC QP per peer (the QP to this rank loops back through the NIC).
//   write       IBV_WR_RDMA_WRITE_WITH_IMM (imm = channel/signal/sequence); the receiver's WC carries it
//   atomic_add  default: a SEND of a 32-byte record that the receiver applies in sequence order (works on
//               every NIC, counters in host memory); UCCL_EP_VERBS_NATIVE_ATOMICS=1: IBV_WR_ATOMIC_FETCH_AND_ADD
//               followed by a fenced zero-length WRITE_WITH_IMM so the sequence still advances
// GPU memory registers through peer memory (ibv_reg_mr on the device pointer: nvidia-peermem) and falls
// back to DMA-BUF (ibv_reg_dmabuf_mr on an fd from cuMemGetHandleForAddressRange, or on HIP builds from
// hsa_amd_portable_export_dmabuf: upstream bnxt_re / ionic have no peer-memory client), saying which it used;
// GPU regions ask for relaxed ordering where rdma-core and the device offer it. The GID, QP attributes
// (UCCL_IB_*) and queue depths come from verbs_policy.h. EFA (SRD, no ordering) is reached through the
// fabric transport's efa provider; this file is RC only. Compiled with libibverbs-dev; needs a NIC to run.
#include "transport/transport.h"

#if defined(UCCL_EP_WITH_VERBS)

#include <arpa/inet.h>
#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <stdexcept>
#include <map>
#include <vector>

#include "common/check.h"
#include "common/env.h"
#include "common/portability.h"
#include "common/raii.h"
#include "transport/verbs_policy.h"
#include "transport/verbs_query.h"

namespace uccl {
namespace {

struct VerbsAddress {
  uint32_t psn;
  uint16_t lid;
  uint8_t port;
  uint8_t mtu;
  uint8_t gid[16];
  uint8_t max_dest_rd_atomic;  // RDMA reads / atomics this end accepts in flight (the peer's initiator bound)
  uint8_t pad[3];
  uint32_t num_qps;
  // followed by num_qps uint32 QP numbers, one per peer rank
};

struct VerbsKey {
  uint64_t addr;
  uint32_t rkey;
  uint32_t pad;
  uint64_t size;
};

struct CtrlMsg {
  uint32_t kind;
  uint32_t imm;
  uint32_t region;
  int32_t src;
  uint64_t offset;
  int64_t value;
};

constexpr int kSendSlots = 1024;
constexpr uint64_t kRecvTag = 1ull << 63;  // wr_id high bit: a receive slot
constexpr uint64_t kCtrlTag = 1ull << 62;  // a send slot (control message), low bits = slot | wr_id in table

#if UCCL_EP_WITH_GPU && defined(UCCL_EP_WITH_CUDA)
// DMA-BUF fd for a device range through the driver entry point (no libcuda link).
int dmabuf_fd_for(void* ptr, size_t size) {
  using Fn = int (*)(void*, unsigned long long, size_t, int, unsigned long long);
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
  if (cudaGetDriverEntryPointByVersion("cuMemGetHandleForAddressRange", &p, 12000, cudaEnableDefault, &q) != cudaSuccess) return -1;
#else
  if (cudaGetDriverEntryPoint("cuMemGetHandleForAddressRange", &p, cudaEnableDefault, &q) != cudaSuccess) return -1;
#endif
  if (!p) return -1;
  int fd = -1;
  // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
  if (reinterpret_cast<Fn>(p)(&fd, (unsigned long long)reinterpret_cast<uintptr_t>(ptr), size, 1, 0) != 0) return -1;
  return fd;
}
#elif UCCL_EP_WITH_GPU && defined(UCCL_EP_WITH_HIP)
// DMA-BUF fd (and the range's offset in it) through ROCr's hsa_amd_portable_export_dmabuf (ROCm >= 5.6;
// looked up at run time, libhsa-runtime64 is loaded with HIP). -1 when absent or refused.
int dmabuf_fd_for(void* ptr, size_t size, uint64_t* offset) {
  using Fn = int (*)(const void*, size_t, int*, uint64_t*);  // hsa_status_t, HSA_STATUS_SUCCESS = 0
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "hsa_amd_portable_export_dmabuf"));
  if (!fn) {
    void* h = dlopen("libhsa-runtime64.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h) fn = reinterpret_cast<Fn>(dlsym(h, "hsa_amd_portable_export_dmabuf"));
  }
  int fd = -1;
  if (!fn || fn(ptr, size, &fd, offset) != 0) return -1;
  return fd;
}
#endif

const char* wc_hint(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_RETRY_EXC_ERR:
      return "the peer did not acknowledge within UCCL_IB_TIMEOUT x UCCL_IB_RETRY_CNT: the fabric dropped "
             "packets (Broadcom Thor-2 / AMD Pollara need the flow control of docs/proxy.md) or the peer is gone";
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return "the peer's receive queue stayed empty through UCCL_IB_RNR_RETRY retries: its proxy stopped polling";
    case IBV_WC_REM_ACCESS_ERR:
      return "the peer refused the memory key: region sizes or registrations differ between ranks";
    default:
      return nullptr;
  }
}

}  // namespace

class VerbsTransport final : public Transport {
 public:
  explicit VerbsTransport(const TransportOptions& o) : o_(o) {
    native_atomics_ = env_long("UCCL_EP_VERBS_NATIVE_ATOMICS", 0) != 0;
    try {
      set_ = parse_verbs_settings([](const char* n) { return std::getenv(n); });
    } catch (const std::invalid_argument& e) {
      UCCL_THROW("verbs: " << e.what());
    }
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (!list || n == 0) {
      if (list) ibv_free_device_list(list);
      UCCL_THROW("verbs: no RDMA devices (run `uccl-ep-train doctor`); use the fabric or ipc transport");
    }
    auto list_guard = own(list, [](ibv_device** l) { ibv_free_device_list(l); });
    std::string want = o.device.empty() ? env_str("UCCL_EP_VERBS_DEVICE") : o.device;
    ibv_device* dev = nullptr;
    for (int i = 0; i < n && !dev; ++i)
      if (want.empty() || want == ibv_get_device_name(list[i])) dev = list[i];
    if (!dev) UCCL_THROW("verbs: device '" << want << "' not found");
    dev_name_ = ibv_get_device_name(dev);
    ibv_context* ctx = nullptr;
    UCCL_CHECK_VERBS_PTR(ctx, ibv_open_device(dev));
    ctx_ = own(ctx, +[](ibv_context* c) { warn_release("ibv_close_device", ibv_close_device(c)); });
    ibv_pd* pd = nullptr;
    UCCL_CHECK_VERBS_PTR(pd, ibv_alloc_pd(ctx));
    pd_ = own(pd, +[](ibv_pd* p) { warn_release("ibv_dealloc_pd", ibv_dealloc_pd(p)); });
    ibv_device_attr da{};
    UCCL_CHECK_VERBS(ibv_query_device(ctx, &da));
    atomic_cap_ = da.atomic_cap;
    // RDMA reads / atomics in flight: 16 at most, as far as the device allows (initiator and responder side).
    max_rd_atomic_ = std::min(16, da.max_qp_init_rd_atom);
    max_dest_rd_atomic_ = std::min(16, da.max_qp_rd_atom);

    // Queues sized for the worst case in flight (verbs_queue_depths), within the device's limits.
    VerbsLimits lim;
    lim.max_cqe = da.max_cqe;
    lim.max_srq_wr = da.max_srq_wr;
    lim.max_qp_wr = da.max_qp_wr;
    VerbsDepths depth;
    try {
      depth = verbs_queue_depths(o.world, o.max_inflight, lim, dev_name_);
    } catch (const std::invalid_argument& e) {
      UCCL_THROW(e.what());
    }
    recv_slots_ = depth.srq;
    ibv_cq* cq = nullptr;
    UCCL_CHECK_VERBS_PTR(cq, ibv_create_cq(ctx, depth.cq, nullptr, nullptr, 0));
    cq_ = own(cq, +[](ibv_cq* c) { warn_release("ibv_destroy_cq", ibv_destroy_cq(c)); });
    ibv_srq_init_attr sa{};
    sa.attr.max_wr = uint32_t(depth.srq);
    sa.attr.max_sge = 1;
    ibv_srq* srq = nullptr;
    UCCL_CHECK_VERBS_PTR(srq, ibv_create_srq(pd, &sa));
    srq_ = own(srq, +[](ibv_srq* s) { warn_release("ibv_destroy_srq", ibv_destroy_srq(s)); });

    // Port: the first active one.
    for (int p = 1; p <= da.phys_port_cnt; ++p) {
      ibv_port_attr pa{};
      if (ibv_query_port(ctx, uint8_t(p), &pa) == 0 && pa.state == IBV_PORT_ACTIVE) {
        port_ = uint8_t(p);
        port_attr_ = pa;
        break;
      }
    }
    if (!port_) UCCL_THROW("verbs: device " << dev_name_ << " has no active port");
    roce_ = port_attr_.link_layer == IBV_LINK_LAYER_ETHERNET;
    const std::vector<GidEntry> gids = read_gid_table(ctx, dev->ibdev_path, port_, port_attr_.gid_tbl_len, roce_);
    GidChoice choice;
    try {
      choice = choose_gid(gids, roce_, set_.gid_index, dev_name_ + " port " + std::to_string(port_));
    } catch (const std::invalid_argument& e) {
      UCCL_THROW(e.what());
    }
    gid_index_ = choice.index;
    Gid chosen{};
    for (const auto& e : gids)
      if (e.index == gid_index_) chosen = e.raw;
    std::memcpy(gid_.raw, chosen.data(), 16);
    if (o.thread_index == 0)
      std::fprintf(stderr, "uccl_ep_train: verbs %s port %d GID %d (%s): %s; timeout %d retry %d rnr_retry %d sl %d tc %d\n",
                   dev_name_.c_str(), int(port_), gid_index_, choice.why.c_str(), gid_to_string(chosen).c_str(),
                   set_.timeout, set_.retry_cnt, set_.rnr_retry, set_.sl, set_.tc);

    // Control buffers (receive slots, then send slots, then the native atomics' fetch scratch), one registration.
    ctrl_.resize(size_t(recv_slots_) + kSendSlots + 1);
    ibv_mr* mr = nullptr;
    UCCL_CHECK_VERBS_PTR(mr, ibv_reg_mr(pd, ctrl_.data(), ctrl_.size() * sizeof(CtrlMsg), IBV_ACCESS_LOCAL_WRITE));
    ctrl_mr_ = own(mr, +[](ibv_mr* m) { warn_release("ibv_dereg_mr", ibv_dereg_mr(m)); });
    for (int i = 0; i < recv_slots_; ++i) post_recv(i);
    for (int i = 0; i < kSendSlots; ++i) free_send_.push_back(i);

    // One RC QP per peer, all on the shared CQ and SRQ.
    psn_ = uint32_t(getpid() * 7919 + o.thread_index * 104729) & 0xffffff;
    qps_.resize(o.world);
    for (int peer = 0; peer < o.world; ++peer) {
      ibv_qp_init_attr qa{};
      qa.send_cq = cq;
      qa.recv_cq = cq;
      qa.srq = srq;
      qa.qp_type = IBV_QPT_RC;
      qa.cap.max_send_wr = uint32_t(depth.send_wr);
      qa.cap.max_send_sge = 1;
      qa.cap.max_inline_data = 64;
      ibv_qp* qp = nullptr;
      UCCL_CHECK_VERBS_PTR(qp, ibv_create_qp(pd, &qa));
      qps_[peer] = own(qp, +[](ibv_qp* q) { warn_release("ibv_destroy_qp", ibv_destroy_qp(q)); });
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_INIT;
      a.pkey_index = 0;
      a.port_num = port_;
      a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
      UCCL_CHECK_VERBS(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS));
      qpn_peer_[qp->qp_num] = peer;
    }
    remote_.resize(o.world);
  }

  ~VerbsTransport() override { close(); }

  const char* name() const override { return "verbs"; }
  std::string opened_device() const override { return dev_name_; }

  std::string address() override {
    std::string out(sizeof(VerbsAddress) + 4 * qps_.size(), '\0');
    VerbsAddress a{};
    a.psn = psn_;
    a.lid = port_attr_.lid;
    a.port = port_;
    a.mtu = uint8_t(port_attr_.active_mtu);
    std::memcpy(a.gid, gid_.raw, 16);
    a.max_dest_rd_atomic = uint8_t(max_dest_rd_atomic_);
    a.num_qps = uint32_t(qps_.size());
    std::memcpy(&out[0], &a, sizeof(a));
    for (size_t i = 0; i < qps_.size(); ++i) {
      uint32_t qpn = qps_[i].get()->qp_num;
      std::memcpy(&out[sizeof(a) + 4 * i], &qpn, 4);
    }
    return out;
  }

  std::string register_region(const LocalRegion& r) override {
    const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    const char* how = "ibv_reg_mr";
    ibv_mr* mr = nullptr;
    if (r.device) {
      // Relaxed ordering lets the NIC reorder PCIe writes into GPU memory (the proxy orders by completion,
      // not by memory). rdma-core treats the flag as optional; an older kernel that refuses it gets a retry.
      mr = ibv_reg_mr(pd_.get(), r.base, r.size, access | IBV_ACCESS_RELAXED_ORDERING);
      if (mr) how = "ibv_reg_mr (peer memory, relaxed ordering)";
    }
    if (!mr) {
      mr = ibv_reg_mr(pd_.get(), r.base, r.size, access);
      if (mr && r.device) how = "ibv_reg_mr (peer memory)";
    }
    const int peer_errno = errno;
#if UCCL_EP_WITH_GPU && (defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP))
    if (!mr && r.device) {  // no peer-memory client: DMA-BUF
      using RegDmabuf = ibv_mr* (*)(ibv_pd*, uint64_t, size_t, uint64_t, int, int);
      auto reg = reinterpret_cast<RegDmabuf>(dlsym(RTLD_DEFAULT, "ibv_reg_dmabuf_mr"));
      uint64_t offset = 0;
#if defined(UCCL_EP_WITH_CUDA)
      int fd = reg ? dmabuf_fd_for(r.base, r.size) : -1;
      const char* source = "cuMemGetHandleForAddressRange";
      const char* via = "DMA-BUF (cuMemGetHandleForAddressRange + ibv_reg_dmabuf_mr)";
#else
      int fd = reg ? dmabuf_fd_for(r.base, r.size, &offset) : -1;
      const char* source = "hsa_amd_portable_export_dmabuf";
      const char* via = "DMA-BUF (hsa_amd_portable_export_dmabuf + ibv_reg_dmabuf_mr)";
#endif
      int dmabuf_errno = 0;
      if (fd >= 0) {
        const uint64_t iova = uint64_t(reinterpret_cast<uintptr_t>(r.base));
        mr = reg(pd_.get(), offset, r.size, iova, fd, access | IBV_ACCESS_RELAXED_ORDERING);
        if (!mr) mr = reg(pd_.get(), offset, r.size, iova, fd, access);
        dmabuf_errno = errno;
        ::close(fd);
        if (mr) how = via;
      }
      if (!mr)
        UCCL_THROW("verbs: GPU memory registration of region " << r.id << " (" << r.size << " bytes) on " << dev_name_
                   << " failed: peer memory (ibv_reg_mr: " << std::strerror(peer_errno) << ") and DMA-BUF ("
                   << (!reg ? "this libibverbs has no ibv_reg_dmabuf_mr: rdma-core >= 34 needed"
                            : fd < 0 ? std::string(source) + " gave no fd: driver / ROCm or CUDA too old"
                                     : std::string("ibv_reg_dmabuf_mr: ") + std::strerror(dmabuf_errno))
                   << "); load nvidia_peermem (NVIDIA) or use a kernel, driver and NIC with DMA-BUF "
                      "(`uccl-ep-train doctor` reports both)");
    }
#endif
    if (!mr)
      UCCL_THROW("verbs: MR registration of region " << r.id << " (" << r.size << " bytes, "
                 << (r.device ? "GPU" : "host") << " memory) on " << dev_name_ << " failed: " << std::strerror(peer_errno)
                 << (r.device ? " (this build has no GPU runtime for DMA-BUF)" : ""));
    if (r.device && o_.thread_index == 0)
      std::fprintf(stderr, "uccl_ep_train: verbs region %d registered on %s with %s\n", r.id, dev_name_.c_str(), how);
    if (mrs_.size() <= size_t(r.id)) mrs_.resize(size_t(r.id) + 1);
    mrs_[r.id] = own(mr, +[](ibv_mr* m) { warn_release("ibv_dereg_mr", ibv_dereg_mr(m)); });
    if (local_.size() <= size_t(r.id)) local_.resize(size_t(r.id) + 1);
    local_[r.id] = r;
    VerbsKey k{};
    k.addr = uint64_t(reinterpret_cast<uintptr_t>(r.base));
    k.rkey = mr->rkey;
    k.size = r.size;
    return std::string(reinterpret_cast<const char*>(&k), sizeof(k));
  }

  void connect(int peer, const std::string& address, const std::vector<std::string>& keys) override {
    UCCL_CHECK(address.size() >= sizeof(VerbsAddress), "verbs: bad address blob from peer " << peer);
    VerbsAddress a;
    std::memcpy(&a, address.data(), sizeof(a));
    UCCL_CHECK(a.num_qps == uint32_t(o_.world) && address.size() == sizeof(a) + 4 * a.num_qps,
               "verbs: peer " << peer << " has " << a.num_qps << " QPs, world is " << o_.world);
    uint32_t dest_qpn;
    std::memcpy(&dest_qpn, address.data() + sizeof(a) + 4 * size_t(o_.rank), 4);
    ibv_qp* qp = qps_[peer].get();
    ibv_qp_attr r{};
    r.qp_state = IBV_QPS_RTR;
    r.path_mtu = ibv_mtu(std::min<int>(a.mtu, port_attr_.active_mtu));
    r.dest_qp_num = dest_qpn;
    r.rq_psn = a.psn;
    r.max_dest_rd_atomic = uint8_t(max_dest_rd_atomic_);
    r.min_rnr_timer = kMinRnrTimer;
    r.ah_attr.port_num = port_;
    r.ah_attr.sl = uint8_t(set_.sl);
    if (roce_ || a.lid == 0) {
      r.ah_attr.is_global = 1;
      std::memcpy(r.ah_attr.grh.dgid.raw, a.gid, 16);
      r.ah_attr.grh.sgid_index = uint8_t(gid_index_);
      r.ah_attr.grh.hop_limit = 64;
      r.ah_attr.grh.traffic_class = uint8_t(set_.tc);
    } else {
      r.ah_attr.dlid = a.lid;
    }
    UCCL_CHECK_VERBS(ibv_modify_qp(qp, &r, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER));
    ibv_qp_attr s{};
    s.qp_state = IBV_QPS_RTS;
    s.timeout = uint8_t(set_.timeout);
    s.retry_cnt = uint8_t(set_.retry_cnt);
    s.rnr_retry = uint8_t(set_.rnr_retry);
    s.sq_psn = psn_;
    s.max_rd_atomic = uint8_t(std::min<int>(max_rd_atomic_, a.max_dest_rd_atomic));  // within the peer's responder
    UCCL_CHECK_VERBS(ibv_modify_qp(qp, &s, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                               IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC));
    auto& rr = remote_[peer];
    rr.assign(keys.size(), VerbsKey{});
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i].empty()) continue;
      UCCL_CHECK(keys[i].size() == sizeof(VerbsKey), "verbs: bad key blob for region " << i << " of peer " << peer);
      std::memcpy(&rr[i], keys[i].data(), sizeof(VerbsKey));
    }
  }

  void write(int peer, uint32_t region, uint64_t local_off, uint64_t remote_off, uint64_t len, uint32_t imm,
             uint64_t wr_id) override {
    const VerbsKey& k = key(peer, region);
    if (region >= local_.size() || local_[region].id < 0) UCCL_THROW("verbs: local region " << region << " not registered");
    const LocalRegion& l = local_[region];
    if (local_off + len > l.size || remote_off + len > k.size) UCCL_THROW("verbs: write out of bounds in region " << region);
    ibv_sge sge{};
    sge.addr = uint64_t(reinterpret_cast<uintptr_t>(l.base + local_off));
    sge.length = uint32_t(len);
    sge.lkey = mrs_[region].get()->lkey;
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.imm_data = htonl(imm);
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.sg_list = len ? &sge : nullptr;
    wr.num_sge = len ? 1 : 0;
    wr.wr.rdma.remote_addr = k.addr + remote_off;
    wr.wr.rdma.rkey = k.rkey;
    post(peer, &wr);
  }

  void atomic_add(int peer, uint32_t region, uint64_t remote_off, int64_t value, uint32_t imm, uint64_t wr_id) override {
    if (region != kNoRegion && native_atomics_ && atomic_cap_ != IBV_ATOMIC_NONE) {
      const VerbsKey& k = key(peer, region);
      if (remote_off + 8 > k.size || (remote_off & 7)) UCCL_THROW("verbs: atomic at bad offset " << remote_off);
      ibv_sge sge{};
      sge.addr = uint64_t(reinterpret_cast<uintptr_t>(&ctrl_.back()));  // fetch result lands in a scratch slot
      sge.length = 8;
      sge.lkey = ctrl_mr_.get()->lkey;
      ibv_send_wr wr{};
      wr.wr_id = kCtrlTag | 0xffffffull;  // unsignaled in effect: completion ignored below
      wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.wr.atomic.remote_addr = k.addr + remote_off;
      wr.wr.atomic.rkey = k.rkey;
      wr.wr.atomic.compare_add = uint64_t(value);
      post(peer, &wr);
      // The sequence advances with a fenced zero-length write: it waits for the atomic to finish.
      ibv_send_wr m{};
      m.wr_id = wr_id;
      m.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      m.imm_data = htonl(imm & ~kImmSignalBit);
      m.send_flags = IBV_SEND_SIGNALED | IBV_SEND_FENCE;
      m.wr.rdma.remote_addr = k.addr + remote_off;
      m.wr.rdma.rkey = k.rkey;
      post(peer, &m);
      return;
    }
    send_ctrl(peer, region == kNoRegion ? Completion::kMarker : Completion::kAtomic, imm, region, remote_off, value,
              wr_id);
  }

  void send_failure(int peer, int64_t value) override {
    send_ctrl(peer, Completion::kFailure, 0, kNoRegion, 0, value, kUntrackedWr);
  }

  // A control message (emulated atomic, marker, failure) in a send slot of its own.
  void send_ctrl(int peer, uint32_t kind, uint32_t imm, uint32_t region, uint64_t remote_off, int64_t value,
                 uint64_t wr_id) {
    if (free_send_.empty()) drain_for_send_slot(peer);
    int slot = free_send_.back();
    free_send_.pop_back();
    CtrlMsg& c = ctrl_[size_t(recv_slots_) + size_t(slot)];
    c.kind = kind;
    c.imm = imm;
    c.region = region;
    c.src = o_.rank;
    c.offset = remote_off;
    c.value = value;
    ibv_sge sge{};
    sge.addr = uint64_t(reinterpret_cast<uintptr_t>(&c));
    sge.length = sizeof(CtrlMsg);
    sge.lkey = ctrl_mr_.get()->lkey;
    ibv_send_wr wr{};
    send_wr_[slot] = wr_id;
    wr.wr_id = kCtrlTag | uint64_t(slot);
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    post(peer, &wr);
  }

  int poll(Completion* out, int max) override {
    int n = 0;
    while (n < max && !backlog_.empty()) {
      out[n++] = backlog_.front();
      backlog_.pop_front();
    }
    if (n < max) n += poll_cq(out + n, max - n);
    return n;
  }

  void close() override {
    if (closed_) return;
    closed_ = true;
    for (auto& q : qps_) q.reset();
    for (auto& m : mrs_) m.reset();
    ctrl_mr_.reset();
    srq_.reset();
    cq_.reset();
    pd_.reset();
    ctx_.reset();
  }

 private:
  const VerbsKey& key(int peer, uint32_t region) const {
    UCCL_CHECK(peer >= 0 && peer < o_.world, "verbs: peer " << peer << " out of range");
    const auto& rr = remote_[peer];
    if (region >= rr.size() || !rr[region].rkey) UCCL_THROW("verbs: peer " << peer << " has no region " << region);
    return rr[region];
  }

  void post_recv(int slot) {
    ibv_sge sge{};
    sge.addr = uint64_t(reinterpret_cast<uintptr_t>(&ctrl_[slot]));
    sge.length = sizeof(CtrlMsg);
    sge.lkey = ctrl_mr_.get()->lkey;
    ibv_recv_wr wr{}, *bad = nullptr;
    wr.wr_id = kRecvTag | uint64_t(slot);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    UCCL_CHECK_VERBS(ibv_post_srq_recv(srq_.get(), &wr, &bad));
  }

  void post(int peer, ibv_send_wr* wr) {
    ibv_send_wr* bad = nullptr;
    int rc = ibv_post_send(qps_[peer].get(), wr, &bad);
    if (rc) UCCL_THROW("verbs: ibv_post_send to peer " << peer << " failed: " << std::strerror(rc));
  }

  void drain_for_send_slot(int peer) {
    for (int spins = 0; free_send_.empty(); ++spins) {
      Completion tmp[64];
      int n = poll_cq(tmp, 64);
      for (int i = 0; i < n; ++i) backlog_.push_back(tmp[i]);
      if (spins > (1 << 26)) UCCL_THROW("verbs: no free send slot (peer " << peer << " not completing)");
    }
  }

  int poll_cq(Completion* out, int max) {
    ibv_wc wc[64];
    int got = ibv_poll_cq(cq_.get(), max < 64 ? max : 64, wc);
    if (got < 0) UCCL_THROW("verbs: ibv_poll_cq failed");
    int n = 0;
    for (int i = 0; i < got; ++i) {
      const ibv_wc& w = wc[i];
      if (w.status != IBV_WC_SUCCESS) {
        auto it = qpn_peer_.find(w.qp_num);
        const char* hint = wc_hint(w.status);
        UCCL_THROW("verbs: completion error on " << dev_name_ << " (peer " << (it == qpn_peer_.end() ? -1 : it->second)
                   << "): " << ibv_wc_status_str(w.status) << " (status " << int(w.status) << ", vendor err "
                   << w.vendor_err << ")" << (hint ? std::string("; ") + hint : std::string())
                   << "; flow control in effect: UCCL_IB_MAX_INFLIGHT_NORMAL/_LOW_LATENCY=" << o_.max_inflight
                   << " UCCL_IB_MAX_INFLIGHT_BYTES=" << o_.max_inflight_bytes << ", UCCL_IB_TIMEOUT=" << set_.timeout
                   << " UCCL_IB_RETRY_CNT=" << set_.retry_cnt << " UCCL_IB_RNR_RETRY=" << set_.rnr_retry);
      }
      if (w.wr_id & kRecvTag) {
        const int slot = int(w.wr_id & 0xffffffffull);
        auto it = qpn_peer_.find(w.qp_num);
        const int peer = it == qpn_peer_.end() ? -1 : it->second;
        Completion c;
        if (w.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
          c.kind = Completion::kArrival;
          c.peer = peer;
          c.imm = ntohl(w.imm_data);
        } else {
          const CtrlMsg m = ctrl_[slot];
          c.kind = Completion::Kind(m.kind);
          c.peer = m.src;
          c.imm = m.imm;
          c.region = m.region;
          c.offset = m.offset;
          c.value = m.value;
        }
        post_recv(slot);
        out[n++] = c;
        continue;
      }
      Completion l;
      l.kind = Completion::kLocal;
      l.peer = o_.rank;
      if (w.wr_id & kCtrlTag) {
        const uint64_t slot = w.wr_id & 0xffffffull;
        if (slot == 0xffffffull) continue;  // the native atomic itself; its fenced marker reports
        free_send_.push_back(int(slot));
        l.wr_id = send_wr_[slot];
      } else {
        l.wr_id = w.wr_id;
      }
      out[n++] = l;
    }
    return n;
  }

  TransportOptions o_;
  std::string dev_name_;
  Owned<ibv_context*, void (*)(ibv_context*)> ctx_;
  Owned<ibv_pd*, void (*)(ibv_pd*)> pd_;
  Owned<ibv_cq*, void (*)(ibv_cq*)> cq_;
  Owned<ibv_srq*, void (*)(ibv_srq*)> srq_;
  Owned<ibv_mr*, void (*)(ibv_mr*)> ctrl_mr_;
  std::vector<Owned<ibv_qp*, void (*)(ibv_qp*)>> qps_;
  std::vector<Owned<ibv_mr*, void (*)(ibv_mr*)>> mrs_;
  std::vector<LocalRegion> local_;
  std::vector<std::vector<VerbsKey>> remote_;
  std::map<uint32_t, int> qpn_peer_;
  std::vector<CtrlMsg> ctrl_;
  std::vector<int> free_send_;
  uint64_t send_wr_[kSendSlots] = {};
  int recv_slots_ = 0;  // SRQ depth: control slots [0, recv_slots_), send slots after them
  std::deque<Completion> backlog_;
  ibv_port_attr port_attr_{};
  ibv_gid gid_{};
  uint8_t port_ = 0;
  bool roce_ = false;
  VerbsSettings set_;
  int gid_index_ = 0;
  int max_rd_atomic_ = 0, max_dest_rd_atomic_ = 0;
  uint32_t psn_ = 0;
  int atomic_cap_ = 0;
  bool native_atomics_ = false;
  bool closed_ = false;
};

std::unique_ptr<Transport> make_verbs_transport(const TransportOptions& o) {
  return std::unique_ptr<Transport>(new VerbsTransport(o));
}

}  // namespace uccl

#else

#include "common/check.h"

namespace uccl {
std::unique_ptr<Transport> make_verbs_transport(const TransportOptions&) {
  UCCL_THROW("verbs transport not compiled in: install libibverbs-dev (infiniband/verbs.h) and rebuild");
}
}  // namespace uccl

#endif
