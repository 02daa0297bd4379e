// The GPU→CPU command channel: one header shared by device code (CUDA/HIP) and host C++.
//
// A ring lives in pinned, GPU-mapped host memory. Producers (GPU warps, or CPU threads in tests) claim
// slots with one atomic on a claim counter and publish each 16-byte command in one of two ways
// (RingDesc::publish, chosen per ring by UCCL_EP_RING_PUBLISH=vector|fence):
//
//  vector (default where the host guarantees it, below): the producer writes the WHOLE command, header
//    with the lap bit included, with ONE 16-byte aligned store (CUDA: st.relaxed.sys.global.v4.b32,
//    i.e. one STG.128 that leaves the GPU as one PCIe write; HIP: one dwordx4 store), and the consumer
//    reads each slot with ONE 16-byte aligned load (ring_host_load16) and tests the lap bit from that
//    same load. Body and header arrive together, so no ordering between them and no fence is needed:
//    publishing costs one posted write instead of a system-scope release (~1.4 us on H200, which waits
//    for the PCIe write of the body to be acknowledged before the header may go).
//    What it relies on: 16-byte single-copy atomicity on both ends.
//    - host loads: x86 processors that enumerate AVX guarantee that aligned 16-byte MOVDQA/MOVAPS/
//      VMOVDQA (VEX.128) accesses are atomic (Intel SDM vol. 3A, "Guaranteed Atomic Operations",
//      §9.1.1 in current editions, §8.1.1 in older ones; AMD's APM vol. 2, "Access Atomicity", likewise
//      for processors with AVX); aarch64 with FEAT_LSE2 (HWCAP_USCAT) makes an aligned LDP/STP of 16
//      bytes single-copy atomic. Checked at run time (ring_vector_publish_supported, ring_buffer.h):
//      elsewhere the default is `fence` and asking for `vector` is an error.
//    - GPU stores: an aligned 16-byte store to system memory travels as one PCIe memory write (a slot
//      never crosses a 64-byte line), and the root complex updates a cache line as a unit. This is how
//      the hardware behaves, not a PTX/HIP memory-model promise (PTX calls a .v4 access four scalar
//      accesses); the fenced path stays selectable for that reason.
//    Data: a vector publish orders NOTHING before it. A command that makes the proxy read data the GPU
//    wrote (OP_WRITE's payload, ...) needs that data visible first: call ring_release_data() (one
//    fence.acq_rel.sys) ONCE per batch, after the payload stores and before publishing the batch's
//    commands (after a __syncwarp/__syncthreads when other threads wrote the payload: PTX fences are
//    cumulative). Pure signalling (OP_NOP, the pickup probe) needs none.
//
//  fence: the producer writes the 12-byte body, then stores the 4-byte header word with system-scope
//    release semantics: that store publishes the slot (on NVIDIA sm_70+ one `st.release.sys`, i.e.
//    MEMBAR.ALL.SYS + store, not the heavier sequentially consistent fence of __threadfence_system).
//    Each slot is published by the lane that filled it, so no cross-lane fence is needed. The consumer
//    reads the header with an acquire load (plain load on x86), then the body. The release also orders
//    the publishing lane's own earlier stores (payload) before the command.
//
// The single consumer (one CPU proxy thread per ring) spins on slots in slot order, copies commands out,
// and returns credits by storing its tail with release semantics, in batches (RingConsumer::consume /
// publish). Producers keep a cached copy of the tail next to the claim counter (GPU memory) and read the
// host tail over PCIe only when the ring looks full.
//
// Slot validity needs no consumer write-back: a slot at index i is ready when its opcode is non-zero and
// its lap bit equals (i / capacity) & 1, so stale commands from the previous lap never look ready.
//
// Echo block (latency probe): echo[0] is the cookie of the last OP_NOP picked up, echo[1] the proxy's
// clock (proxy_clock_ticks(), proxy.h) when that NOP was picked up; echo[1] is written before echo[0]
// (release), so a reader that sees the cookie also sees its pickup time. The echo words share one 64-byte
// line of the ring header (RingBuffer lays out tail / flushed / echo 64 bytes apart).
#pragma once

#include "common/portability.h"

