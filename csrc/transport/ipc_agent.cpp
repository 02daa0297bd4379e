// The ipc transport's copy agent (the emulated NIC's DMA engine) and its client; why it is a process of its
// own: transport/ipc_agent.h. Compiled only with CUDA or HIP.
#include "transport/ipc_agent.h"

#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)

#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/raii.h"

extern char** environ;

namespace uccl {

namespace {
constexpr uint64_t kMagic = 0x75636c6c444d4131ull;  // "ucclDMA1"
constexpr uint64_t kCapacity = 4096;                // requests in the ring (power of two)
constexpr size_t kMaxInFlight = 1024;               // copies the agent keeps queued on its stream
enum AgentState : uint32_t { kStarting = 0, kReady = 1, kFailed = 2 };

template <typename T>
T load_acquire(const T* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
template <typename T>
void store_release(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// The interpreter that runs the agent: this process's own, loading this very module file by path (no
// package import, no torch), so agent and client always run the same build.
const char* kAgentMain =
    "import sys, importlib.util as u\n"
    "s = u.spec_from_file_location('uccl_ep_train._native', sys.argv[1])\n"
    "m = u.module_from_spec(s)\n"
    "s.loader.exec_module(m)\n"
    "sys.exit(m.ipc_copy_agent(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))\n";

std::string path_of_symbol(const void* sym, const char* what) {
  Dl_info info{};
  if (!dladdr(sym, &info) || !info.dli_fname) UCCL_THROW("ipc copy agent: cannot locate " << what << " (dladdr)");
  return info.dli_fname;
}

std::string self_exe() {
  std::vector<char> buf(4096);
  ssize_t n = readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) UCCL_THROW("ipc copy agent: readlink(/proc/self/exe) failed: " << std::strerror(errno));
  return std::string(buf.data(), size_t(n));
}

void nap_us(long us) {
  timespec ts{0, us * 1000};
  nanosleep(&ts, nullptr);
}
}  // namespace

struct AgentSegment {
  uint64_t magic;
  uint64_t capacity;
  alignas(64) uint64_t head;  // requests published by the client
  alignas(64) uint64_t done;  // requests finished by the agent, in order
  alignas(64) uint32_t state;
  char error[1024];
  alignas(64) AgentRequest req[kCapacity];
};

// ---- agent ---------------------------------------------------------------------------------------------

namespace {

// Everything the agent maps or creates, released in its destructor whatever the exit path.
class Agent {
 public:
  Agent(AgentSegment* seg, int gpu, pid_t parent) : seg_(seg), gpu_(gpu), parent_(parent) {}
  ~Agent() {
    for (gpuEvent_t e : events_) (void)gpuEventDestroy(e);
    for (auto& kv : opened_) (void)gpuIpcCloseMemHandle(kv.second);
    if (scratch_) (void)gpuFree(scratch_);
    if (stream_) (void)gpuStreamDestroy(stream_);
  }

