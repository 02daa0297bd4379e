// RingBuffer: owns the memory behind one RingDesc (host: pinned and GPU-mapped when a GPU is used).
#pragma once

#include <string>
#include <utility>

#include "proxy/ring.h"

namespace uccl {

// Whether this host guarantees the 16-byte single-copy atomicity the vector publish needs (ring.h):
// x86-64 with AVX, aarch64 with FEAT_LSE2 (HWCAP_USCAT); false elsewhere.
bool ring_vector_publish_supported();
// The default publish mode: vector where supported (CUDA and CPU-only builds), fence otherwise and on HIP
// builds (the AMD path is compile-checked only, not yet measured).
RingPublish ring_publish_default();
// "" (default), "fence" or "vector" (UCCL_EP_RING_PUBLISH); throws on anything else, and on "vector"
// where ring_vector_publish_supported() is false.
RingPublish ring_publish_parse(const std::string& s);
const char* ring_publish_name(uint32_t mode);

// Host memory that the GPU can read and write (cudaHostAlloc mapped) when gpu >= 0, plain aligned memory
// otherwise. Zero-initialised.
class HostMemory {
 public:
  HostMemory() = default;
  HostMemory(size_t bytes, int gpu);
  ~HostMemory();
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;
  HostMemory(HostMemory&& o) noexcept { *this = std::move(o); }
  HostMemory& operator=(HostMemory&& o) noexcept;
  char* host() const { return host_; }
  char* device() const { return device_; }  // == host() without a GPU
  size_t size() const { return bytes_; }

 private:
  void release();
  char* host_ = nullptr;
  char* device_ = nullptr;
  size_t bytes_ = 0;
  bool pinned_ = false;
};

class RingBuffer {
 public:
  RingBuffer(uint32_t capacity, int gpu, RingPublish publish = ring_publish_default());
  ~RingBuffer();
  RingBuffer(const RingBuffer&) = delete;
  RingBuffer& operator=(const RingBuffer&) = delete;
  const RingDesc& host_desc() const { return host_; }
  const RingDesc& device_desc() const { return dev_; }
  bool gpu() const { return gpu_ >= 0; }

 private:
  HostMemory mem_;
  char* dev_counters_ = nullptr;  // claim + tail_cache in GPU memory
  int gpu_;
  RingDesc host_{}, dev_{};
};

}  // namespace uccl
