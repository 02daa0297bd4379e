// IpcTransport: the same-host emulated NIC. A write is a copy-engine copy from this GPU's region into the
// peer GPU's IPC-mapped region, exactly where GPUDirect RDMA would land, issued by this endpoint's copy agent
// (a process of its own, as a NIC is a device of its own: transport/ipc_agent.h says why); when the agent
// reports the copy done, the arrival (immediate) goes into the peer proxy thread's shared-memory queue.
// Atomics and markers go straight into that queue and the receiver applies them in sequence order.
// Compiled only with CUDA or HIP.
#include "transport/transport.h"

#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <vector>

#include "common/check.h"
#include "common/portability.h"
#include "transport/ipc_agent.h"
#include "transport/shm_queue.h"

namespace uccl {
namespace {

struct IpcAddress {
  char queue[96];  // the endpoint's arrival queue
};

constexpr uint32_t kMaxRegions = 16;  // region ids per rank (the agent's slot of (rank, region) is rank * 16 + id)

// Allocation base of a device pointer (torch tensors are sub-allocations of larger segments).
uint64_t allocation_base(void* ptr) {
#if defined(UCCL_EP_WITH_HIP)
  void* base = nullptr;
  size_t size = 0;
  UCCL_CHECK_GPU(hipMemGetAddressRange(&base, &size, ptr));
  return uint64_t(reinterpret_cast<uintptr_t>(base));
#else
  // cuMemGetAddressRange through cudart's driver entry point: the module never links libcuda.
  using Fn = int (*)(unsigned long long*, size_t*, unsigned long long);
  static Fn fn = nullptr;
  if (!fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    UCCL_CHECK_GPU(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault, &q));
#else
    UCCL_CHECK_GPU(cudaGetDriverEntryPoint("cuMemGetAddressRange", &p, cudaEnableDefault, &q));
#endif
    if (!p || q != cudaDriverEntryPointSuccess) UCCL_THROW("cuMemGetAddressRange not found in the CUDA driver");
    fn = reinterpret_cast<Fn>(p);
  }
  unsigned long long base = 0;
  size_t size = 0;
  int rc = fn(&base, &size, (unsigned long long)reinterpret_cast<uintptr_t>(ptr));
  if (rc != 0) UCCL_THROW("cuMemGetAddressRange(" << ptr << ") failed with CUresult " << rc);
  return base;
#endif
}

}  // namespace

class IpcTransport final : public Transport {
 public:
  explicit IpcTransport(const TransportOptions& o) : o_(o), peers_(o.world) {
    if (o.gpu < 0) UCCL_THROW("ipc transport needs a GPU (gpu >= 0)");
    UCCL_CHECK_GPU(gpuSetDevice(o.gpu));  // fail here, not in the agent, when the GPU is not there
    std::string job = o.job.empty() ? std::to_string(getpid()) : o.job;
    queue_name_ = "/uccl_ep_" + job + "_r" + std::to_string(o.rank) + "_t" + std::to_string(o.thread_index);
    inbox_.create(queue_name_, 1 << 16);
    agent_.reset(new CopyAgent(queue_name_ + "_dma", o.gpu));  // starts now; connect() waits for it
  }
  ~IpcTransport() override { close(); }

  const char* name() const override { return "ipc"; }

  std::string address() override {
    IpcAddress a{};
    std::snprintf(a.queue, sizeof(a.queue), "%s", queue_name_.c_str());
    return std::string(reinterpret_cast<const char*>(&a), sizeof(a));
  }

  std::string register_region(const LocalRegion& r) override {
    UCCL_CHECK(r.id >= 0 && uint32_t(r.id) < kMaxRegions, "ipc: region id " << r.id << " out of range [0, " << kMaxRegions << ")");
    IpcKey k{};
    k.pid = getpid();
    k.device = r.device ? 1 : 0;
    k.ptr = uint64_t(reinterpret_cast<uintptr_t>(r.base));
    k.size = r.size;
    if (r.device) {
      k.base = allocation_base(r.base);
      UCCL_CHECK_GPU(gpuIpcGetMemHandle(&k.handle, r.base));
    }
    if (local_.size() <= size_t(r.id)) local_.resize(size_t(r.id) + 1);
    local_[r.id] = r;
    return std::string(reinterpret_cast<const char*>(&k), sizeof(k));
  }

