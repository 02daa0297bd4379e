// Proxy: the CPU side of the command channel for one GPU (or one CPU rank in tests).
//
// Several ProxyThreads each own one RingBuffer and one Transport endpoint. A thread drains its ring in
// slot order, validates each command, assigns the (destination, channel) sequence number, posts it to
// the transport within the in-flight limits, polls completions (through the fault injector), and feeds
// remote arrivals to its OrderingEmulator, which makes them visible in the SignalBlock in order.
// Channel c is owned by thread c % num_threads on every rank, so each (source, channel) stream has one
// sender and one receiver thread.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "proxy/fault.h"
#include "proxy/ordering.h"
#include "proxy/ring_buffer.h"
#include "transport/transport.h"

namespace uccl {

// The proxy's pickup clock: a raw CPU cycle counter read without a syscall or a serialising instruction
// (x86: rdtsc, aarch64: cntvct_el0), steady_clock nanoseconds elsewhere. Units are ticks: callers that
// need nanoseconds measure the rate against steady_clock (proxy_clock_ticks_per_ns).
static inline uint64_t proxy_clock_ticks() {
#if defined(__x86_64__) || defined(__i386__)
  uint32_t lo, hi;
  asm volatile("rdtsc" : "=a"(lo), "=d"(hi));
  return (uint64_t(hi) << 32) | lo;
#elif defined(__aarch64__)
  uint64_t v;
  asm volatile("mrs %0, cntvct_el0" : "=r"(v));
  return v;
#else
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
#endif
}

// Pairs of (proxy_clock_ticks, steady_clock ns) taken around a measurement give the tick rate.
struct ClockPair {
  uint64_t ticks;
  int64_t ns;
  static ClockPair now() {
    ClockPair p;
    p.ticks = proxy_clock_ticks();
    p.ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
    return p;
  }
};
inline double proxy_clock_ticks_per_ns(const ClockPair& a, const ClockPair& b) {
  return b.ns > a.ns ? double(b.ticks - a.ticks) / double(b.ns - a.ns) : 1.0;
}

struct ProxyConfig {
  int rank = 0;
  int world = 1;
  int num_threads = 4;          // UCCL_EP_PROXY_THREADS
  uint32_t ring_capacity = 2048;
  int gpu = -1;                 // CUDA/HIP device, -1: CPU producers (tests)
  std::string transport = "fabric";
  std::string provider;         // fabric provider
  // NICs this rank's threads open (uccl_ep_train/nics.py picks them from the PCI topology, UCCL_EP_NICS
  // overrides): verbs device names or libfabric domain names; thread t opens device_for(t). Empty: the
  // transport's own default.
  std::vector<std::string> devices;
  bool pin_threads = true;      // !UCCL_EP_DISABLE_CPU_AFFINITY
  bool low_latency = false;     // selects UCCL_IB_MAX_INFLIGHT_LOW_LATENCY over _NORMAL
  int max_inflight = 8;         // per (thread, destination)
  uint64_t max_inflight_bytes = 0;  // per (thread, destination); 0: unlimited
  bool adaptive_sleep = false;  // UCCL_RDMA_ADAPTIVE_SLEEP
  double timeout_s = 0;         // deadline of every wait; the binding sets it (uccl_ep_train.config.timeout_s)
  std::string fault;            // UCCL_EP_FAULT
  std::string job;              // unique per job (ipc shared-memory names)
  std::string ring_publish;     // UCCL_EP_RING_PUBLISH: "fence" | "vector" | "" (default: ring_publish_default)