  // Returns true when asked to stop, false when the parent is gone.
  bool serve() {
    UCCL_CHECK_GPU(gpuSetDevice(gpu_));
    UCCL_CHECK_GPU(gpuStreamCreateWithFlags(&stream_, gpuStreamNonBlocking));
    constexpr size_t kBytes = (size_t(2) << 20) + 64;
    UCCL_CHECK_GPU(gpuMalloc(&scratch_, 2 * kBytes));
    preload(static_cast<char*>(scratch_) + kBytes, static_cast<char*>(scratch_), kBytes);
    store_release(&seg_->state, uint32_t(kReady));
    const uint64_t mask = seg_->capacity - 1;
    uint64_t taken = 0, finished = 0;
    uint32_t idle = 0;
    auto last_work = std::chrono::steady_clock::now();
    bool stopping = false;
    std::deque<std::pair<uint64_t, gpuEvent_t>> fifo;  // (ticket, event; null: finished when reached)
    for (;;) {
      bool progress = false;
      const uint64_t head = load_acquire(&seg_->head);
      while (!stopping && taken < head && fifo.size() < kMaxInFlight) {
        const AgentRequest r = seg_->req[taken & mask];
        ++taken;
        progress = true;
        gpuEvent_t ev = nullptr;
        if (r.kind == AgentRequest::kOpen) {
          open(r.dst_slot, r.key);
        } else if (r.kind == AgentRequest::kCopy) {
          ev = copy(r);
        } else if (r.kind == AgentRequest::kStop) {
          stopping = true;
        } else {
          UCCL_THROW("unknown request kind " << r.kind);
        }
        fifo.emplace_back(taken, ev);
      }
      while (!fifo.empty()) {  // in stream order: stop at the first copy still running
        gpuEvent_t ev = fifo.front().second;
        if (ev) {
          gpuError_t e = gpuEventQuery(ev);
          if (e == gpuErrorNotReady) break;
          UCCL_CHECK_GPU(e);
          events_.push_back(ev);
        }
        finished = fifo.front().first;
        fifo.pop_front();
        progress = true;
      }
      store_release(&seg_->done, finished);
      if (stopping && fifo.empty()) return true;
      if (progress) {
        idle = 0;
        last_work = std::chrono::steady_clock::now();
        continue;
      }
      if ((++idle & 255) != 0) {
        uccl_cpu_relax();
        continue;
      }
      if (getppid() != parent_) return false;
      // spin for 100 ms after the last request, then nap: a NIC does not sleep between the calls of a job,
      // and a copy that found the agent napping waited for its wake-up (measured, 2 x 1 emulated nodes on one
      // H100, 50 us of spinning against 500 ms: kernel timing BF16 dispatch 106 -> 94 us, combine 103 -> 77
      // us; 5 ms did not cover the benchmark's rounds; 100 ms itself was not measured against 500 ms). Once a
      // job has gone quiet the agents leave their cores to others; while it runs, the thread budget
      // (backends/internode.py) counts every agent as spinning.
      if (std::chrono::steady_clock::now() - last_work > std::chrono::milliseconds(100)) nap_us(5);
    }
  }

 private:
  struct Slot {
    char* ptr;
    uint64_t size;
  };

  void preload(char* dst, const char* src, size_t size) {
    // Every kind of copy the agent issues (byte-, 4-, 8- and 16-byte aligned, small and large) runs once
    // before the rank's kernels that wait for the copies can occupy the GPU (driver copy kernels are
    // modules too: a first use would load one while those kernels run).
    for (size_t len : {size_t(1), size_t(7), size_t(64), size_t(4096), size_t(65536), size_t(2) << 20})
      for (size_t off : {size_t(0), size_t(1), size_t(4), size_t(8)})
        if (off + len <= size) UCCL_CHECK_GPU(gpuMemcpyAsync(dst + off, src + off, len, gpuMemcpyDefault, stream_));
    UCCL_CHECK_GPU(gpuStreamSynchronize(stream_));
  }

  void open(uint32_t slot, const IpcKey& k) {
    if (!k.device) return;  // host memory: no slot; the client refuses copies to or from it
    auto id = std::make_pair(k.pid, k.base);
    auto it = opened_.find(id);
    if (it == opened_.end()) {
      void* base = nullptr;
      UCCL_CHECK_GPU(gpuIpcOpenMemHandle(&base, k.handle, gpuIpcMemLazyEnablePeerAccess));
      it = opened_.emplace(id, base).first;
    }
    Slot s{static_cast<char*>(it->second) + (k.ptr - k.base), k.size};
    slots_[slot] = s;
    // the bytes onto themselves (unchanged: nothing writes a region while the ranks connect)
    preload(s.ptr, s.ptr, s.size);
  }

  const Slot& slot(uint32_t id) const {
    auto it = slots_.find(id);
    if (it == slots_.end()) UCCL_THROW("copy through unopened slot " << id);
    return it->second;
  }

  gpuEvent_t copy(const AgentRequest& r) {
    const Slot& d = slot(r.dst_slot);
    const Slot& s = slot(r.src_slot);
    if (r.dst_off + r.len > d.size || r.src_off + r.len > s.size)
      UCCL_THROW("copy out of bounds: " << r.len << " bytes from " << r.src_off << " of slot " << r.src_slot << " ("
                 << s.size << ") to " << r.dst_off << " of slot " << r.dst_slot << " (" << d.size << ")");
    if (r.len) UCCL_CHECK_GPU(gpuMemcpyAsync(d.ptr + r.dst_off, s.ptr + r.src_off, r.len, gpuMemcpyDefault, stream_));
    gpuEvent_t ev;
    if (!events_.empty()) {
      ev = events_.back();
      events_.pop_back();
    } else {
      UCCL_CHECK_GPU(gpuEventCreateWithFlags(&ev, gpuEventDisableTiming));
    }
    UCCL_CHECK_GPU(gpuEventRecord(ev, stream_));
    return ev;
  }