  void connect(int peer, const std::string& address, const std::vector<std::string>& keys) override {
    UCCL_CHECK(address.size() == sizeof(IpcAddress), "ipc: bad address blob from peer " << peer);
    IpcAddress a;
    std::memcpy(&a, address.data(), sizeof(a));
    Peer& p = peers_[peer];
    if (peer != o_.rank) p.outbox.reset(new ShmQueue()), p.outbox->open(a.queue);
    p.regions.assign(keys.size(), Remote{});
    uint64_t last = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i].empty()) continue;
      UCCL_CHECK(keys[i].size() == sizeof(IpcKey), "ipc: bad key blob for region " << i << " of peer " << peer);
      UCCL_CHECK(i < kMaxRegions, "ipc: peer " << peer << " registered region " << i << " (at most " << kMaxRegions << ")");
      IpcKey k;
      std::memcpy(&k, keys[i].data(), sizeof(k));
      Remote& r = p.regions[i];
      r.valid = true;
      r.size = k.size;
      r.device = k.device != 0;
      if (r.device) last = agent_->open(slot(peer, uint32_t(i)), k);
    }
    // the agent maps the regions now, so a bad handle fails the bootstrap rather than the first write
    if (last) agent_->wait(last, std::chrono::seconds(120), "starting and mapping the peer's regions");
  }

  void write(int peer, uint32_t region, uint64_t local_off, uint64_t remote_off, uint64_t len, uint32_t imm,
             uint64_t wr_id) override {
    const Remote& r = remote(peer, region);
    if (region >= local_.size() || local_[region].id < 0) UCCL_THROW("ipc: local region " << region << " not registered");
    const LocalRegion& l = local_[region];
    if (local_off + len > l.size || remote_off + len > r.size)
      UCCL_THROW("ipc: write out of bounds (region " << region << ", " << local_off << "/" << remote_off << "+" << len << ")");
    if (!r.device || !l.device)
      UCCL_THROW("ipc: region " << region << " is host memory " << (l.device ? "on peer " + std::to_string(peer) : "here")
                 << "; only GPU regions can be written over ipc");
    Pending pd;
    pd.wr_id = wr_id;
    pd.peer = peer;
    pd.imm = imm;
    pd.ticket = agent_->copy(slot(peer, region), remote_off, slot(o_.rank, region), local_off, len);
    pending_.push_back(pd);
  }

  void atomic_add(int peer, uint32_t region, uint64_t remote_off, int64_t value, uint32_t imm, uint64_t wr_id) override {
    if (region != kNoRegion) {
      const Remote& r = remote(peer, region);
      if (remote_off + 8 > r.size || (remote_off & 7)) UCCL_THROW("ipc: atomic at bad offset " << remote_off);
    }
    Completion c;
    c.kind = region == kNoRegion ? Completion::kMarker : Completion::kAtomic;
    c.peer = o_.rank;
    c.imm = imm;
    c.region = region;
    c.offset = remote_off;
    c.value = value;
    deliver(peer, c);
    Completion l;
    l.kind = Completion::kLocal;
    l.wr_id = wr_id;
    l.peer = o_.rank;
    backlog_.push_back(l);
  }

  void send_failure(int peer, int64_t value) override {
    Completion c;
    c.kind = Completion::kFailure;
    c.peer = o_.rank;
    c.value = value;
    deliver(peer, c);
  }

  int poll(Completion* out, int max) override {
    int n = 0;
    while (n < max && !backlog_.empty()) {
      out[n++] = backlog_.front();
      backlog_.pop_front();
    }
    // The agent finishes copies in order: everything up to its done counter has landed.
    const uint64_t done = pending_.empty() ? 0 : agent_->done();
    while (n < max && !pending_.empty() && pending_.front().ticket <= done) {
      Pending pd = pending_.front();
      pending_.pop_front();
      Completion a;
      a.kind = Completion::kArrival;
      a.peer = o_.rank;
      a.imm = pd.imm;
      deliver(pd.peer, a);
      Completion l;
      l.kind = Completion::kLocal;
      l.wr_id = pd.wr_id;
      l.peer = o_.rank;
      out[n++] = l;
    }
    if (n < max) n += inbox_.pop(out + n, max - n);
    return n;
  }

  void close() override {
    if (closed_) return;
    closed_ = true;
    if (agent_) agent_->stop();  // finishes the copies already handed to it, then exits
    pending_.clear();
    for (Peer& p : peers_)
      if (p.outbox) p.outbox->close();
    inbox_.close();
  }

 private:
  struct Remote {
    bool valid = false, device = false;
    uint64_t size = 0;
  };
  struct Peer {
    std::unique_ptr<ShmQueue> outbox;
    std::vector<Remote> regions;
  };
  struct Pending {
    uint64_t ticket;  // the agent's request number
    uint64_t wr_id;
    int peer;
    uint32_t imm;
  };

  static uint32_t slot(int rank, uint32_t region) { return uint32_t(rank) * kMaxRegions + region; }

  const Remote& remote(int peer, uint32_t region) const {
    UCCL_CHECK(peer >= 0 && peer < o_.world, "ipc: peer " << peer << " out of range");
    const auto& rr = peers_[peer].regions;
    if (region >= rr.size() || !rr[region].valid) UCCL_THROW("ipc: peer " << peer << " has no region " << region);
    return rr[region];
  }

  void deliver(int peer, const Completion& c) {
    ShmQueue* q = peer == o_.rank ? &inbox_ : peers_[peer].outbox.get();
    if (!q) UCCL_THROW("ipc: peer " << peer << " not connected");
    if (!q->push(c, std::chrono::steady_clock::now() + std::chrono::seconds(30)))
      UCCL_THROW("ipc: arrival queue of peer " << peer << " stayed full for 30 s (peer proxy not draining?)");
  }

  TransportOptions o_;
  std::string queue_name_;
  std::unique_ptr<CopyAgent> agent_;
  ShmQueue inbox_;
  std::vector<Peer> peers_;
  std::vector<LocalRegion> local_;
  std::deque<Pending> pending_;
  std::deque<Completion> backlog_;
  bool closed_ = false;
};

std::unique_ptr<Transport> make_ipc_transport(const TransportOptions& o) {
  return std::unique_ptr<Transport>(new IpcTransport(o));
}

}  // namespace uccl

#else

#include "common/check.h"

namespace uccl {
std::unique_ptr<Transport> make_ipc_transport(const TransportOptions&) {
  UCCL_THROW("ipc transport not compiled in: it needs CUDA or HIP (nvcc/hipcc at build time)");
}
}  // namespace uccl

#endif
