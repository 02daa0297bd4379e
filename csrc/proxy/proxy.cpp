#include "proxy/proxy.h"

#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/check.h"
#include "common/env.h"
#include "common/errors.h"

namespace uccl {

// The failure record after the signal words: an ErrorRecord (common/errors.h), as the kernels poll it.
constexpr size_t kFailureRecordBytes = sizeof(uccl_ep::ErrorRecord);

using Clock = std::chrono::steady_clock;

namespace {
// A failure as Completion::kFailure's value: code in the low 8 bits, block above (encode_failure), and back.
int64_t encode_failure(int code, int block) { return int64_t(code & 0xff) | (int64_t(block) << 8); }
int failure_code(int64_t value) { return int(value & 0xff); }
int failure_block(int64_t value) { return int(value >> 8); }
}  // namespace

ProxyConfig ProxyConfig::from_env(int rank, int world, int gpu) {
  ProxyConfig c;
  c.rank = rank;
  c.world = world;
  c.gpu = gpu;
  c.num_threads = int(env_long("UCCL_EP_PROXY_THREADS", 4));
  c.pin_threads = env_long("UCCL_EP_DISABLE_CPU_AFFINITY", 0) == 0;
  c.max_inflight_bytes = uint64_t(env_long("UCCL_IB_MAX_INFLIGHT_BYTES", 0));
  c.low_latency = false;
  c.max_inflight = int(env_long("UCCL_IB_MAX_INFLIGHT_NORMAL", 8));
  // Default: spin when a GPU feeds the rings (latency), sleep adaptively on CPU-only runs.
  c.adaptive_sleep = env_long("UCCL_RDMA_ADAPTIVE_SLEEP", gpu < 0 ? 1 : 0) != 0;
  c.fault = env_str("UCCL_EP_FAULT");
  c.provider = env_str("FI_PROVIDER");
  c.ring_publish = env_str("UCCL_EP_RING_PUBLISH");
  return c;
}

// ------------------------------------------------------------------------------------------------
namespace {
// The PCI bus id of `gpu`, lower case ("" when unknown).
std::string gpu_bus_id(int gpu) {
#if UCCL_EP_WITH_GPU
  char bus[32] = {0};
  if (gpu < 0 || gpuDeviceGetPCIBusId(bus, sizeof(bus), gpu) != gpuSuccess) return "";
  std::string id(bus);
  std::transform(id.begin(), id.end(), id.begin(), ::tolower);
  return id;
#else
  (void)gpu;
  return "";
#endif
}

int numa_node_of(const std::string& bus) {
  int node = -1;
  std::ifstream f("/sys/bus/pci/devices/" + bus + "/numa_node");
  if (!bus.empty() && f) f >> node;
  return node;
}

long sysfs_hex(const std::string& path) {
  std::ifstream f(path);
  std::string v;
  return f && (f >> v) ? std::strtol(v.c_str(), nullptr, 16) : -1;
}
}  // namespace

std::vector<int> cpus_near_gpu(int gpu) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  std::vector<int> all;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &allowed)) all.push_back(c);
  const int node = numa_node_of(gpu_bus_id(gpu));
  if (node < 0) return all;
  std::ifstream f("/sys/devices/system/node/node" + std::to_string(node) + "/cpulist");
  std::string list;
  if (!f || !std::getline(f, list)) return all;
  std::vector<int> near;
  std::stringstream ss(list);
  std::string part;
  while (std::getline(ss, part, ',')) {
    int a = 0, b = 0;
    if (std::sscanf(part.c_str(), "%d-%d", &a, &b) == 2) {
    } else if (std::sscanf(part.c_str(), "%d", &a) == 1) {
      b = a;
    } else {
      continue;
    }
    for (int c = a; c <= b; ++c)
      if (c < CPU_SETSIZE && CPU_ISSET(c, &allowed)) near.push_back(c);
  }
  return near.empty() ? all : near;
}

std::pair<int, int> gpu_place_on_node(int gpu) {
  const std::string mine = gpu_bus_id(gpu);
  const int node = numa_node_of(mine);
  std::vector<std::string> gpus;
  if (DIR* d = mine.empty() ? nullptr : opendir("/sys/bus/pci/devices")) {
    while (dirent* e = readdir(d)) {
      const std::string bus = e->d_name, dir = "/sys/bus/pci/devices/" + bus;
      const long vendor = sysfs_hex(dir + "/vendor");
      if (bus[0] != '.' && (sysfs_hex(dir + "/class") >> 16) == 0x03 && (vendor == 0x10de || vendor == 0x1002) &&
          numa_node_of(bus) == node)
        gpus.push_back(bus);
    }
    closedir(d);
  }
  std::sort(gpus.begin(), gpus.end());
  const auto it = std::find(gpus.begin(), gpus.end(), mine);
  if (it == gpus.end()) return {0, 1};
  return {int(it - gpus.begin()), int(gpus.size())};
}

