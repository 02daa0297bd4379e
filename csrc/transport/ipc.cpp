// IpcTransport: the same-host emulated NIC. A write is a copy-engine copy (gpuMemcpyAsync) from this
// GPU's region into the peer GPU's IPC-mapped region, exactly where GPUDirect RDMA would land; when the
// copy's event completes, the arrival (immediate) goes into the peer proxy thread's shared-memory queue.
// Atomics and markers go straight into that queue and the receiver applies them in sequence order.
// Compiled only with CUDA or HIP.
#include "transport/transport.h"

#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <deque>
#include <vector>

#include "common/check.h"
#include "common/portability.h"
#include "common/raii.h"
#include "transport/shm_queue.h"

namespace uccl {
namespace {

struct IpcAddress {
  int32_t pid;
  int32_t gpu;
  char queue[96];
};

struct IpcKey {
  int32_t pid;
  int32_t device;  // 1: GPU memory, 0: host memory (only reachable from the owning process)
  uint64_t ptr;    // region pointer in the owner's address space
  uint64_t base;   // allocation base (ipc handles name whole allocations)
  uint64_t size;
  gpuIpcMemHandle_t handle;
};

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
    UCCL_CHECK_GPU(gpuSetDevice(o.gpu));
    UCCL_CHECK_GPU(gpuStreamCreateWithFlags(&stream_, gpuStreamNonBlocking));
    preload_copy_kernels();
    std::string job = o.job.empty() ? std::to_string(getpid()) : o.job;
    queue_name_ = "/uccl_ep_" + job + "_r" + std::to_string(o.rank) + "_t" + std::to_string(o.thread_index);
    inbox_.create(queue_name_, 1 << 16);
  }
  ~IpcTransport() override { close(); }

  const char* name() const override { return "ipc"; }

  // Copies between buffers of one device may run as driver kernels, and under lazy module loading (CUDA's
  // default) a kernel's first use loads it, which waits for the kernels already running on the device: GPU
  // kernels that spin until these copies land (the internode forwarders) would wait forever. So every kind
  // of copy this transport issues (byte-, 4-, 8- and 16-byte aligned, small and large; into this process's
  // memory and into a peer's IPC-mapped region) runs once before any such kernel can: here into a scratch
  // buffer, and in connect() within each peer region, whose bytes it copies onto themselves (unchanged:
  // nothing writes the regions while ranks connect). The module's own kernels are preloaded likewise
  // (internode_launch.cuh).
  void preload_copies(char* dst, const char* src, size_t size) {
    gpuError_t e = gpuSuccess;
    for (size_t len : {size_t(1), size_t(7), size_t(64), size_t(4096), size_t(65536), size_t(2) << 20})
      for (size_t off : {size_t(0), size_t(1), size_t(4), size_t(8)})
        if (e == gpuSuccess && off + len <= size) e = gpuMemcpyAsync(dst + off, src + off, len, gpuMemcpyDefault, stream_);
    if (e == gpuSuccess) e = gpuStreamSynchronize(stream_);
    UCCL_CHECK(e == gpuSuccess, "ipc transport: preloading the copy kernels failed: " << gpuGetErrorString(e));
  }

  void preload_copy_kernels() {
    constexpr size_t kBytes = (size_t(2) << 20) + 64;
    void* buf = nullptr;
    UCCL_CHECK_GPU(gpuMalloc(&buf, 2 * kBytes));
    try {
      preload_copies(static_cast<char*>(buf) + kBytes, static_cast<char*>(buf), kBytes);
    } catch (...) {
      (void)gpuFree(buf);
      throw;
    }
    UCCL_CHECK_GPU(gpuFree(buf));
  }

  std::string address() override {
    IpcAddress a{};
    a.pid = getpid();
    a.gpu = o_.gpu;
    std::snprintf(a.queue, sizeof(a.queue), "%s", queue_name_.c_str());
    return std::string(reinterpret_cast<const char*>(&a), sizeof(a));
  }