  static ProxyConfig from_env(int rank, int world, int gpu);
  // The NIC proxy thread t opens: devices[t % devices.size()], "" when no device was chosen.
  std::string device_for(int t) const { return devices.empty() ? std::string() : devices[size_t(t) % devices.size()]; }
};

struct ProxyStats {
  uint64_t commands = 0, writes = 0, atomics = 0, flushes = 0, nops = 0, rejected = 0;
  uint64_t bytes = 0, local_completions = 0, arrivals = 0, out_of_order = 0, fault_held = 0;
  uint64_t idle_sleeps = 0;
  // Gauges (now, not cumulative): arrivals the ordering emulator holds for an earlier one, and arrivals the
  // transport read but holds back (the fabric copy fence). Nonzero in a timeout report says where a row is.
  uint64_t held = 0, undelivered = 0;
  // Per destination rank (size world), counted when an operation is posted to the transport: payload bytes
  // of OP_WRITE / OP_WRITE_IMM, and operations (writes, atomic adds, barrier markers; not NOP / FLUSH,
  // which go nowhere, nor rejected commands). What a test needs to check the bytes that left for each peer.
  std::vector<uint64_t> bytes_to, commands_to;
};

class Proxy;

// The lowest number no other live Proxy of this process holds: a process's proxy groups (a low-latency Buffer
// runs two) pin their threads to cores of their own.
class ProcessOrdinal {
 public:
  ProcessOrdinal();
  ~ProcessOrdinal();
  ProcessOrdinal(const ProcessOrdinal&) = delete;
  ProcessOrdinal& operator=(const ProcessOrdinal&) = delete;
  int value() const { return value_; }

 private:
  int value_;
};

class ProxyThread {
 public:
  ProxyThread(Proxy* owner, int index);
  ~ProxyThread();
  void start();
  void request_stop();  // returns at once; stop() joins
  void stop();
  RingBuffer& ring() { return *ring_; }
  Transport& transport() { return *transport_; }
  ProxyStats stats() const;
  int cpu() const { return cpu_; }

 private:
  friend class Proxy;
  struct Posted {
    int dst;
    int channel;
    uint64_t bytes;
    std::chrono::steady_clock::time_point t;
  };
  void run();
  void finish(bool failed);            // after stop(): drain, then Transport::quiesce (bounded)
  bool step();                         // one loop iteration; true when it did work
  bool handle(const Command& c, bool* stall, uint64_t pickup_ticks);
  void on_completions(const Completion* c, int n);
  void reject(const Command& c, const std::string& why);
  // Sends (code, block) to every peer's proxy over this thread's endpoint (Transport::send_failure), then keeps
  // the endpoint progressing for a moment so the messages leave; unreachable peers are skipped.
  void tell_peers(int code, int block);
  void check_timeouts();

  Proxy* p_;
  int index_;
  int cpu_ = -1;
  std::unique_ptr<RingBuffer> ring_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<OrderingEmulator> emu_;
  FaultInjector fault_;
  RingConsumer consumer_;
  unsigned long long* echo_ = nullptr;     // host view of the ring's echo words ([0] cookie, [1] pickup ticks)
  unsigned long long* flushed_ = nullptr;  // host view of the ring's flush counter
  uint32_t credit_batch_ = 1;              // return credits at least every this many slots while busy
  std::vector<uint32_t> next_seq_;  // [dst * kMaxChannels + ch]
  std::vector<int> inflight_;       // per dst
  std::vector<uint64_t> inflight_bytes_;
  int inflight_total_ = 0;
  std::unordered_map<uint64_t, Posted> posted_;  // wr_id -> in-flight operation (bounded by the limits)
  uint64_t next_wr_ = 1;
  std::chrono::steady_clock::time_point last_progress_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::vector<Completion> scratch_;
  // stats (written by this thread only, read by anyone: bump() is a relaxed load + store, no locked op)
  static void bump(std::atomic<uint64_t>& a, uint64_t n = 1) {
    a.store(a.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }
  std::atomic<uint64_t> commands_{0}, writes_{0}, atomics_{0}, flushes_{0}, nops_{0}, rejected_{0}, bytes_{0},
      local_{0}, arrivals_{0}, idle_sleeps_{0}, out_of_order_{0}, fault_held_{0}, held_{0}, undelivered_{0};
  std::vector<std::atomic<uint64_t>> bytes_to_, commands_to_;  // per destination rank, sized world
};

class Proxy {
 public:
  explicit Proxy(const ProxyConfig& cfg);
  ~Proxy();

  const ProxyConfig& config() const { return cfg_; }
  // Regions: symmetric buffers with the same id on every rank. Register before local_blob().
  void register_region(int id, uint64_t ptr, uint64_t size, bool device);
  // This rank's bootstrap record for thread t: transport address + one key per region.
  std::string local_blob(int thread);
  // All ranks' blobs, [rank][thread]; connects every thread's transport to every peer.
  void connect(const std::vector<std::vector<std::string>>& blobs);
  void start();
  void stop();  // joins threads, releases transports; idempotent, safe after errors
  bool running() const { return running_; }