namespace {
// Restricts the calling thread to `cpus` for its lifetime (best effort), then restores its affinity.
class AffinityScope {
 public:
  explicit AffinityScope(const std::vector<int>& cpus) {
    if (cpus.empty() || sched_getaffinity(0, sizeof(saved_), &saved_) != 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : cpus)
      if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
    active_ = sched_setaffinity(0, sizeof(set), &set) == 0;
  }
  ~AffinityScope() {
    if (active_) sched_setaffinity(0, sizeof(saved_), &saved_);
  }
  AffinityScope(const AffinityScope&) = delete;
  AffinityScope& operator=(const AffinityScope&) = delete;

 private:
  cpu_set_t saved_;
  bool active_ = false;
};
}  // namespace

// ------------------------------------------------------------------------------------------------
ProxyThread::ProxyThread(Proxy* owner, int index)
    : p_(owner), index_(index), fault_(owner->fault(), uint64_t(owner->cfg_.rank) * 1000 + index) {
  const ProxyConfig& cfg = owner->cfg_;
  {
    AffinityScope near_gpu(owner->near_cpus_);  // the ring's pages on the GPU's NUMA node (see Proxy::Proxy)
    ring_.reset(new RingBuffer(cfg.ring_capacity, cfg.gpu, ring_publish_parse(cfg.ring_publish)));
  }
  consumer_ = RingConsumer(ring_->host_desc());
  echo_ = ring_->host_desc().echo;
  flushed_ = ring_->host_desc().flushed;
  credit_batch_ = std::max<uint32_t>(1, cfg.ring_capacity / 8);
  TransportOptions to;
  to.rank = cfg.rank;
  to.world = cfg.world;
  to.thread_index = index;
  to.gpu = cfg.gpu;
  to.provider = cfg.provider;
  to.device = cfg.device_for(index);
  to.job = cfg.job;
  to.max_inflight = cfg.max_inflight;
  to.max_inflight_bytes = cfg.max_inflight_bytes;
  transport_ = make_transport(cfg.transport, to);
  Proxy* p = owner;
  emu_.reset(new OrderingEmulator(cfg.world, owner->sig_host_, [p](uint32_t region, uint64_t off, int64_t v, int src) {
    const LocalRegion* r = p->region(region);
    if (!r) UCCL_THROW("atomic from peer " << src << " targets unregistered region " << region);
    if (r->device) UCCL_THROW("atomic from peer " << src << " targets GPU region " << region << "; counters must live in host memory");
    if (off + 8 > r->size || (off & 7)) UCCL_THROW("atomic from peer " << src << " at bad offset " << off << " of region " << region);
    __atomic_fetch_add(reinterpret_cast<int64_t*>(r->base + off), v, __ATOMIC_RELEASE);
  }, transport_->imm_seq_bits()));
  next_seq_.assign(size_t(cfg.world) * kMaxChannels, 0);
  inflight_.assign(cfg.world, 0);
  inflight_bytes_.assign(cfg.world, 0);
  bytes_to_ = std::vector<std::atomic<uint64_t>>(size_t(cfg.world));  // value-initialised: zeros
  commands_to_ = std::vector<std::atomic<uint64_t>>(size_t(cfg.world));
  scratch_.reserve(256);
}

ProxyThread::~ProxyThread() { stop(); }

void ProxyThread::start() {
  stop_ = false;
  last_progress_ = Clock::now();
  thread_ = std::thread([this] { run(); });
}

void ProxyThread::request_stop() { stop_ = true; }

void ProxyThread::stop() {
  request_stop();
  if (thread_.joinable()) thread_.join();
}

ProxyStats ProxyThread::stats() const {
  ProxyStats s;
  s.commands = commands_;
  s.writes = writes_;
  s.atomics = atomics_;
  s.flushes = flushes_;
  s.nops = nops_;
  s.rejected = rejected_;
  s.bytes = bytes_;
  s.local_completions = local_;
  s.arrivals = arrivals_;
  s.out_of_order = out_of_order_;
  s.fault_held = fault_held_;
  s.idle_sleeps = idle_sleeps_;
  s.held = held_;
  s.undelivered = undelivered_;
  for (const auto& b : bytes_to_) s.bytes_to.push_back(b.load(std::memory_order_relaxed));
  for (const auto& c : commands_to_) s.commands_to.push_back(c.load(std::memory_order_relaxed));
  return s;
}