namespace uccl {

enum Opcode : uint8_t {
  OP_INVALID = 0,     // never published (zeroed memory)
  OP_WRITE = 1,       // RDMA write local[local_off, +length) -> dst's region[remote_off, +length); sequenced
  OP_WRITE_IMM = 2,   // as OP_WRITE, and the receiver bumps imm_count[src][channel] when it is applied in order
  OP_ATOMIC_ADD = 3,  // dst's int64 at region[remote_off] += (int32)length, applied in sequence order
  OP_FLUSH = 4,       // quiet: wait until every earlier command of this ring completed, then flushed++
  OP_BARRIER = 5,     // flush, then a sequenced marker to dst: its barrier_count[src] += 1 in order
  OP_NOP = 6,         // no transport work; the proxy echoes `length` into echo[0], its pickup clock into echo[1]
  OP_LAST = OP_NOP,
};
constexpr uint8_t kOpcodeMask = 0x3f;
constexpr uint8_t kLapBit = 0x80;
constexpr int kMaxChannels = 64;  // channel field < 64; a channel always maps to ring (channel % num_rings)

// How producers publish a slot (RingDesc::publish; UCCL_EP_RING_PUBLISH, see the top of this file).
enum RingPublish : uint32_t {
  kRingPublishFence = 0,   // body, then the header with a system-scope release store
  kRingPublishVector = 1,  // the whole command in one 16-byte store; consumer reads it with one 16-byte load
};

// 16 bytes, naturally aligned. Word 0 is the header (published last).
struct alignas(16) Command {
  uint8_t op;          // Opcode | lap bit (bit 7); bits 6..5 reserved
  uint8_t dst_rank;    // destination rank (< 256)
  uint8_t channel;     // ordering channel (< kMaxChannels)
  uint8_t region;      // registered region id, the same id on every rank (symmetric buffers)
  uint32_t length;     // bytes for writes; signed addend for OP_ATOMIC_ADD; cookie for OP_NOP
  uint32_t local_off;  // byte offset into this rank's region
  uint32_t remote_off; // byte offset into the destination's region
};
static_assert(sizeof(Command) == 16, "Command must stay 16 bytes");

UCCL_HOST_DEVICE UCCL_FORCEINLINE uint32_t command_header(const Command& c) {
  return uint32_t(c.op) | (uint32_t(c.dst_rank) << 8) | (uint32_t(c.channel) << 16) | (uint32_t(c.region) << 24);
}

// Ring descriptor: plain pointers, passed by value to kernels. For the GPU view every pointer is a device
// pointer (slots/tail/flushed/echo are device-mapped host memory; claim/tail_cache are GPU memory).
struct RingDesc {
  Command* slots;
  unsigned long long* claim;       // producers' claim counter
  unsigned long long* tail_cache;  // producers' cached tail (monotonic max)
  unsigned long long* tail;        // consumer tail = credits returned (host memory)
  unsigned long long* flushed;     // number of OP_FLUSH/OP_BARRIER completed by the proxy
  unsigned long long* echo;        // [0]: last OP_NOP cookie picked up, [1]: its pickup time (latency probe)
  uint32_t capacity;               // power of two
  uint32_t mask;
  uint32_t publish;                // RingPublish: how producers publish and the consumer reads slots
};

// A ring's device descriptor from the 8 integers Python hands over (ProxyGroup.ring_desc(device=True): slots,
// claim, tail_cache, tail, flushed, echo, capacity, publish), as the kernels' launchers store it.
inline RingDesc ring_desc_from(const int64_t (&f)[8]) {
  RingDesc d;
  d.slots = reinterpret_cast<Command*>(f[0]);
  d.claim = reinterpret_cast<unsigned long long*>(f[1]);
  d.tail_cache = reinterpret_cast<unsigned long long*>(f[2]);
  d.tail = reinterpret_cast<unsigned long long*>(f[3]);
  d.flushed = reinterpret_cast<unsigned long long*>(f[4]);
  d.echo = reinterpret_cast<unsigned long long*>(f[5]);
  d.capacity = uint32_t(f[6]);
  d.mask = uint32_t(f[6]) - 1;
  d.publish = uint32_t(f[7]);
  return d;
}

// ---------------------------------------------------------------------------------------------------
// Memory-order primitives (device: system scope; host: GCC atomics)
UCCL_HOST_DEVICE UCCL_FORCEINLINE unsigned long long ring_load_acquire_sys(const unsigned long long* p) {
#if UCCL_DEVICE_CODE && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#elif UCCL_DEVICE_CODE
  unsigned long long v = *reinterpret_cast<const volatile unsigned long long*>(p);
  __threadfence_system();
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

UCCL_HOST_DEVICE UCCL_FORCEINLINE unsigned long long ring_fetch_add(unsigned long long* p, unsigned long long v) {
#if UCCL_DEVICE_CODE
  return atomicAdd(p, v);
#else
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
#endif
}

UCCL_HOST_DEVICE UCCL_FORCEINLINE void ring_fetch_max(unsigned long long* p, unsigned long long v) {
#if UCCL_DEVICE_CODE
  atomicMax(p, v);
#else
  unsigned long long cur = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (cur < v && !__atomic_compare_exchange_n(p, &cur, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
#endif
}

// Relaxed system-scope load (device: one PCIe read per call for host memory; no cache invalidation).
UCCL_HOST_DEVICE UCCL_FORCEINLINE unsigned long long ring_load_relaxed_sys(const unsigned long long* p) {
#if UCCL_DEVICE_CODE && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  unsigned long long v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#elif UCCL_DEVICE_CODE
  return *reinterpret_cast<const volatile unsigned long long*>(p);
#else
  return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}

// Release fence at system scope: orders this thread's earlier stores before its later stores for every
// observer (CPU included). Device sm_70+: fence.acq_rel.sys (MEMBAR.ALL.SYS), not fence.sc.sys.
UCCL_HOST_DEVICE UCCL_FORCEINLINE void ring_fence_sys() {
#if UCCL_DEVICE_CODE && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#elif UCCL_DEVICE_CODE
  __threadfence_system();
#else
  __atomic_thread_fence(__ATOMIC_RELEASE);
#endif
}

// Header store after ring_fence_sys() (several slots published behind one fence): relaxed, system scope.
UCCL_HOST_DEVICE UCCL_FORCEINLINE void ring_store_header(Command* slot, uint32_t header) {
#if UCCL_DEVICE_CODE && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" : : "l"(slot), "r"(header) : "memory");
#elif UCCL_DEVICE_CODE
  *reinterpret_cast<volatile uint32_t*>(slot) = header;
#else
  __atomic_store_n(reinterpret_cast<uint32_t*>(slot), header, __ATOMIC_RELEASE);
#endif
}

// Header store that publishes this thread's own earlier body stores: one release store at system scope.
UCCL_HOST_DEVICE UCCL_FORCEINLINE void ring_store_header_release(Command* slot, uint32_t header) {
#if UCCL_DEVICE_CODE && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("st.release.sys.global.u32 [%0], %1;" : : "l"(slot), "r"(header) : "memory");
#elif UCCL_DEVICE_CODE
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t*>(slot) = header;
#else
  __atomic_store_n(reinterpret_cast<uint32_t*>(slot), header, __ATOMIC_RELEASE);
#endif
}

// Body words 1..3: two stores (4 + 8 bytes) on NVIDIA, i.e. two PCIe writes instead of three.
UCCL_HOST_DEVICE UCCL_FORCEINLINE void ring_store_body(Command* slot, const Command& c) {
#if UCCL_DEVICE_CODE && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  uint32_t* w = reinterpret_cast<uint32_t*>(slot);
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" : : "l"(w + 1), "r"(c.length) : "memory");
  asm volatile("st.relaxed.sys.global.v2.u32 [%0], {%1, %2};" : : "l"(w + 2), "r"(c.local_off), "r"(c.remote_off) : "memory");
#else
  volatile uint32_t* w = reinterpret_cast<volatile uint32_t*>(slot);
  w[1] = c.length;
  w[2] = c.local_off;
  w[3] = c.remote_off;
#endif
}

// Data release before publishing commands that reference GPU-written data (vector publish orders nothing):
// one system-scope release fence, ONCE per batch of commands, after the payload stores (device sm_70+:
// fence.acq_rel.sys = MEMBAR.ALL.SYS; HIP: __threadfence_system; host: a release fence).
// The same fence as ring_fence_sys(); the name says what it is for at the call site.
UCCL_HOST_DEVICE UCCL_FORCEINLINE void ring_release_data() { ring_fence_sys(); }

#if !UCCL_DEVICE_CODE
// Host 16-byte accesses of one slot, each ONE instruction (the single-copy atomicity the vector publish
// relies on; see the top of this file). The load has acquire semantics, the store release semantics.
//   x86-64:  (v)movdqa (aligned SSE/VEX.128 access: atomic on CPUs with AVX; loads/stores are ordered
//            by TSO, the asm's "memory" clobber keeps the compiler from moving accesses across it)
//   aarch64: ldp + dmb ishld / dmb ish + stp (single-copy atomic with FEAT_LSE2)
//   other:   header acquire + body loads / body + header release store (the fenced protocol's accesses;
//            ring_vector_publish_supported() is false there, so the vector mode is never selected)
#if defined(__x86_64__)
#define UCCL_RING_HOST_VEC16 1
typedef long long uccl_ring_v16 __attribute__((vector_size(16), aligned(16)));
static inline void ring_host_load16(const void* slot, void* out) {
  uccl_ring_v16 v;
#if defined(__AVX__)
  asm volatile("vmovdqa %1, %0" : "=x"(v) : "m"(*static_cast<const uccl_ring_v16*>(slot)) : "memory");
#else
  asm volatile("movdqa %1, %0" : "=x"(v) : "m"(*static_cast<const uccl_ring_v16*>(slot)) : "memory");
#endif
  __builtin_memcpy(out, &v, 16);
}
static inline void ring_host_store16(void* slot, const void* in) {
  uccl_ring_v16 v;
  __builtin_memcpy(&v, in, 16);
#if defined(__AVX__)
  asm volatile("vmovdqa %1, %0" : "=m"(*static_cast<uccl_ring_v16*>(slot)) : "x"(v) : "memory");
#else
  asm volatile("movdqa %1, %0" : "=m"(*static_cast<uccl_ring_v16*>(slot)) : "x"(v) : "memory");
#endif
}
#elif defined(__aarch64__)
#define UCCL_RING_HOST_VEC16 1
static inline void ring_host_load16(const void* slot, void* out) {
  uint64_t lo, hi;
  asm volatile("ldp %0, %1, [%2]\n\tdmb ishld" : "=&r"(lo), "=&r"(hi) : "r"(slot) : "memory");
  uint64_t w[2] = {lo, hi};
  __builtin_memcpy(out, w, 16);
}
static inline void ring_host_store16(void* slot, const void* in) {
  uint64_t w[2];
  __builtin_memcpy(w, in, 16);
  asm volatile("dmb ish\n\tstp %1, %2, [%0]" : : "r"(slot), "r"(w[0]), "r"(w[1]) : "memory");
}
#else
#define UCCL_RING_HOST_VEC16 0
static inline void ring_host_load16(const void* slot, void* out) {
  uint32_t w[4];
  const uint32_t* p = static_cast<const uint32_t*>(slot);
  w[0] = __atomic_load_n(p, __ATOMIC_ACQUIRE);
  for (int i = 1; i < 4; ++i) w[i] = __atomic_load_n(p + i, __ATOMIC_RELAXED);
  __builtin_memcpy(out, w, 16);
}
static inline void ring_host_store16(void* slot, const void* in) {
  uint32_t w[4];
  __builtin_memcpy(w, in, 16);
  uint32_t* p = static_cast<uint32_t*>(slot);
  for (int i = 1; i < 4; ++i) __atomic_store_n(p + i, w[i], __ATOMIC_RELAXED);
  __atomic_store_n(p, w[0], __ATOMIC_RELEASE);
}
#endif
#endif  // !UCCL_DEVICE_CODE

// The whole command (header with lap bit + body) in ONE 16-byte aligned store: the vector publish.
UCCL_HOST_DEVICE UCCL_FORCEINLINE void ring_store_command16(Command* slot, uint32_t header, const Command& c) {
#if UCCL_DEVICE_CODE && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("st.relaxed.sys.global.v4.b32 [%0], {%1, %2, %3, %4};"
               : : "l"(slot), "r"(header), "r"(c.length), "r"(c.local_off), "r"(c.remote_off) : "memory");
#elif UCCL_DEVICE_CODE && defined(__CUDA_ARCH__)
  asm volatile("st.volatile.global.v4.b32 [%0], {%1, %2, %3, %4};"
               : : "l"(slot), "r"(header), "r"(c.length), "r"(c.local_off), "r"(c.remote_off) : "memory");
#elif UCCL_DEVICE_CODE
  typedef unsigned int uccl_v4u __attribute__((ext_vector_type(4)));  // 16-byte aligned: one dwordx4 store
  uccl_v4u v = {header, c.length, c.local_off, c.remote_off};
  *reinterpret_cast<volatile uccl_v4u*>(slot) = v;
#else
  const uint32_t w[4] = {header, c.length, c.local_off, c.remote_off};
  ring_host_store16(slot, w);
#endif
}

// ---------------------------------------------------------------------------------------------------
// Producer side.

// Claims n consecutive slots (n <= capacity) and waits for credits. Returns the first slot index, or
// ~0ull if `spin_limit` polls of the host tail passed without space (0 = wait forever).
// The cached tail is read before the claim atomic so that both are in flight together (one round trip to
// GPU memory, not two); an older cached value is only conservative (tail_cache is monotonic).
UCCL_HOST_DEVICE UCCL_FORCEINLINE unsigned long long ring_claim(const RingDesc& r, uint32_t n,
                                                                unsigned long long spin_limit = 0) {
#if UCCL_DEVICE_CODE
  unsigned long long t = *reinterpret_cast<volatile unsigned long long*>(r.tail_cache);
#else
  unsigned long long t = __atomic_load_n(r.tail_cache, __ATOMIC_RELAXED);
#endif
  const unsigned long long first = ring_fetch_add(r.claim, n);
  const unsigned long long need = first + n - r.capacity;  // tail must reach `need`
  if (first + n > r.capacity) {
    unsigned long long spins = 0;
    while (t < need) {
      t = ring_load_acquire_sys(r.tail);  // the only PCIe read: the ring looked full
      if (t >= need) {
        ring_fetch_max(r.tail_cache, t);
        break;
      }
      if (spin_limit && ++spins > spin_limit) return ~0ull;
#if !UCCL_DEVICE_CODE
      uccl_cpu_relax();
#endif
    }
  }
  return first;
}

// Writes one command into claimed slot `idx` (body only; publish with ring_publish_release, or with
// ring_publish after ring_fence_sys()).
UCCL_HOST_DEVICE UCCL_FORCEINLINE void ring_fill(const RingDesc& r, unsigned long long idx, const Command& c) {
  ring_store_body(&r.slots[idx & r.mask], c);
}

UCCL_HOST_DEVICE UCCL_FORCEINLINE uint32_t ring_header_for(const RingDesc& r, unsigned long long idx, const Command& c) {
  Command h = c;
  h.op = uint8_t((c.op & kOpcodeMask) | (((idx / r.capacity) & 1ull) ? kLapBit : 0));
  return command_header(h);
}

// Publishes slot idx; the caller fenced (ring_fence_sys) after filling the bodies it publishes.
UCCL_HOST_DEVICE UCCL_FORCEINLINE void ring_publish(const RingDesc& r, unsigned long long idx, const Command& c) {
  ring_store_header(&r.slots[idx & r.mask], ring_header_for(r, idx, c));
}

// Publishes slot idx that this thread filled: the release store orders the body before the header.
UCCL_HOST_DEVICE UCCL_FORCEINLINE void ring_publish_release(const RingDesc& r, unsigned long long idx, const Command& c) {
  ring_store_header_release(&r.slots[idx & r.mask], ring_header_for(r, idx, c));
}

// Vector publish of claimed slot idx: the whole command, lap bit included, in one 16-byte store. Orders
// nothing before it: call ring_release_data() first when the command references data written just before.
UCCL_HOST_DEVICE UCCL_FORCEINLINE void ring_publish_vector(const RingDesc& r, unsigned long long idx, const Command& c) {
  ring_store_command16(&r.slots[idx & r.mask], ring_header_for(r, idx, c), c);
}

// Fills and publishes claimed slot idx the way the ring is configured (r.publish).
UCCL_HOST_DEVICE UCCL_FORCEINLINE void ring_write_slot(const RingDesc& r, unsigned long long idx, const Command& c) {
  if (r.publish == kRingPublishVector) {
    ring_publish_vector(r, idx, c);
  } else {
    ring_fill(r, idx, c);
    ring_publish_release(r, idx, c);
  }
}

// Single-thread push of n commands: claim, then per command one 16-byte store (vector rings), or the
// bodies and one release store (n == 1) / one release fence and relaxed header stores (n > 1) (fence
// rings). Vector rings: call ring_release_data() first when the commands reference data written just
// before (the fenced path orders this thread's earlier stores itself).
UCCL_HOST_DEVICE inline bool ring_push(const RingDesc& r, const Command* cmds, uint32_t n,
                                       unsigned long long spin_limit = 0) {
  if (n == 0) return true;
  const unsigned long long first = ring_claim(r, n, spin_limit);
  if (first == ~0ull) return false;
  if (r.publish == kRingPublishVector) {
    for (uint32_t i = 0; i < n; ++i) ring_publish_vector(r, first + i, cmds[i]);
    return true;
  }
  for (uint32_t i = 0; i < n; ++i) ring_fill(r, first + i, cmds[i]);
  if (n == 1) {
    ring_publish_release(r, first, cmds[0]);
    return true;
  }
  ring_fence_sys();
  for (uint32_t i = 0; i < n; ++i) ring_publish(r, first + i, cmds[i]);
  return true;
}

// A producer that owns its ring for a while (one thread pushes, and no other producer until close()):
// head and cached tail live in registers, so a push is one slot write (vector rings: one 16-byte store)
// with no claim atomic; the host tail is read (one PCIe read) only when the ring looks full. This is the
// latency path for a warp or block that has a ring of its own (e.g. one ring per sending warp). open()
// continues from the ring's claim counter; close() hands the position back, so later producers (another
// kernel, ring_push) continue after it. Vector rings order nothing before the store: ring_release_data()
// first when a command references data written just before.
struct RingProducer {
  RingDesc r;
  unsigned long long head, tail;

  UCCL_HOST_DEVICE UCCL_FORCEINLINE void open(const RingDesc& d) {
    r = d;
#if UCCL_DEVICE_CODE
    head = *reinterpret_cast<volatile unsigned long long*>(d.claim);
    tail = *reinterpret_cast<volatile unsigned long long*>(d.tail_cache);
#else
    head = __atomic_load_n(d.claim, __ATOMIC_RELAXED);
    tail = __atomic_load_n(d.tail_cache, __ATOMIC_RELAXED);
#endif
  }

  // Publishes c; false if `spin_limit` polls of the host tail passed without room (0 = wait forever).
  UCCL_HOST_DEVICE UCCL_FORCEINLINE bool push(const Command& c, unsigned long long spin_limit = 0) {
    if (head + 1 > tail + r.capacity) {
      for (unsigned long long spins = 0;;) {
        tail = ring_load_acquire_sys(r.tail);
        if (head + 1 <= tail + r.capacity) break;
        if (spin_limit && ++spins > spin_limit) return false;
#if !UCCL_DEVICE_CODE
        uccl_cpu_relax();
#endif
      }
    }
    ring_write_slot(r, head, c);
    ++head;
    return true;
  }

  UCCL_HOST_DEVICE UCCL_FORCEINLINE void close() {
#if UCCL_DEVICE_CODE
    *reinterpret_cast<volatile unsigned long long*>(r.claim) = head;
#else
    __atomic_store_n(r.claim, head, __ATOMIC_RELAXED);
#endif
    ring_fetch_max(r.tail_cache, tail);
  }
};

#if defined(__HIPCC__) && defined(__HIP_PLATFORM_AMD__)
// Wavefront-cooperative push (AMD, 64 lanes): every active lane contributes one command when has_cmd.
// One claim atomic per wavefront; vector rings: one 16-byte store per lane, no fence (call
// ring_release_data() before when the commands reference data just written); fence rings: bodies, one
// system fence per wavefront, headers. Must be called by all active lanes.
__device__ inline void ring_push_warp(const RingDesc& r, const Command& c, bool has_cmd) {
  const unsigned lane = __lane_id();
  const unsigned long long vote = __ballot(has_cmd);
  if (vote == 0) return;
  const unsigned n = __popcll(vote);
  const int leader = __ffsll((long long)vote) - 1;
  unsigned long long first = 0;
  if (int(lane) == leader) first = ring_claim(r, n);
  first = __shfl(first, leader);
  const unsigned rank_in_vote = __popcll(vote & ((lane == 0) ? 0ull : (~0ull >> (64 - lane))));
  if (r.publish == kRingPublishVector) {
    if (has_cmd) ring_publish_vector(r, first + rank_in_vote, c);
    return;
  }
  if (has_cmd) ring_fill(r, first + rank_in_vote, c);
  __threadfence_system();
  if (has_cmd) ring_publish(r, first + rank_in_vote, c);
}
#elif defined(__CUDACC__) || defined(__HIPCC__)
// Warp-cooperative push: every active lane of `mask` contributes one command (lanes with has_cmd=false
// contribute nothing). One claim atomic per warp; each lane publishes its own slot: vector rings with one
// 16-byte store and no fence (call ring_release_data() before when the commands reference data just
// written), fence rings with body stores and one release store of the header (a slot's header covers only
// that lane's body, so no warp-wide fence). A lane's release orders only its own earlier stores: when
// commands reference payload other lanes wrote, __syncwarp() then ring_release_data() first, on either
// kind of ring. Must be called by all lanes in mask.
__device__ inline void ring_push_warp(const RingDesc& r, const Command& c, bool has_cmd, unsigned mask = 0xffffffffu) {
  const unsigned lane = threadIdx.x & 31u;
  const unsigned vote = __ballot_sync(mask, has_cmd);
  if (vote == 0) return;
  const unsigned n = __popc(vote);
  const unsigned leader = __ffs(vote) - 1;
  unsigned long long first = 0;
  if (lane == leader) first = ring_claim(r, n);
  first = __shfl_sync(mask, first, leader);
  const unsigned rank_in_vote = __popc(vote & ((1u << lane) - 1u));
  if (has_cmd) ring_write_slot(r, first + rank_in_vote, c);
}
#endif

// ---------------------------------------------------------------------------------------------------
// Consumer side (host only): one consumer per ring.
#if !UCCL_DEVICE_CODE
class RingConsumer {
 public:
  RingConsumer() = default;
  explicit RingConsumer(const RingDesc& d) : d_(d), tail_(0) {}

  // Copies up to `max` ready commands (in slot order) into out; returns how many. Opcode bits are
  // returned with the lap bit cleared. Does not return credits: call release() after using them.
  // Vector rings: one 16-byte load per slot, the lap bit tested from that same load.
  uint32_t peek(Command* out, uint32_t max) {
    uint32_t n = 0;
    if (d_.publish == kRingPublishVector) {
      while (n < max) {
        const unsigned long long idx = tail_ + n;
        Command c;
        ring_host_load16(&d_.slots[idx & d_.mask], &c);
        const uint8_t lap = ((idx / d_.capacity) & 1ull) ? kLapBit : 0;
        if ((c.op & kOpcodeMask) == 0 || (c.op & kLapBit) != lap) break;
        c.op &= kOpcodeMask;
        out[n++] = c;
      }
      return n;
    }
    while (n < max) {
      const unsigned long long idx = tail_ + n;
      Command* slot = &d_.slots[idx & d_.mask];
      const uint32_t h = __atomic_load_n(reinterpret_cast<const uint32_t*>(slot), __ATOMIC_ACQUIRE);
      const uint8_t op = uint8_t(h & 0xff);
      const uint8_t lap = ((idx / d_.capacity) & 1ull) ? kLapBit : 0;
      if ((op & kOpcodeMask) == 0 || (op & kLapBit) != lap) break;
      Command c;
      const volatile uint32_t* w = reinterpret_cast<const volatile uint32_t*>(slot);
      c.op = op & kOpcodeMask;
      c.dst_rank = uint8_t(h >> 8);
      c.channel = uint8_t(h >> 16);
      c.region = uint8_t(h >> 24);
      c.length = w[1];
      c.local_off = w[2];
      c.remote_off = w[3];
      out[n++] = c;
    }
    return n;
  }

  // Marks n more slots as used (local only: producers see the credits at the next publish()).
  void consume(uint32_t n) { tail_ += n; }
  // Makes every consumed slot available to producers (one release store of the tail, none if nothing new).
  void publish() {
    if (tail_ == published_) return;
    published_ = tail_;
    __atomic_store_n(d_.tail, tail_, __ATOMIC_RELEASE);
  }
  // consume(n) + publish().
  void release(uint32_t n) {
    consume(n);
    publish();
  }

  unsigned long long tail() const { return tail_; }
  unsigned long long unpublished() const { return tail_ - published_; }

 private:
  RingDesc d_{};
  unsigned long long tail_ = 0;
  unsigned long long published_ = 0;
};
#endif

}  // namespace uccl
