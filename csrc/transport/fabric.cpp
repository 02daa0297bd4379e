// FabricTransport: libfabric RDM endpoint. Writes go out as fi_writedata (64-bit remote CQ data: the
// 32-bit immediate plus the sender's rank); atomics, zero-length writes and markers go out as small
// two-sided messages that the receiver turns into ordered local updates (the transport has no atomics
// on tcp/shm, and EFA has none either). Runs on tcp;ofi_rxm, shm and sockets here; efa on AWS.
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

#include "common/check.h"
#include "common/env.h"
#include "common/raii.h"

namespace uccl {
namespace {

struct RegionKey {
  uint64_t base;  // remote virtual address when the provider wants FI_MR_VIRT_ADDR, else 0
  uint64_t key;
  uint64_t size;
  uint64_t valid;
};

// A control message (atomic, marker, zero-length write). 32 bytes.
struct CtrlMsg {
  uint32_t kind;  // Completion::Kind
  uint32_t imm;
  uint32_t region;
  int32_t src;
  uint64_t offset;
  int64_t value;
};

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

}  // namespace

class FabricTransport final : public Transport {
 public:
  explicit FabricTransport(const TransportOptions& o) : opts_(o), peers_(o.world), remote_(o.world) {
    fi_info* hints = fi_allocinfo();
    UCCL_CHECK(hints != nullptr, "fi_allocinfo failed");
    auto hints_guard = own(hints, [](fi_info* h) { fi_freeinfo(h); });
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_MSG | FI_RMA;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->data_progress = FI_PROGRESS_MANUAL;
    hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    std::string prov = o.provider.empty() ? env_str("FI_PROVIDER") : o.provider;
    if (!prov.empty()) hints->fabric_attr->prov_name = strdup(prov == "tcp" ? "tcp;ofi_rxm" : prov.c_str());
    // Delivery-complete local completions when the provider offers them, transmit-complete otherwise.
    // The writer's rank travels in the upper 32 bits of the 64-bit CQ data (FI_SOURCE addresses proved
    // unreliable across providers), the immediate in the lower 32.
    fi_info* info = nullptr;
    int rc = fi_getinfo(FI_VERSION(1, 10), nullptr, nullptr, 0, hints, &info);
    if (rc != 0 || !info) {
      hints->tx_attr->op_flags = 0;
      rc = fi_getinfo(FI_VERSION(1, 10), nullptr, nullptr, 0, hints, &info);
    }
    if (rc != 0 || !info)
      UCCL_THROW("fabric: no libfabric provider offers FI_EP_RDM with FI_MSG|FI_RMA"
                 << (prov.empty() ? std::string() : " for provider '" + prov + "'") << ": " << fi_strerror(-rc)
                 << " (try FI_PROVIDER=tcp, shm or sockets; tcp needs FI_TCP_IFACE, e.g. lo)");
    info_ = Owned<fi_info*, void (*)(fi_info*)>(info, [](fi_info* i) { fi_freeinfo(i); });
    if (info->domain_attr->cq_data_size < 8)
      UCCL_THROW("fabric: provider " << info->fabric_attr->prov_name << " carries only "
                 << info->domain_attr->cq_data_size << " bytes of remote CQ data (need 8)");
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
    UCCL_CHECK_FI(fi_enable(ep));

    // Control-message buffers: kRecv posted receives + kSend send slots, one registration.
    ctrl_.resize(kRecv + kSend);
    ctrl_mr_ = register_raw(ctrl_.data(), ctrl_.size() * sizeof(CtrlMsg), 1000, &ctrl_desc_);
    ctx_.resize(kRecv + kSend);
    for (int i = 0; i < kRecv; ++i) post_recv(i);
    for (int i = 0; i < kSend; ++i) free_send_.push_back(kRecv + i);
  }

  ~FabricTransport() override { close(); }

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
  }

  const char* name() const override { return "fabric"; }

  std::string address() override {
    char buf[256];
    size_t len = sizeof(buf);
    UCCL_CHECK_FI(fi_getname(&ep_p_->fid, buf, &len));
    std::string prov = info_.get()->fabric_attr->prov_name;
    return prov + '\0' + std::string(buf, len);
  }

