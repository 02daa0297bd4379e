#include "proxy/ring_buffer.h"

#include <cstdlib>
#include <cstring>
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

#include "common/check.h"
#include "common/raii.h"

namespace uccl {

bool ring_vector_publish_supported() {
#if defined(__x86_64__)
  // Intel SDM vol. 3A "Guaranteed Atomic Operations": aligned 16-byte (V)MOVDQA is atomic on CPUs that
  // enumerate AVX (AMD's APM documents the same).
  return __builtin_cpu_supports("avx");
#elif defined(__aarch64__) && defined(__linux__)
#ifndef HWCAP_USCAT
#define HWCAP_USCAT (1 << 25)
#endif
  return (getauxval(AT_HWCAP) & HWCAP_USCAT) != 0;  // FEAT_LSE2: aligned 16-byte LDP/STP single-copy atomic
#else
  return false;
#endif
}

RingPublish ring_publish_default() {
#if defined(UCCL_EP_WITH_HIP)
  return kRingPublishFence;
#else
  return ring_vector_publish_supported() ? kRingPublishVector : kRingPublishFence;
#endif
}

RingPublish ring_publish_parse(const std::string& s) {
  if (s.empty() || s == "default" || s == "auto") return ring_publish_default();
  if (s == "fence") return kRingPublishFence;
  if (s == "vector") {
    if (!ring_vector_publish_supported())
      UCCL_THROW("UCCL_EP_RING_PUBLISH=vector needs 16-byte single-copy atomic host loads (x86-64 with AVX, or "
                 "aarch64 with LSE2); this host has neither: use 'fence'");
    return kRingPublishVector;
  }
  UCCL_THROW("UCCL_EP_RING_PUBLISH must be 'fence' or 'vector', got '" << s << "'");
}

const char* ring_publish_name(uint32_t mode) { return mode == kRingPublishVector ? "vector" : "fence"; }

HostMemory::HostMemory(size_t bytes, int gpu) : bytes_(bytes) {
  if (gpu >= 0) {
#if UCCL_EP_WITH_GPU
    UCCL_CHECK_GPU(gpuSetDevice(gpu));
    void* p = nullptr;
    UCCL_CHECK_GPU(gpuHostAlloc(&p, bytes, gpuHostAllocMapped | gpuHostAllocPortable));
    host_ = static_cast<char*>(p);
    pinned_ = true;
    std::memset(host_, 0, bytes);
    void* d = nullptr;
    UCCL_CHECK_GPU(gpuHostGetDevicePointer(&d, p, 0));
    device_ = static_cast<char*>(d);
    return;
#else
    UCCL_THROW("GPU " << gpu << " requested but the native module was built without CUDA/HIP");
#endif
  }
  void* p = nullptr;
  if (posix_memalign(&p, 4096, bytes) != 0) UCCL_THROW("posix_memalign(" << bytes << ") failed");
  host_ = device_ = static_cast<char*>(p);
  std::memset(host_, 0, bytes);
}

HostMemory& HostMemory::operator=(HostMemory&& o) noexcept {
  if (this != &o) {
    release();
    host_ = o.host_;
    device_ = o.device_;
    bytes_ = o.bytes_;
    pinned_ = o.pinned_;
    o.host_ = o.device_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void HostMemory::release() {
  if (!host_) return;
#if UCCL_EP_WITH_GPU
  if (pinned_) {
    gpuError_t e = gpuFreeHost(host_);
    if (e != gpuSuccess) warn_release_gpu(e);
    host_ = device_ = nullptr;
    return;
  }
#endif
  std::free(host_);
  host_ = device_ = nullptr;
}

HostMemory::~HostMemory() { release(); }

namespace {
constexpr size_t kHeader = 512;  // tail @0, flushed @64, echo @128, claim @192, tail_cache @256
}

RingBuffer::RingBuffer(uint32_t capacity, int gpu, RingPublish publish) : gpu_(gpu) {
  if (capacity < 2 || (capacity & (capacity - 1)))
    UCCL_THROW("ring capacity must be a power of two >= 2, got " << capacity);
  mem_ = HostMemory(kHeader + size_t(capacity) * sizeof(Command), gpu);
  auto fill = [&](RingDesc& d, char* base) {
    d.tail = reinterpret_cast<unsigned long long*>(base + 0);
    d.flushed = reinterpret_cast<unsigned long long*>(base + 64);
    d.echo = reinterpret_cast<unsigned long long*>(base + 128);
    d.claim = reinterpret_cast<unsigned long long*>(base + 192);
    d.tail_cache = reinterpret_cast<unsigned long long*>(base + 256);
    d.slots = reinterpret_cast<Command*>(base + kHeader);
    d.capacity = capacity;
    d.mask = capacity - 1;
    d.publish = publish;
  };
  fill(host_, mem_.host());
  fill(dev_, mem_.device());
#if UCCL_EP_WITH_GPU
  if (gpu >= 0) {  // producers' atomics stay in GPU memory; only publish and credit reads cross PCIe
    void* p = nullptr;
    UCCL_CHECK_GPU(gpuMalloc(&p, 128));
    UCCL_CHECK_GPU(gpuMemset(p, 0, 128));
    dev_counters_ = static_cast<char*>(p);
    dev_.claim = reinterpret_cast<unsigned long long*>(dev_counters_);
    dev_.tail_cache = reinterpret_cast<unsigned long long*>(dev_counters_ + 64);
  }
#endif
}

RingBuffer::~RingBuffer() {
#if UCCL_EP_WITH_GPU
  if (dev_counters_) {
    gpuError_t e = gpuFree(dev_counters_);
    if (e != gpuSuccess) warn_release_gpu(e);
  }
#endif
}

}  // namespace uccl