void ProxyThread::run() {
  if (cpu_ >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu_, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort: the framework may forbid it
  }
  uint64_t idle = 0;
  uint32_t sleep_us = 1;
  bool failed = false;
  try {
#if UCCL_EP_WITH_GPU
    if (p_->cfg_.gpu >= 0) UCCL_CHECK_GPU(gpuSetDevice(p_->cfg_.gpu));  // a failure is this thread's error
#endif
    while (!stop_.load(std::memory_order_relaxed)) {
      if (step()) {
        idle = 0;
        sleep_us = 1;
        continue;
      }
      ++idle;
      if ((idle & 1023) == 0) {
        check_timeouts();
        if (index_ == 0 && p_->abort_op_.load(std::memory_order_relaxed) >= 0)
          tell_peers(uccl_ep::kErrAborted, p_->abort_op_.exchange(-2));
      }
      // Sleep only when truly idle: nothing in flight, nothing held back, ring empty.
      if (p_->cfg_.adaptive_sleep && idle > 2048 && inflight_total_ == 0 && !fault_.holding()) {
        std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
        sleep_us = std::min<uint32_t>(sleep_us * 2, 100);
        bump(idle_sleeps_);
      } else {
        uccl_cpu_relax();
      }
    }
  } catch (const std::exception& e) {
    std::ostringstream os;
    os << "rank " << p_->cfg_.rank << " proxy thread " << index_ << ": " << e.what();
    p_->set_error(os.str());
    p_->record_failure(p_->cfg_.rank, uccl_ep::kErrProxyFailed, index_);  // after the text: a kernel that stops
    failed = true;                                                        // on the record finds it
    tell_peers(uccl_ep::kErrProxyFailed, index_);
  }
  // A thread stopped by an error stays silent until stop(): its peers see what a crashed thread shows them.
  while (!stop_.load(std::memory_order_relaxed)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  finish(failed);
}

void ProxyThread::finish(bool failed) {
  // Bounded by the timeout, and by 10 s: a peer that is gone must not hold a closing process for long.
  const auto deadline = Clock::now() + std::chrono::duration<double>(std::min(p_->cfg_.timeout_s, 10.0));
  // Drain what this thread posted (its bookkeeping; a thread stopped by an error skips it, the transport's own
  // count below still waits for its operations).
  try {
    while (!failed && (inflight_total_ > 0 || fault_.holding()) && Clock::now() < deadline) {
      Completion c[64];
      int n = transport_->poll(c, 64);
      on_completions(c, n);
    }
  } catch (const std::exception& e) {
    std::ostringstream os;
    os << "rank " << p_->cfg_.rank << " proxy thread " << index_ << " while stopping: " << e.what();
    p_->set_error(os.str());
  }
  // Then the endpoint agrees with its peers' that nothing more is in flight, so Proxy::stop closes idle ones.
  const double left = std::max(0.0, std::chrono::duration<double>(deadline - Clock::now()).count());
  const std::string busy = transport_->quiesce(left);
  if (!busy.empty())
    std::fprintf(stderr, "uccl_ep_train native: rank %d proxy thread %d closes a busy endpoint: %s\n", p_->cfg_.rank,
                 index_, busy.c_str());
}

void ProxyThread::reject(const Command& c, const std::string& why) {
  std::ostringstream os;
  os << "rank " << p_->cfg_.rank << " proxy thread " << index_ << " rejected a command for rank " << int(c.dst_rank)
     << " on channel " << int(c.channel) << ": " << why << "; the producer (a kernel, or a caller of push) built "
     << "it wrong, so the data it was to move never leaves and its peer will time out: a bug to report with this "
     << "line (op " << int(c.op) << ", region " << int(c.region) << ", length " << c.length << ", local_off "
     << c.local_off << ", remote_off " << c.remote_off << ")";
  p_->set_error(os.str());
  rejected_.fetch_add(1, std::memory_order_release);  // after the error: a reader seeing the count sees the message
}

// Returns false without consuming when the command must wait (in-flight limit, flush).
bool ProxyThread::handle(const Command& c, bool* stall, uint64_t pickup_ticks) {
  const ProxyConfig& cfg = p_->cfg_;
  *stall = false;
  if (c.op == 0 || c.op > OP_LAST) {
    reject(c, "unknown opcode");
    return true;
  }
  if (c.op == OP_NOP) {
    // Pickup time first, then the cookie (release): a GPU that sees the cookie also sees its time.
    __atomic_store_n(echo_ + 1, (unsigned long long)pickup_ticks, __ATOMIC_RELAXED);
    __atomic_store_n(echo_, (unsigned long long)c.length, __ATOMIC_RELEASE);
    bump(nops_);
    return true;
  }
  if (c.op == OP_FLUSH || c.op == OP_BARRIER) {
    if (inflight_total_ > 0) {
      *stall = true;
      return false;
    }
  }
  if (c.op == OP_FLUSH) {
    // Single writer (this thread): a release store, no locked read-modify-write.
    __atomic_store_n(flushed_, __atomic_load_n(flushed_, __ATOMIC_RELAXED) + 1, __ATOMIC_RELEASE);
    bump(flushes_);
    return true;
  }
  const int dst = c.dst_rank;
  if (dst >= cfg.world) {
    reject(c, "destination rank out of range (world " + std::to_string(cfg.world) + ")");
    return true;
  }
  if (c.channel >= kMaxChannels || int(c.channel) % p_->num_threads() != index_) {
    reject(c, "channel " + std::to_string(c.channel) + " does not belong to this ring (channel % " +
                  std::to_string(p_->num_threads()) + " must be " + std::to_string(index_) + ", channel < 64)");
    return true;
  }
  const bool is_write = c.op == OP_WRITE || c.op == OP_WRITE_IMM;
  const uint64_t bytes = is_write ? c.length : 0;
  if (c.op != OP_BARRIER) {
    const LocalRegion* r = p_->region(c.region);
    if (!r) {
      reject(c, "region not registered");
      return true;
    }
    if (is_write && (uint64_t(c.local_off) + c.length > r->size || uint64_t(c.remote_off) + c.length > r->size)) {
      reject(c, "offset + length exceeds region size " + std::to_string(r->size));
      return true;
    }
    if (c.op == OP_ATOMIC_ADD && (uint64_t(c.remote_off) + 8 > r->size || (c.remote_off & 7))) {
      reject(c, "atomic target must be an 8-byte aligned int64 inside the region");
      return true;
    }
  }
  // In-flight limits per destination (count, and bytes when UCCL_IB_MAX_INFLIGHT_BYTES is set).
  if (inflight_[dst] >= cfg.max_inflight ||
      (cfg.max_inflight_bytes && inflight_[dst] > 0 && inflight_bytes_[dst] + bytes > cfg.max_inflight_bytes)) {
    *stall = true;
    return false;
  }
  uint32_t& seq = next_seq_[size_t(dst) * kMaxChannels + c.channel];
  const uint32_t imm = make_imm(c.channel, seq, c.op == OP_WRITE_IMM);
  const uint64_t wr = next_wr_++;
  if (is_write) {
    transport_->write(dst, c.region, c.local_off, c.remote_off, c.length, imm, wr);
    bump(writes_);
    bump(bytes_, c.length);
  } else if (c.op == OP_ATOMIC_ADD) {
    transport_->atomic_add(dst, c.region, c.remote_off, int64_t(int32_t(c.length)), imm, wr);
    bump(atomics_);
  } else {  // OP_BARRIER: everything earlier completed; flushed++, then a sequenced marker to dst
    __atomic_store_n(flushed_, __atomic_load_n(flushed_, __ATOMIC_RELAXED) + 1, __ATOMIC_RELEASE);
    bump(flushes_);
    transport_->atomic_add(dst, kNoRegion, 0, 0, imm, wr);
  }
  bump(commands_to_[dst]);
  bump(bytes_to_[dst], bytes);
  seq = (seq + 1) & kSeqMask;
  ++inflight_[dst];
  inflight_bytes_[dst] += bytes;
  // the completion deadline counts from the last completion, or from here when nothing was in flight (an
  // idle thread must not time out its first operation at once)
  if (inflight_total_ == 0) last_progress_ = Clock::now();
  ++inflight_total_;
  posted_.emplace(wr, Posted{dst, c.channel, bytes, Clock::now()});
  return true;
}

void ProxyThread::on_completions(const Completion* in, int n) {
  scratch_.clear();
  if (fault_.enabled()) {
    fault_.process(in, n, scratch_);
  } else {
    scratch_.assign(in, in + n);
  }
  if (!scratch_.empty()) last_progress_ = Clock::now();
  for (const Completion& c : scratch_) {
    if (c.kind == Completion::kLocal && c.wr_id == kUntrackedWr) continue;  // a failure message's send
    if (c.kind == Completion::kFailure) {  // a peer's proxy stopped, or the peer aborted: stop this rank's waits
      const int code = failure_code(c.value), block = failure_block(c.value);
      if (code == uccl_ep::kErrProxyFailed || code == uccl_ep::kErrAborted) p_->record_failure(c.peer, code, block);
      continue;
    }
    if (c.kind == Completion::kLocal) {
      auto it = posted_.find(c.wr_id);
      if (it == posted_.end()) UCCL_THROW("completion for unknown work request " << c.wr_id);
      const Posted& po = it->second;
      --inflight_[po.dst];
      inflight_bytes_[po.dst] -= po.bytes;
      --inflight_total_;
      posted_.erase(it);
      bump(local_);
    } else {
      emu_->on_arrival(c);
      bump(arrivals_);
    }
  }
}

void ProxyThread::check_timeouts() {
  if (inflight_total_ == 0 || posted_.empty()) return;
  const auto now = Clock::now();
  const double waited = std::chrono::duration<double>(now - last_progress_).count();
  if (waited < p_->cfg_.timeout_s) return;
  auto oldest = std::min_element(posted_.begin(), posted_.end(),
                                 [](const auto& a, const auto& b) { return a.second.t < b.second.t; });
  UCCL_THROW("rank " << p_->cfg_.rank << " timed out after " << waited << " s in 'completion' waiting for rank "
             << oldest->second.dst << " on channel " << oldest->second.channel << ": its writes there got no "
             << "completion; rank " << oldest->second.dst << " or the link to it is gone (did its process exit?), "
             << "`uccl-ep-train doctor --peers` checks the links; raise UCCL_EP_TIMEOUT_S if the network is only "
             << "slow (" << inflight_total_ << " operations in flight)");
}

// One iteration of the pickup loop: no syscall, no locked instruction, no sleep. The ring's next slot is
// read with one 16-byte load (vector rings) or its header with a plain acquire load (fence rings); on x86
// either is an ordinary load that hits the cache until the GPU's write invalidates the line. Credits are
// returned with one release store per batch, not per command.
bool ProxyThread::step() {
  constexpr uint32_t kBatch = 32;
  bool work = false;
  Completion comps[64];
  int n = transport_->poll(comps, 64);
  if (n > 0 || fault_.holding()) {
    on_completions(comps, n);
    work = n > 0;
    out_of_order_.store(emu_->out_of_order(), std::memory_order_relaxed);
    fault_held_.store(fault_.held_total(), std::memory_order_relaxed);
    held_.store(emu_->waiting(), std::memory_order_relaxed);
  }
  const uint64_t undelivered = transport_->undelivered_arrivals();  // changes without a completion returned
  if (undelivered != undelivered_.load(std::memory_order_relaxed))
    undelivered_.store(undelivered, std::memory_order_relaxed);
  Command cmds[kBatch];
  const uint32_t got = consumer_.peek(cmds, kBatch);
  uint32_t used = 0;
  if (got > 0) {
    const uint64_t pickup = proxy_clock_ticks();  // one clock read per batch: the pickup time of its NOPs
    for (; used < got; ++used) {
      bool stall = false;
      if (!handle(cmds[used], &stall, pickup)) break;
    }
    bump(commands_, used);
    consumer_.consume(used);
    const uint64_t die_after = p_->fault().die_after;
    if (die_after && commands_.load(std::memory_order_relaxed) >= die_after)
      UCCL_THROW("stopped by fault injection after " << die_after << " commands (UCCL_EP_FAULT die_after)");
  }
  // Credits: at once when the ring is drained (got < kBatch) or a command waits; otherwise in batches.
  if (got < kBatch || used < got || consumer_.unpublished() >= credit_batch_) consumer_.publish();
  return work || used > 0;
}

// ------------------------------------------------------------------------------------------------
namespace {
std::mutex g_ordinals_mu;
std::vector<bool> g_ordinals;  // held by a live Proxy of this process
}  // namespace

ProcessOrdinal::ProcessOrdinal() {
  std::lock_guard<std::mutex> l(g_ordinals_mu);
  value_ = int(std::find(g_ordinals.begin(), g_ordinals.end(), false) - g_ordinals.begin());
  if (size_t(value_) == g_ordinals.size()) g_ordinals.push_back(false);
  g_ordinals[size_t(value_)] = true;
}

ProcessOrdinal::~ProcessOrdinal() {
  std::lock_guard<std::mutex> l(g_ordinals_mu);
  g_ordinals[size_t(value_)] = false;
}

Proxy::Proxy(const ProxyConfig& cfg) : cfg_(cfg) {
  if (cfg.world < 1 || cfg.world > 256) UCCL_THROW("proxy: world size " << cfg.world << " must be in [1, 256]");
  if (cfg.rank < 0 || cfg.rank >= cfg.world) UCCL_THROW("proxy: rank " << cfg.rank << " out of range for world " << cfg.world);
  if (cfg.num_threads < 1 || cfg.num_threads > kMaxChannels)
    UCCL_THROW("proxy: UCCL_EP_PROXY_THREADS=" << cfg.num_threads << " must be in [1, " << kMaxChannels << "]");
  if (cfg.max_inflight < 1) UCCL_THROW("proxy: in-flight limit must be >= 1, got " << cfg.max_inflight);
  for (size_t i = 0; i < cfg.devices.size(); ++i)
    if (cfg.devices[i].empty())
      UCCL_THROW("proxy: devices[" << i << "] is empty; name a NIC (verbs device or libfabric domain) or pass no devices");
  cfg_.ring_publish = ring_publish_name(ring_publish_parse(cfg.ring_publish));  // resolved: "fence" | "vector"
  try {
    fault_ = FaultSpec::parse(cfg.fault);
  } catch (const std::invalid_argument& e) {
    UCCL_THROW(e.what());
  }
  regions_.resize(256);
  if (cfg.pin_threads && cfg.gpu >= 0) near_cpus_ = cpus_near_gpu(cfg.gpu);
  const std::vector<int>& cpus = near_cpus_;
  const size_t n = size_t(cfg.world) * kMaxChannels;
  {
    // Rings and signal words are pinned host memory that the GPU writes and the proxy threads spin on:
    // allocate them on the GPU's NUMA node (pages land on the node of the allocating thread). Only the
    // allocations run under this affinity: threads created later must not inherit it.
    AffinityScope near_gpu(cpus);
    sig_mem_ = HostMemory((2 * n + size_t(cfg.world)) * sizeof(unsigned long long) + kFailureRecordBytes, cfg.gpu);
  }
  const size_t fail_off = (2 * n + size_t(cfg.world)) * sizeof(unsigned long long);
  fail_host_ = reinterpret_cast<uccl_ep::ErrorRecord*>(sig_mem_.host() + fail_off);
  fail_dev_ = reinterpret_cast<uccl_ep::ErrorRecord*>(sig_mem_.device() + fail_off);
  std::memset(fail_host_, 0, kFailureRecordBytes);
  auto fill = [&](SignalBlock& s, char* base) {
    auto* p = reinterpret_cast<unsigned long long*>(base);
    s.seq_tail = p;
    s.imm_count = p + n;
    s.barrier_count = p + 2 * n;
    s.world = cfg.world;
  };
  fill(sig_host_, sig_mem_.host());
  fill(sig_dev_, sig_mem_.device());
  for (int t = 0; t < cfg.num_threads; ++t) threads_.emplace_back(new ProxyThread(this, t));
  if (cfg.pin_threads && cfg.gpu >= 0 && !cpus.empty()) {
    // Take cores from the end of the node's list: frameworks usually pin their own work to the start. Every
    // rank of the host whose GPU sits on this node (its place among them, in PCI order) and each proxy group
    // of a process (its ordinal: a low-latency Buffer runs two) take cores of their own: spinning threads
    // pinned to one core time-slice it, at milliseconds per command (measured: 2 x 1 LL dispatch on two
    // H100s of one node, every rank's threads on the same cores, 4.4 ms).
    const std::pair<int, int> place = gpu_place_on_node(cfg.gpu);
    const size_t first = size_t(ordinal_.value() * place.second + place.first) * size_t(cfg.num_threads);
    for (int t = 0; t < cfg.num_threads; ++t)
      threads_[t]->cpu_ = cpus[cpus.size() - 1 - (first + size_t(t)) % cpus.size()];
  }
}

Proxy::~Proxy() { stop(); }

uint32_t Proxy::imm_seq_bits() const { return threads_.at(0)->transport_->imm_seq_bits(); }
bool Proxy::calls_gpu_runtime() const { return threads_.at(0)->transport_->calls_gpu_runtime(); }

std::vector<std::pair<std::string, std::string>> Proxy::opened() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& t : threads_) out.emplace_back(t->transport_->opened_provider(), t->transport_->opened_device());
  return out;
}

