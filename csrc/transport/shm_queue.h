// ShmQueue: a bounded multi-producer / single-consumer queue of arrival records in POSIX shared memory
// (one per receiving proxy thread), used by the ipc transport to tell a peer's proxy that a copy into
// its memory completed or that an atomic/marker is due. Per-cell sequence numbers (lock-free, works
// across processes): a producer claims a position with a CAS on head, writes the record, then publishes
// the cell's sequence with release; the consumer acquires it.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>

#include "common/check.h"
#include "common/portability.h"
#include "transport/transport.h"

namespace uccl {

struct ShmRecord {
  uint64_t seq;  // cell sequence (queue protocol)
  uint32_t kind;
  uint32_t imm;
  int32_t peer;
  uint32_t region;
  uint64_t offset;
  int64_t value;
  uint64_t pad;
};
static_assert(sizeof(ShmRecord) == 48, "ShmRecord layout");

struct ShmQueueHeader {
  uint64_t magic;
  uint64_t capacity;
  alignas(64) uint64_t head;
  alignas(64) uint64_t tail;
  alignas(64) ShmRecord cells[1];
};

class ShmQueue {
 public:
  static constexpr uint64_t kMagic = 0x75636c6c51554555ull;  // "ucclQUEU"

  ShmQueue() = default;
  ShmQueue(const ShmQueue&) = delete;
  ShmQueue& operator=(const ShmQueue&) = delete;
  ~ShmQueue() { close(); }

  static size_t bytes_for(uint64_t capacity) { return offsetof(ShmQueueHeader, cells) + capacity * sizeof(ShmRecord); }

  // Creates (owner) a queue named `name` ("/..."), replacing a stale one left by a crashed run.
  void create(const std::string& name, uint64_t capacity) {
    UCCL_CHECK(capacity && !(capacity & (capacity - 1)), "shm queue capacity must be a power of two");
    name_ = name;
    owner_ = true;
    shm_unlink(name.c_str());
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) UCCL_THROW("shm_open(" << name << ", create) failed: " << std::strerror(errno));
    size_ = bytes_for(capacity);
    if (ftruncate(fd, off_t(size_)) != 0) {
      int e = errno;
      ::close(fd);
      UCCL_THROW("ftruncate(" << name << ") failed: " << std::strerror(e));
    }
    map(fd);
    h_->capacity = capacity;
    for (uint64_t i = 0; i < capacity; ++i) h_->cells[i].seq = i;
    h_->head = h_->tail = 0;
    __atomic_store_n(&h_->magic, kMagic, __ATOMIC_RELEASE);
  }

  // Opens a peer's queue.
  void open(const std::string& name) {
    name_ = name;
    owner_ = false;
    int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) UCCL_THROW("shm_open(" << name << ") failed: " << std::strerror(errno) << " (peer not created yet, or on another host?)");
    struct stat st {};
    fstat(fd, &st);
    size_ = size_t(st.st_size);
    map(fd);
    if (__atomic_load_n(&h_->magic, __ATOMIC_ACQUIRE) != kMagic) UCCL_THROW("shm queue " << name << " not initialised");
  }

  void close() {
    if (h_) {
      munmap(h_, size_);
      h_ = nullptr;
    }
    if (owner_ && !name_.empty()) shm_unlink(name_.c_str());
    owner_ = false;
  }

  // Producer: returns false when the queue stayed full until `deadline`.
  bool push(const Completion& c, std::chrono::steady_clock::time_point deadline) {
    const uint64_t mask = h_->capacity - 1;
    uint64_t pos = __atomic_load_n(&h_->head, __ATOMIC_RELAXED);
    for (uint32_t spins = 0;; ++spins) {
      ShmRecord& cell = h_->cells[pos & mask];
      const uint64_t seq = __atomic_load_n(&cell.seq, __ATOMIC_ACQUIRE);
      const int64_t dif = int64_t(seq) - int64_t(pos);
      if (dif == 0) {
        if (__atomic_compare_exchange_n(&h_->head, &pos, pos + 1, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
          cell.kind = uint32_t(c.kind);
          cell.imm = c.imm;
          cell.peer = c.peer;
          cell.region = c.region;
          cell.offset = c.offset;
          cell.value = c.value;
          __atomic_store_n(&cell.seq, pos + 1, __ATOMIC_RELEASE);
          return true;
        }
      } else if (dif < 0) {  // full
        if ((spins & 1023) == 1023 && std::chrono::steady_clock::now() > deadline) return false;
        uccl_cpu_relax();
        pos = __atomic_load_n(&h_->head, __ATOMIC_RELAXED);
      } else {
        pos = __atomic_load_n(&h_->head, __ATOMIC_RELAXED);
      }
    }
  }

  // Consumer (single): pops up to max records.
  int pop(Completion* out, int max) {
    const uint64_t mask = h_->capacity - 1;
    int n = 0;
    uint64_t pos = h_->tail;
    while (n < max) {
      ShmRecord& cell = h_->cells[pos & mask];
      const uint64_t seq = __atomic_load_n(&cell.seq, __ATOMIC_ACQUIRE);
      if (seq != pos + 1) break;
      Completion c;
      c.kind = Completion::Kind(cell.kind);
      c.imm = cell.imm;
      c.peer = cell.peer;
      c.region = cell.region;
      c.offset = cell.offset;
      c.value = cell.value;
      out[n++] = c;
      __atomic_store_n(&cell.seq, pos + mask + 1, __ATOMIC_RELEASE);
      ++pos;
    }
    h_->tail = pos;
    return n;
  }

  bool valid() const { return h_ != nullptr; }

 private:
  void map(int fd) {
    void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = errno;
    ::close(fd);
    if (p == MAP_FAILED) UCCL_THROW("mmap of shm queue " << name_ << " failed: " << std::strerror(e));
    h_ = static_cast<ShmQueueHeader*>(p);
  }
  ShmQueueHeader* h_ = nullptr;
  size_t size_ = 0;
  std::string name_;
  bool owner_ = false;
};

}  // namespace uccl
