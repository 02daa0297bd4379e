// RingBuffer: owns the memory behind one RingDesc (host: pinned and GPU-mapped when a GPU is used).
#pragma once

#include <utility>

#include "proxy/ring.h"

namespace uccl {

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
  RingBuffer(uint32_t capacity, int gpu);
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