void Proxy::register_region(int id, uint64_t ptr, uint64_t size, bool device) {
  if (id < 0 || id >= 256) UCCL_THROW("register_region: id " << id << " must be in [0, 256)");
  if (connected_) UCCL_THROW("register_region: regions must be registered before connect()");
  if (!ptr || !size) UCCL_THROW("register_region: region " << id << " has a null pointer or zero size");
  if (size > (uint64_t(1) << 32)) UCCL_THROW("register_region: region " << id << " is larger than 4 GiB (32-bit offsets)");
  LocalRegion r;
  r.id = id;
  r.base = reinterpret_cast<char*>(ptr);
  r.size = size;
  r.device = device;
  regions_[id] = r;
}

namespace {
void put_str(std::string& out, const std::string& s) {
  uint32_t n = uint32_t(s.size());
  out.append(reinterpret_cast<const char*>(&n), 4);
  out += s;
}
std::string get_str(const std::string& in, size_t& pos) {
  if (pos + 4 > in.size()) UCCL_THROW("bootstrap blob truncated");
  uint32_t n;
  std::memcpy(&n, in.data() + pos, 4);
  pos += 4;
  if (pos + n > in.size()) UCCL_THROW("bootstrap blob truncated");
  std::string s = in.substr(pos, n);
  pos += n;
  return s;
}
}  // namespace