  int num_threads() const { return int(threads_.size()); }
  const RingDesc& ring_host(int t) const { return threads_.at(t)->ring_->host_desc(); }
  const RingDesc& ring_device(int t) const { return threads_.at(t)->ring_->device_desc(); }
  const SignalBlock& signals_host() const { return sig_host_; }
  const SignalBlock& signals_device() const { return sig_dev_; }

  // CPU producer: pushes commands into thread t's ring (blocks on a full ring up to the timeout).
  // CPU producer; owned: as the ring's only producer (RingProducer: no claim atomic), else claiming slots.
  void push(int t, const Command* cmds, size_t n, bool owned = false);
  // Waits until seq_tail[src][ch] >= target; throws a timeout error naming rank, peer, channel, phase.
  void wait_seq(int src, int ch, uint64_t target, double timeout_s, const std::string& phase);
  void wait_flushed(int t, uint64_t target, double timeout_s);
  // First error recorded by any proxy thread, "" if none.
  std::string error() const;
  void set_error(const std::string& e);
  // The failure record (8 ints, the kernels' ErrorRecord layout: kErrProxyFailed, rank, peer, thread, ...) in
  // pinned host memory, which a stopping thread fills (record_failure) and the kernels' waits poll (the
  // buffers' set_rings): its address on the host, or as the GPU sees it (== host without a GPU).
  uint64_t failure_record(bool device) const;
  // Fills the record (the first call only): `rank`'s proxy thread `block` stopped (code kErrProxyFailed), or
  // `rank` aborted call kAbortOps[block] (kErrAborted); this rank's own failures also go to every peer
  // (ProxyThread::tell_peers), whose proxies fill their records with it.
  void record_failure(int rank, int code, int block);
  // This rank aborted call kAbortOps[op] (Buffer, issue #42): thread 0 tells every peer's proxy at its next idle
  // check (microseconds), so the other nodes' kernels stop too.
  void abort(int op);
  ProxyStats stats() const;
  std::vector<int> thread_cpus() const;

  const LocalRegion* region(uint32_t id) const {
    return (id < regions_.size() && regions_[id].id >= 0) ? &regions_[id] : nullptr;
  }
  std::string fault_spec() const { return fault_.str(); }
  // Sequence-number bits the transport carries (24, or 17 in fabric's 4-byte CQ-data layout).
  uint32_t imm_seq_bits() const;
  bool calls_gpu_runtime() const;  // Transport::calls_gpu_runtime
  // Per thread: the (provider, device) its endpoint opened (Transport::opened_provider, opened_device).
  std::vector<std::pair<std::string, std::string>> opened() const;
  const FaultSpec& fault() const { return fault_; }

 private:
  friend class ProxyThread;
  ProxyConfig cfg_;
  FaultSpec fault_;
  std::vector<LocalRegion> regions_;
  std::vector<int> near_cpus_;  // allowed CPUs on the GPU's NUMA node (empty: no pinning / no GPU)
  ProcessOrdinal ordinal_;
  HostMemory sig_mem_;
  SignalBlock sig_host_, sig_dev_;
  std::vector<std::unique_ptr<ProxyThread>> threads_;
  bool connected_ = false, running_ = false;
  mutable std::mutex err_mu_;
  std::string error_;
  std::atomic<bool> failed_{false};
  std::atomic<bool> failure_recorded_{false};
  std::atomic<int> abort_op_{-1};  // abort(): the op thread 0 is to announce, -1 none (then -2: announced)
  uccl_ep::ErrorRecord* fail_host_ = nullptr;  // in sig_mem_, after the signal words
  uccl_ep::ErrorRecord* fail_dev_ = nullptr;
};

// Cores near `gpu` (its NUMA node), intersected with this process's allowed CPUs; all allowed CPUs when
// the node is unknown.
std::vector<int> cpus_near_gpu(int gpu);
// (place of `gpu` among the GPUs of its NUMA node in PCI bus order, their count), from sysfs: the same in every
// process of the host, whatever CUDA_VISIBLE_DEVICES calls the GPU there; (0, 1) when unknown.
std::pair<int, int> gpu_place_on_node(int gpu);

}  // namespace uccl