  AgentSegment* seg_;
  int gpu_;
  pid_t parent_;
  gpuStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
  std::vector<gpuEvent_t> events_;  // free events (recycled)
  std::map<std::pair<int32_t, uint64_t>, void*> opened_;  // (owner pid, allocation base) -> local mapping
  std::unordered_map<uint32_t, Slot> slots_;
};

}  // namespace

int run_copy_agent(const std::string& name, int gpu, pid_t parent) {
  // Spawned from a thread that may be pinned (the proxy's allocation affinity): any core will do here.
  cpu_set_t any;
  CPU_ZERO(&any);
  for (int i = 0; i < CPU_SETSIZE; ++i) CPU_SET(i, &any);
  (void)sched_setaffinity(0, sizeof(any), &any);  // best effort: the kernel keeps it within the cpuset
  (void)prctl(PR_SET_TIMERSLACK, 1000UL);        // naps of microseconds, not the default 50 us slack
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    std::fprintf(stderr, "uccl_ep_train ipc copy agent: shm_open(%s) failed: %s\n", name.c_str(), std::strerror(errno));
    return 2;
  }
  void* p = mmap(nullptr, sizeof(AgentSegment), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    std::fprintf(stderr, "uccl_ep_train ipc copy agent: mmap(%s) failed: %s\n", name.c_str(), std::strerror(errno));
    return 2;
  }
  auto* seg = static_cast<AgentSegment*>(p);
  int rc = 0;
  bool orphaned = false;
  if (load_acquire(&seg->magic) != kMagic || seg->capacity != kCapacity) {
    std::fprintf(stderr, "uccl_ep_train ipc copy agent: %s is not a copy-agent segment of this build\n", name.c_str());
    rc = 2;
  } else {
    try {
      Agent agent(seg, gpu, parent);
      orphaned = !agent.serve();
    } catch (const std::exception& e) {
      std::snprintf(seg->error, sizeof(seg->error), "%s", e.what());
      store_release(&seg->state, uint32_t(kFailed));
      rc = 1;
    }
  }
  munmap(p, sizeof(AgentSegment));
  if (orphaned) shm_unlink(name.c_str());  // the client died without closing: nobody else will
  return rc;
}

// ---- client --------------------------------------------------------------------------------------------

CopyAgent::CopyAgent(const std::string& name, int gpu) : name_(name), bytes_(sizeof(AgentSegment)) {
  shm_unlink(name.c_str());  // a stale segment of a crashed run
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) UCCL_THROW("ipc copy agent: shm_open(" << name << ", create) failed: " << std::strerror(errno));
  if (ftruncate(fd, off_t(bytes_)) != 0) {
    int e = errno;
    ::close(fd);
    shm_unlink(name.c_str());
    UCCL_THROW("ipc copy agent: ftruncate(" << name << ") failed: " << std::strerror(e));
  }
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    UCCL_THROW("ipc copy agent: mmap(" << name << ") failed: " << std::strerror(e));
  }
  seg_ = static_cast<AgentSegment*>(p);
  seg_->capacity = kCapacity;
  seg_->head = seg_->done = 0;
  seg_->state = kStarting;
  store_release(&seg_->magic, kMagic);

  ScopeGuard unmap([&] {
    munmap(seg_, bytes_);
    seg_ = nullptr;
    shm_unlink(name.c_str());
  });
  const std::string exe = self_exe();
  const std::string module = path_of_symbol(reinterpret_cast<const void*>(&run_copy_agent), "the native module");
  std::string runtime = path_of_symbol(reinterpret_cast<const void*>(&gpuMemcpyAsync), "the GPU runtime library");
  runtime = runtime.substr(0, runtime.find_last_of('/'));
  // the agent loads the module by path: it must find the runtime library this process uses
  std::vector<std::string> env;
  std::string ld = "LD_LIBRARY_PATH=" + runtime;
  for (char** v = environ; *v; ++v) {
    std::string s(*v);
    if (s.rfind("LD_LIBRARY_PATH=", 0) == 0) ld += ":" + s.substr(16);
    else if (s.rfind("CUDA_MODULE_LOADING=", 0) != 0) env.push_back(s);
  }
  env.push_back(ld);
  env.push_back("CUDA_MODULE_LOADING=EAGER");  // no module load while the ranks' kernels occupy the GPU
  const std::string gpu_s = std::to_string(gpu), parent_s = std::to_string(getpid());
  std::vector<const char*> argv = {exe.c_str(), "-S", "-c", kAgentMain, module.c_str(), name.c_str(), gpu_s.c_str(),
                                   parent_s.c_str(), nullptr};
  std::vector<char*> envp;
  for (auto& s : env) envp.push_back(const_cast<char*>(s.c_str()));
  envp.push_back(nullptr);
  int rc = posix_spawn(&pid_, exe.c_str(), nullptr, nullptr, const_cast<char* const*>(argv.data()), envp.data());
  if (rc != 0) UCCL_THROW("ipc copy agent: posix_spawn(" << exe << ") failed: " << std::strerror(rc));
  unmap.dismiss();
}