std::string Proxy::local_blob(int t) {
  ProxyThread& th = *threads_.at(t);
  std::string out;
  put_str(out, th.transport_->address());
  std::vector<std::string> keys(256);
  uint32_t count = 0;
  for (const LocalRegion& r : regions_)
    if (r.id >= 0) {
      keys[r.id] = th.transport_->register_region(r);
      count = uint32_t(r.id) + 1;
    }
  out.append(reinterpret_cast<const char*>(&count), 4);
  for (uint32_t i = 0; i < count; ++i) put_str(out, keys[i]);
  return out;
}

void Proxy::connect(const std::vector<std::vector<std::string>>& blobs) {
  if (int(blobs.size()) != cfg_.world) UCCL_THROW("connect: got blobs for " << blobs.size() << " ranks, world is " << cfg_.world);
  for (int peer = 0; peer < cfg_.world; ++peer) {
    if (int(blobs[peer].size()) != num_threads())
      UCCL_THROW("connect: rank " << peer << " runs " << blobs[peer].size() << " proxy threads, this rank " << num_threads()
                 << "; UCCL_EP_PROXY_THREADS must match on every rank");
    for (int t = 0; t < num_threads(); ++t) {
      const std::string& b = blobs[peer][t];
      size_t pos = 0;
      std::string addr = get_str(b, pos);
      if (pos + 4 > b.size()) UCCL_THROW("bootstrap blob truncated");
      uint32_t count;
      std::memcpy(&count, b.data() + pos, 4);
      pos += 4;
      std::vector<std::string> keys(count);
      for (uint32_t i = 0; i < count; ++i) keys[i] = get_str(b, pos);
      threads_[t]->transport_->connect(peer, addr, keys);
    }
  }
  connected_ = true;
}