  std::string register_region(const LocalRegion& r) override {
    if (r.device) UCCL_THROW("fabric: region " << r.id << " is GPU memory; this libfabric build has no FI_HMEM path");
    if (r.id < 0 || r.id >= 256) UCCL_THROW("fabric: region id " << r.id << " out of range [0, 256)");
    void* desc = nullptr;
    auto mr = register_raw(r.base, r.size, uint64_t(r.id) + 1, &desc);
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
    std::string prov = address.substr(0, zero), raw = address.substr(zero + 1);
    std::string mine = info_.get()->fabric_attr->prov_name;
    if (prov != mine)
      UCCL_THROW("fabric: rank " << opts_.rank << " uses provider '" << mine << "' but peer " << peer << " uses '"
                 << prov << "'; set the same FI_PROVIDER on every rank");
    if (peer != opts_.rank) {
      fi_addr_t a = FI_ADDR_UNSPEC;
      int n = fi_av_insert(av_p_, raw.data(), 1, &a, 0, nullptr);
      if (n != 1) UCCL_THROW("fabric: fi_av_insert of peer " << peer << " failed (" << n << ")");
      peers_[peer] = a;
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
    if (peer == opts_.rank) {  // loopback without the wire
      std::memcpy(local_[region].base + remote_off, lr.base + local_off, len);
      backlog_.push_back(local_completion(wr_id));
      Completion a;
      a.kind = Completion::kArrival;
      a.peer = peer;
      a.imm = imm;
      backlog_.push_back(a);
      return;
    }
    OpCtx* ctx = new_ctx(kCtxWrite, wr_id, -1);
    const uint64_t data = (uint64_t(uint32_t(opts_.rank)) << 32) | imm;
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

  int poll(Completion* out, int max) override {
    int n = 0;
    while (n < max && !backlog_.empty()) {
      out[n++] = backlog_.front();
      backlog_.pop_front();
    }
    if (n < max) n += read_cq(out + n, max - n);
    return n;
  }

 private:
  static constexpr int kRecv = 512;
  static constexpr int kSend = 512;

  using Fid = Owned<fid_t, void (*)(fid_t)>;

  Fid register_raw(void* buf, size_t len, uint64_t requested_key, void** desc) {
    fid_mr* mr = nullptr;
    UCCL_CHECK_FI(fi_mr_reg(domain_p_, buf, len, FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND | FI_RECV,
                            0, requested_key, 0, &mr, nullptr));
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

  void send_ctrl(int peer, Completion::Kind kind, uint32_t imm, uint32_t region, uint64_t off, int64_t value, uint64_t wr_id) {
    if (peer == opts_.rank) {
      backlog_.push_back(local_completion(wr_id));
      Completion a;
      a.kind = kind;
      a.peer = peer;
      a.imm = imm;
      a.region = region;
      a.offset = off;
      a.value = value;
      backlog_.push_back(a);
      return;
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (free_send_.empty()) {  // progress until a send slot frees up
      Completion tmp[64];
      int n = read_cq(tmp, 64);
      for (int i = 0; i < n; ++i) backlog_.push_back(tmp[i]);
      if (std::chrono::steady_clock::now() > deadline) UCCL_THROW("fabric: no free control slot for 30 s (peer " << peer << ")");
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
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (;;) {
      ssize_t rc = post();
      if (rc == 0) return;
      if (rc != -FI_EAGAIN) UCCL_THROW("fabric: " << what << " to peer " << peer << " failed: " << fi_strerror(int(-rc)));
      Completion tmp[64];
      int n = read_cq(tmp, 64);
      for (int i = 0; i < n; ++i) backlog_.push_back(tmp[i]);
      if (std::chrono::steady_clock::now() > deadline)
        UCCL_THROW("fabric: " << what << " to peer " << peer << " kept returning FI_EAGAIN for 30 s");
    }
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
        Completion a;
        a.kind = Completion::kArrival;
        a.peer = int(x.data >> 32);
        if (a.peer < 0 || a.peer >= opts_.world)
          UCCL_THROW("fabric: remote write carries sender rank " << a.peer << " (CQ data 0x" << std::hex << x.data << ")");
        a.imm = uint32_t(x.data);
        out[n++] = a;
        continue;
      }
      if (!c) UCCL_THROW("fabric: completion without context (flags 0x" << std::hex << x.flags << ")");
      if (c->type == kCtxRecv) {
        const CtrlMsg m = ctrl_[c->slot];
        post_recv(c->slot);
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
    return n;
  }

  TransportOptions opts_;
  Owned<fi_info*, void (*)(fi_info*)> info_;
  Fid fabric_, domain_, cq_, av_, ep_, ctrl_mr_;
  fid_domain* domain_p_ = nullptr;
  fid_cq* cq_p_ = nullptr;
  fid_av* av_p_ = nullptr;
  fid_ep* ep_p_ = nullptr;
  uint64_t mr_mode_ = 0;
  bool debug_ = env_long("UCCL_EP_DEBUG_FABRIC", 0) != 0;
  size_t max_msg_ = 0;
  std::map<int, Fid> mrs_;
  std::vector<LocalRegion> local_;
  std::vector<void*> descs_;
  std::vector<fi_addr_t> peers_;
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

namespace uccl {
std::unique_ptr<Transport> make_fabric_transport(const TransportOptions&) {
  UCCL_THROW("fabric transport not compiled in: install libfabric-dev (rdma/fabric.h) and rebuild");
}
}  // namespace uccl

#endif