[[noreturn]] void CopyAgent::fail(const std::string& why) {
  UCCL_THROW("ipc copy agent " << name_ << " (pid " << pid_ << "): " << why);
}

void CopyAgent::check_alive() {
  auto now = std::chrono::steady_clock::now();
  if (pid_ <= 0 || now < next_alive_check_) return;
  next_alive_check_ = now + std::chrono::milliseconds(20);
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) != pid_) return;
  pid_ = -1;
  if (load_acquire(&seg_->state) == kFailed) fail(seg_->error);
  fail(WIFEXITED(status) ? "exited with status " + std::to_string(WEXITSTATUS(status)) + " (its stderr says why)"
                         : "killed by signal " + std::to_string(WTERMSIG(status)));
}

uint64_t CopyAgent::done() {
  if (!seg_) fail("stopped");
  if (load_acquire(&seg_->state) == kFailed) fail(seg_->error);
  uint64_t d = load_acquire(&seg_->done);
  if (d < head_) check_alive();
  return d;
}

void CopyAgent::wait(uint64_t t, std::chrono::duration<double> timeout, const char* what) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout);
  while (done() < t) {
    if (std::chrono::steady_clock::now() > deadline) fail(std::string("did not finish ") + what + " in time");
    nap_us(50);
  }
}

uint64_t CopyAgent::push(const AgentRequest& r) {
  if (!seg_) fail("stopped");
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (uint32_t spins = 0; head_ - done() >= kCapacity; ++spins) {
    if ((spins & 1023) == 1023 && std::chrono::steady_clock::now() > deadline) fail("request ring stayed full for 30 s");
    uccl_cpu_relax();
  }
  seg_->req[head_ & (kCapacity - 1)] = r;
  store_release(&seg_->head, ++head_);
  return head_;
}

uint64_t CopyAgent::open(uint32_t slot, const IpcKey& key) {
  AgentRequest r{};
  r.kind = AgentRequest::kOpen;
  r.dst_slot = slot;
  r.key = key;
  return push(r);
}

uint64_t CopyAgent::copy(uint32_t dst_slot, uint64_t dst_off, uint32_t src_slot, uint64_t src_off, uint64_t len) {
  AgentRequest r{};
  r.kind = AgentRequest::kCopy;
  r.dst_slot = dst_slot;
  r.src_slot = src_slot;
  r.dst_off = dst_off;
  r.src_off = src_off;
  r.len = len;
  return push(r);
}

void CopyAgent::stop() {
  if (!seg_) return;
  if (pid_ > 0) {
    try {
      AgentRequest r{};
      r.kind = AgentRequest::kStop;
      push(r);
    } catch (const std::exception&) {  // failed (exits by itself) or dead (then already reaped)
    }
  }
  if (pid_ > 0) {
    int status = 0;
    pid_t got = 0;
    for (int i = 0; i < 1000 && (got = waitpid(pid_, &status, WNOHANG)) == 0; ++i) nap_us(10000);
    if (got == 0) {
      std::fprintf(stderr, "uccl_ep_train: ipc copy agent %s (pid %d) did not exit within 10 s; killing it\n",
                   name_.c_str(), int(pid_));
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
    }
    pid_ = -1;
  }
  munmap(seg_, bytes_);
  seg_ = nullptr;
  shm_unlink(name_.c_str());
}

}  // namespace uccl

#endif