  std::string register_region(const LocalRegion& r) override {
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
    p.pid = a.pid;
    p.gpu = a.gpu;
    if (peer != o_.rank) p.outbox.reset(new ShmQueue()), p.outbox->open(a.queue);
    if (a.pid == getpid() && a.gpu != o_.gpu) {  // several GPUs in one process: direct peer access
      gpuError_t e = cudaDeviceEnablePeerAccessCompat(a.gpu);
      (void)e;
    }
    p.regions.assign(keys.size(), Remote{});
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i].empty()) continue;
      UCCL_CHECK(keys[i].size() == sizeof(IpcKey), "ipc: bad key blob for region " << i << " of peer " << peer);
      IpcKey k;
      std::memcpy(&k, keys[i].data(), sizeof(k));
      Remote& r = p.regions[i];
      r.valid = true;
      r.size = k.size;
      r.device = k.device != 0;
      if (!k.device) {
        r.ptr = (k.pid == getpid()) ? reinterpret_cast<char*>(k.ptr) : nullptr;  // host memory: owner only
      } else if (k.pid == getpid()) {
        r.ptr = reinterpret_cast<char*>(k.ptr);
      } else {
        void* base = nullptr;
        UCCL_CHECK_GPU(gpuIpcOpenMemHandle(&base, k.handle, gpuIpcMemLazyEnablePeerAccess));
        r.opened = base;
        r.ptr = static_cast<char*>(base) + (k.ptr - k.base);
        preload_copies(r.ptr, r.ptr, r.size);
      }
    }
  }

  void write(int peer, uint32_t region, uint64_t local_off, uint64_t remote_off, uint64_t len, uint32_t imm,
             uint64_t wr_id) override {
    const Remote& r = remote(peer, region);
    if (region >= local_.size() || local_[region].id < 0) UCCL_THROW("ipc: local region " << region << " not registered");
    const LocalRegion& l = local_[region];
    if (local_off + len > l.size || remote_off + len > r.size)
      UCCL_THROW("ipc: write out of bounds (region " << region << ", " << local_off << "/" << remote_off << "+" << len << ")");
    if (!r.ptr) UCCL_THROW("ipc: region " << region << " of peer " << peer << " is host memory in another process; only GPU regions can be written over ipc");
    Pending pd;
    pd.wr_id = wr_id;
    pd.peer = peer;
    pd.imm = imm;
    if (len) UCCL_CHECK_GPU(gpuMemcpyAsync(r.ptr + remote_off, l.base + local_off, len, gpuMemcpyDefault, stream_));
    pd.event = get_event();
    UCCL_CHECK_GPU(gpuEventRecord(pd.event, stream_));
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

  int poll(Completion* out, int max) override {
    int n = 0;
    while (n < max && !backlog_.empty()) {
      out[n++] = backlog_.front();
      backlog_.pop_front();
    }
    // Copies complete in stream order: stop at the first one still running.
    while (n < max && !pending_.empty()) {
      gpuError_t e = gpuEventQuery(pending_.front().event);
      if (e == gpuErrorNotReady) break;
      UCCL_CHECK_GPU(e);
      Pending pd = pending_.front();
      pending_.pop_front();
      free_events_.push_back(pd.event);
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
    if (stream_) {
      gpuError_t e = gpuStreamSynchronize(stream_);
      if (e != gpuSuccess) warn_release_gpu(e);
    }
    for (auto& pd : pending_) free_events_.push_back(pd.event);
    pending_.clear();
    for (gpuEvent_t ev : free_events_) gpuEventDestroy(ev);
    free_events_.clear();
    for (Peer& p : peers_) {
      for (Remote& r : p.regions)
        if (r.opened) {
          gpuError_t e = gpuIpcCloseMemHandle(r.opened);
          if (e != gpuSuccess) warn_release_gpu(e);
          r.opened = nullptr;
        }
      if (p.outbox) p.outbox->close();
    }
    inbox_.close();
    if (stream_) gpuStreamDestroy(stream_);
    stream_ = nullptr;
  }

 private:
  struct Remote {
    bool valid = false, device = false;
    char* ptr = nullptr;
    void* opened = nullptr;
    uint64_t size = 0;
  };
  struct Peer {
    int pid = 0, gpu = -1;
    std::unique_ptr<ShmQueue> outbox;
    std::vector<Remote> regions;
  };
  struct Pending {
    gpuEvent_t event;
    uint64_t wr_id;
    int peer;
    uint32_t imm;
  };

  static gpuError_t cudaDeviceEnablePeerAccessCompat(int peer_gpu) {
#if defined(UCCL_EP_WITH_HIP)
    gpuError_t e = hipDeviceEnablePeerAccess(peer_gpu, 0);
    if (e != hipSuccess) (void)hipGetLastError();
#else
    gpuError_t e = cudaDeviceEnablePeerAccess(peer_gpu, 0);
    if (e != cudaSuccess) (void)cudaGetLastError();  // already enabled / not possible: copies still work
#endif
    return e;
  }

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

  gpuEvent_t get_event() {
    if (!free_events_.empty()) {
      gpuEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
    gpuEvent_t e;
    UCCL_CHECK_GPU(gpuEventCreateWithFlags(&e, gpuEventDisableTiming));
    return e;
  }

  TransportOptions o_;
  gpuStream_t stream_ = nullptr;
  std::string queue_name_;
  ShmQueue inbox_;
  std::vector<Peer> peers_;
  std::vector<LocalRegion> local_;
  std::deque<Pending> pending_;
  std::vector<gpuEvent_t> free_events_;
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