void Proxy::start() {
  if (!connected_) UCCL_THROW("proxy: start() before connect()");
  if (running_) return;
  for (auto& t : threads_) t->start();
  running_ = true;
}

void Proxy::stop() {
  // Every thread at once: each endpoint quiesces with its peers' (ProxyThread::finish), and a rank that stopped
  // its threads one by one would leave its other endpoints unprogressed while the peers wait on them.
  for (auto& t : threads_) t->request_stop();
  for (auto& t : threads_) t->stop();
  running_ = false;
  for (auto& t : threads_)
    if (t->transport_) t->transport_->close();
}

void Proxy::push(int t, const Command* cmds, size_t n, bool owned) {
  if (t < 0 || t >= num_threads()) UCCL_THROW("push: ring " << t << " out of range");
  if (cfg_.gpu >= 0) UCCL_THROW("push: ring " << t << " belongs to GPU producers (claim counter in GPU memory)");
  const RingDesc& d = ring_host(t);
  if (owned) {  // the RingProducer path: this thread is the ring's only producer until close()
    RingProducer p;
    p.open(d);
    for (size_t i = 0; i < n; ++i) {
      const auto deadline = Clock::now() + std::chrono::duration<double>(cfg_.timeout_s);
      while (!p.push(cmds[i], 1024)) {
        std::string e = error();
        if (!e.empty() || !running_ || Clock::now() > deadline) {
          p.close();  // hand back what was published
          if (!e.empty()) UCCL_THROW(e);
          UCCL_THROW("rank " << cfg_.rank << ": ring " << t << " stayed full for " << cfg_.timeout_s << " s (ring full): "
                     << (running_ ? "its proxy thread is not draining it (stuck behind a transport or a peer that "
                                    "stopped answering)"
                                  : "the proxy is not running (closed, or stopped by an error it raised first)"));
        }
        std::this_thread::yield();
      }
    }
    p.close();
    return;
  }
  size_t done = 0;
  while (done < n) {
    const uint32_t batch = uint32_t(std::min<size_t>(n - done, std::min<uint32_t>(32, d.capacity)));
    // Wait for credits before claiming, with a deadline: a claim cannot be undone, so a producer only
    // claims when the ring shows room (a race with other producers then waits in ring_claim briefly).
    const auto deadline = Clock::now() + std::chrono::duration<double>(cfg_.timeout_s);
    for (;;) {
      const unsigned long long claimed = __atomic_load_n(d.claim, __ATOMIC_RELAXED);
      const unsigned long long tail = __atomic_load_n(d.tail, __ATOMIC_ACQUIRE);
      if (claimed + batch <= tail + d.capacity) break;
      std::string e = error();
      if (!e.empty()) UCCL_THROW(e);
      if (!running_)
        UCCL_THROW("rank " << cfg_.rank << ": ring " << t << " is full (ring full) and the proxy is not running "
                   "(closed, or stopped by an error it raised first): nothing drains it");
      if (Clock::now() > deadline)
        UCCL_THROW("rank " << cfg_.rank << ": ring " << t << " stayed full for " << cfg_.timeout_s << " s (ring full): "
                   << "its proxy thread is not draining it (stuck behind a transport or a peer that stopped answering)");
      std::this_thread::yield();
    }
    ring_push(d, cmds + done, batch);
    done += batch;
  }
}

void Proxy::wait_seq(int src, int ch, uint64_t target, double timeout_s, const std::string& phase) {
  if (src < 0 || src >= cfg_.world || ch < 0 || ch >= kMaxChannels) UCCL_THROW("wait_seq: bad peer/channel " << src << "/" << ch);
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  const unsigned long long* p = &sig_host_.seq_tail[size_t(src) * kMaxChannels + ch];
  while (__atomic_load_n(p, __ATOMIC_ACQUIRE) < target) {
    std::string e = error();
    if (!e.empty()) UCCL_THROW(e);
    if (Clock::now() > deadline)
      UCCL_THROW("rank " << cfg_.rank << " timed out after " << timeout_s << " s in '" << phase << "' waiting for rank "
                 << src << " on channel " << ch << ": its messages did not arrive. Is rank " << src << " running the "
                 << "same op? A rank that raised earlier, or exited, leaves its peers waiting; a dead proxy thread or "
                 << "link stops it too (`uccl-ep-train doctor --peers`); raise UCCL_EP_TIMEOUT_S if rank " << src
                 << " is only slow (arrived " << __atomic_load_n(p, __ATOMIC_ACQUIRE) << " of " << target << ")");
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void Proxy::wait_flushed(int t, uint64_t target, double timeout_s) {
  const RingDesc& d = ring_host(t);
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (__atomic_load_n(d.flushed, __ATOMIC_ACQUIRE) < target) {
    std::string e = error();
    if (!e.empty()) UCCL_THROW(e);
    if (Clock::now() > deadline)
      UCCL_THROW("rank " << cfg_.rank << " timed out after " << timeout_s << " s in 'flush' waiting for ring " << t
                 << ": the writes before its flush did not all complete, so a peer or the link to it stopped "
                 << "answering (`uccl-ep-train doctor --peers`); raise UCCL_EP_TIMEOUT_S if the network is only slow ("
                 << __atomic_load_n(d.flushed, __ATOMIC_ACQUIRE) << " of " << target << " flushes)");
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

std::string Proxy::error() const {
  if (!failed_.load(std::memory_order_acquire)) return "";
  std::lock_guard<std::mutex> l(err_mu_);
  return error_;
}

uint64_t Proxy::failure_record(bool device) const {
  return reinterpret_cast<uint64_t>(device ? fail_dev_ : fail_host_);
}

void Proxy::record_failure(int rank, int code, int block) {
  if (failure_recorded_.exchange(true)) return;  // the first failure names it
  volatile uccl_ep::ErrorRecord* r = fail_host_;
  r->rank = rank;
  r->peer = rank;  // (the peer, when one is to blame, is in the failing thread's error text)
  r->block = block;
  r->phase = r->need = r->have = r->pad = 0;
  std::atomic_thread_fence(std::memory_order_seq_cst);  // the fields before the code the GPU polls
  r->code = code;
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

void Proxy::abort(int op) {
  UCCL_CHECK(op >= 0 && op < uccl_ep::kNumAbortOps, "proxy abort: op " << op << " outside [0, " << uccl_ep::kNumAbortOps << ")");
  int none = -1;
  abort_op_.compare_exchange_strong(none, op);
}

void ProxyThread::tell_peers(int code, int block) {
  const int64_t v = encode_failure(code, block);
  for (int peer = 0; peer < p_->cfg_.world; ++peer) {
    if (peer == p_->cfg_.rank) continue;
    try {
      transport_->send_failure(peer, v);
    } catch (const std::exception&) {  // that peer (or the link) is the failure: the others still hear of it
    }
  }
  // Progress for a moment (some providers move messages only while polled); what arrives is dropped: a failed
  // thread's traffic is lost anyway, and an aborting rank's peers stop on the record.
  const auto until = Clock::now() + std::chrono::milliseconds(20);
  Completion c[64];
  while (Clock::now() < until) {
    try {
      transport_->poll(c, 64);
    } catch (const std::exception&) {
      break;
    }
  }
}

void Proxy::set_error(const std::string& e) {
  std::lock_guard<std::mutex> l(err_mu_);
  if (error_.empty()) error_ = e;
  failed_.store(true, std::memory_order_release);
}

ProxyStats Proxy::stats() const {
  ProxyStats s;
  s.bytes_to.assign(size_t(cfg_.world), 0);
  s.commands_to.assign(size_t(cfg_.world), 0);
  for (const auto& t : threads_) {
    ProxyStats x = t->stats();
    s.commands += x.commands;
    s.writes += x.writes;
    s.atomics += x.atomics;
    s.flushes += x.flushes;
    s.nops += x.nops;
    s.rejected += x.rejected;
    s.bytes += x.bytes;
    s.local_completions += x.local_completions;
    s.arrivals += x.arrivals;
    s.out_of_order += x.out_of_order;
    s.fault_held += x.fault_held;
    s.idle_sleeps += x.idle_sleeps;
    s.held += x.held;
    s.undelivered += x.undelivered;
    for (size_t d = 0; d < s.bytes_to.size(); ++d) {
      s.bytes_to[d] += x.bytes_to[d];
      s.commands_to[d] += x.commands_to[d];
    }
  }
  return s;
}

std::vector<int> Proxy::thread_cpus() const {
  std::vector<int> v;
  for (const auto& t : threads_) v.push_back(t->cpu_);
  return v;
}

}  // namespace uccl
