// Device helpers shared by the kernels: CUDA/HIP portable loads/stores, system-scope signals, waits with
// deadlines, the error record that waits fill instead of hanging, and bf16 <-> float conversions.
#pragma once

#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/errors.h"
#include "common/portability.h"
#include "kernels/intranode_api.h"

#if defined(UCCL_EP_WITH_HIP)
#include <hip/hip_fp16.h>
#else
#include <cuda_fp16.h>
#endif

namespace uccl_ep::intranode {

constexpr int kWarpSize = UCCL_WARP_SIZE;

// The header of every rank's IPC buffer (kArriveOffset ... kHeaderBytes): intranode_api.h.

// Host: the SM count of `device` and the clock cycles a wait of `timeout_s` seconds lasts on it (an unknown
// clock counts as 2 GHz). Returns the first failing attribute query's error.
inline gpuError_t query_device(int device, double timeout_s, int* num_sms, int64_t* timeout_cycles) {
  int clock_khz = 0;
#if defined(UCCL_EP_WITH_HIP)
  gpuError_t e = hipDeviceGetAttribute(&clock_khz, hipDeviceAttributeClockRate, device);
  if (e == gpuSuccess) e = hipDeviceGetAttribute(num_sms, hipDeviceAttributeMultiprocessorCount, device);
#else
  gpuError_t e = cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device);
  if (e == gpuSuccess) e = cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, device);
#endif
  if (clock_khz <= 0) clock_khz = 2000000;
  *timeout_cycles = (int64_t)(timeout_s * (double)clock_khz * 1000.0);
  return e;
}

// The record the kernels write (and the proxies' failure record, which they poll): common/errors.h.
using ::uccl_ep::ErrorRecord;
using ::uccl_ep::error_fields;

// A 64-bit value (an expert id) in a record's int field: saturated, so a huge id still reads as out of range.
__device__ __forceinline__ int saturate_int(int64_t v) {
  return v > INT32_MAX ? INT32_MAX : (v < INT32_MIN ? INT32_MIN : (int)v);
}

// Peers that share memory learn of each other's errors through the words after the claim word (in every
// rank's device buffer): a board with one record per rank (slot r: what rank r reported) and a table of the
// peers' claim words as mapped in this process (written by the host when the peers' buffers are opened; an
// empty table tells nobody).
constexpr int kMaxBoard = 8;
constexpr int64_t kBoardRel = 64;                               // ErrorRecord[kMaxBoard], after the claim word
constexpr int64_t kPeerTableRel = kBoardRel + kMaxBoard * 32;   // int64 count, then int* claim[kMaxBoard]
// const ErrorRecord*: this rank's proxies' failure record (pinned host memory, mapped; Proxy::failure_record),
// null without proxies; written by the host once the proxies exist (the buffers' set_rings)
constexpr int64_t kProxyFailRel = kPeerTableRel + 8 + kMaxBoard * 8;
constexpr int64_t kErrorWordsBytes = kProxyFailRel + 8;

__device__ __forceinline__ ErrorRecord* error_board(int* claim) {
  return reinterpret_cast<ErrorRecord*>(reinterpret_cast<char*>(claim) + kBoardRel);
}

__device__ __forceinline__ void write_record(volatile ErrorRecord* r, int code, int rank, int peer, int block,
                                             int phase, int need, int have) {
  r->rank = rank;
  r->peer = peer;
  r->block = block;
  r->phase = phase;
  r->need = need;
  r->have = have;
  __threadfence_system();
  r->code = code;
  __threadfence_system();
}

// After this rank's claim word went up without a report of its own (a peer failed): the peer's record
// becomes this rank's host record, so that the host raises the peer's error (rank, phase, channel).
__device__ __forceinline__ void adopt_peer_error(ErrorRecord* err, int* claim) {
  if (*(volatile int*)claim != 2 || *(volatile int*)&err->code != 0) return;
  const volatile ErrorRecord* board = error_board(claim);
  for (int r = 0; r < kMaxBoard; ++r)
    if (board[r].code != 0) {
      write_record(err, board[r].code, board[r].rank, board[r].peer, board[r].block, board[r].phase, board[r].need,
                   board[r].have);
      return;
    }
}

// Whether an error was claimed on this rank (its own, or a peer's report): its ops then move nothing.
__device__ __forceinline__ bool error_pending(const int* claim) { return *(const volatile int*)claim != 0; }

// The record lives in pinned host memory (plain stores only: PCIe atomics are not everywhere); the claim
// word that picks the one reporter lives in this rank's device buffer (`claim`). `block` names where the
// wait was (a channel of the internode path); -1: this block. The report also goes into every peer's board
// and raises their claim words: their waits stop, and they adopt the record (adopt_peer_error).
__device__ __forceinline__ void report_error(ErrorRecord* err, int* claim, int code, int rank, int peer, int phase,
                                             int need, int have, int block = -1) {
  if (atomicCAS(claim, 0, 1) == 0) {
    block = block < 0 ? (int)blockIdx.x : block;
    write_record(err, code, rank, peer, block, phase, need, have);
    const char* table = reinterpret_cast<const char*>(claim) + kPeerTableRel;
    const int64_t n = *reinterpret_cast<const volatile int64_t*>(table);
    int* const* peers = reinterpret_cast<int* const*>(table + 8);
    int slot = -1;  // this rank's board slot: its own place in the node's table (its local index)
    for (int64_t r = 0; r < n && r < kMaxBoard; ++r)
      if (peers[r] == claim) slot = (int)r;
    for (int64_t r = 0; slot >= 0 && r < n && r < kMaxBoard; ++r) {
      int* pc = peers[r];
      if (pc == nullptr || pc == claim) continue;
      write_record(error_board(pc) + slot, code, rank, peer, block, phase, need, have);
      atomicCAS_system(pc, 0, 2);  // 2: a peer's error (the peer keeps its own report out of the record)
    }
  } else {
    adopt_peer_error(err, claim);  // a peer's report came first: the host raises that one
  }
}

// Whether this rank's proxies recorded a failure (a proxy thread stopped: transport error, dead peer, die_after
// fault): it becomes this rank's report (claimed, told to the node peers like any report), so the wait ends in
// one poll instead of at its deadline. Polled with the claim word (every 1024 iterations of a wait): a load of
// the pointer from this rank's buffer and, with proxies, one of the pinned host word. Out of line: the hot
// waits keep their registers.
// Host: points this rank's waits at its proxies' failure record (`record`: its device address; 0: none).
inline gpuError_t set_proxy_failure(int* claim, int64_t record) {
  const gpuError_t e =
      gpuMemcpyAsync(reinterpret_cast<char*>(claim) + kProxyFailRel, &record, sizeof(record), gpuMemcpyDefault, 0);
  return e == gpuSuccess ? gpuStreamSynchronize(0) : e;
}

// Host: the table report_error tells: every node rank's claim word as mapped in this process, by local index,
// this rank's own included (it finds its board slot there); nullptr for a rank not mapped. Written after the
// peers' buffers are opened (and again after anything that clears this rank's error words).
inline gpuError_t set_peer_claims(int* claim, const std::vector<int*>& node_claims) {
  int64_t table[1 + kMaxBoard] = {};
  const size_t n = node_claims.size() < size_t(kMaxBoard) ? node_claims.size() : size_t(kMaxBoard);
  table[0] = (int64_t)n;
  for (size_t r = 0; r < n; ++r) table[1 + r] = reinterpret_cast<int64_t>(node_claims[r]);
  const gpuError_t e =
      gpuMemcpyAsync(reinterpret_cast<char*>(claim) + kPeerTableRel, table, sizeof(table), gpuMemcpyDefault, 0);
  return e == gpuSuccess ? gpuStreamSynchronize(0) : e;
}

static __device__ __noinline__ bool proxy_failed(ErrorRecord* err, int* claim) {
  const ErrorRecord* pf =
      *reinterpret_cast<const ErrorRecord* const volatile*>(reinterpret_cast<const char*>(claim) + kProxyFailRel);
  if (pf == nullptr) return false;
  const volatile ErrorRecord* v = pf;
  if (v->code == 0) return false;
  report_error(err, claim, v->code, v->rank, v->peer, v->phase, v->need, v->have, v->block);
  return true;
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
#if defined(UCCL_EP_WITH_HIP)
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#else
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#endif
}

// Release: every earlier write of this thread (and, through the preceding barrier, of its block) becomes
// visible to whoever observes the increment.
__device__ __forceinline__ void signal_add(uint64_t* p) {
  __threadfence_system();
  atomicAdd_system(reinterpret_cast<unsigned long long*>(p), 1ULL);
}

// Waits until *p >= target; on deadline (or an error recorded elsewhere) reports and returns false.
__device__ __forceinline__ bool wait_geq(const uint64_t* p, uint64_t target, int64_t timeout_cycles,
                                         ErrorRecord* err, int* claim, int rank, int peer, int phase,
                                         int block = -1) {
  const long long start = clock64();
  uint32_t iter = 0;
  while (ld_acquire_sys(p) < target) {
    if ((++iter & 1023u) == 0) {
      if (*(volatile int*)claim != 0) {  // another wait (or a peer) already failed: do not pile up
        adopt_peer_error(err, claim);
        return false;
      }
      if (proxy_failed(err, claim)) return false;
      if (clock64() - start > timeout_cycles) {
        report_error(err, claim, kErrTimeout, rank, peer, phase, (int)target, (int)ld_acquire_sys(p), block);
        return false;
      }
    }
  }
  return true;
}

// Deadline of a wait on a mirror, a GPU word that one block copies from a host flag it polls: twice the
// flag's, so that block times out first and its record names the flag (target and value as the proxy writes
// them); the mirror waiters then adopt that record instead of racing it with the mirror's op numbers.
__device__ __forceinline__ int64_t mirror_timeout(int64_t timeout_cycles) {
  return timeout_cycles > INT64_MAX / 2 ? timeout_cycles : 2 * timeout_cycles;
}

__device__ __forceinline__ uint32_t ld_acquire_sys_u32(const uint32_t* p) {
#if defined(UCCL_EP_WITH_HIP)
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#else
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}

__device__ __forceinline__ void st_relaxed_sys_u32(uint32_t* p, uint32_t v) {
#if defined(UCCL_EP_WITH_HIP)
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
#else
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#endif
}

// Release store at system scope: this thread's earlier writes are visible to whoever sees the value.
__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
#if defined(UCCL_EP_WITH_HIP)
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#else
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

// Waits (every lane of the warp) until the row flag *p == seq; false on deadline / earlier error.
__device__ __forceinline__ bool wait_flag(const uint32_t* p, uint32_t seq, int64_t timeout_cycles, ErrorRecord* err,
                                          int* claim, int rank, int peer, int phase, int row) {
  if (ld_acquire_sys_u32(p) == seq) return true;
  const long long start = clock64();
  uint32_t iter = 0;
  while (ld_acquire_sys_u32(p) != seq) {
    if ((++iter & 1023u) == 0) {
      if (*(volatile int*)claim != 0) {
        adopt_peer_error(err, claim);
        return false;
      }
      if (proxy_failed(err, claim)) return false;
      if (clock64() - start > timeout_cycles) {
        report_error(err, claim, kErrTimeout, rank, peer, phase, row, -1);
        return false;
      }
    }
  }
  return true;
}

// 16-byte streaming load of data read once.
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
#if defined(UCCL_EP_WITH_HIP)
  return *p;  // plain load: the nontemporal builtin does not take HIP's int4 struct
#else
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#endif
}

// 16-byte load of data another GPU may have written during this kernel (after an acquire of its flag):
// the coherent global path, skipping L1 allocation (read once), with ld_nc_v4's 256-byte L2 fetch hint (a
// warp's 16-byte loads cover 512 contiguous bytes). Not `.nc`: the read-only path is only defined for data
// that stays unchanged for the kernel's lifetime.
__device__ __forceinline__ int4 ld_global_v4(const int4* p) {
#if defined(UCCL_EP_WITH_HIP)
  return *p;
#else
  int4 v;
  asm volatile("ld.global.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#endif
}

// 16-byte asynchronous copy global -> shared (sm_80+: cp.async, L2 only, no registers held while it flies),
// and the wait for all of this thread's copies. Elsewhere a plain copy (same result, synchronous).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
#if !defined(UCCL_EP_WITH_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
#else
  *reinterpret_cast<int4*>(smem) = *reinterpret_cast<const int4*>(gmem);
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if !defined(UCCL_EP_WITH_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
#endif
}

// Orders the warp's lanes (and their memory accesses) at this point: __syncwarp on NVIDIA, the wavefront
// barrier on AMD (ROCm has no __syncwarp).
__device__ __forceinline__ void warp_sync() {
#if defined(UCCL_EP_WITH_HIP)
  __builtin_amdgcn_wave_barrier();
#else
  __syncwarp();
#endif
}

// Warp votes over all lanes (bit i of the ballot = lane i; 64 lanes on AMD).
__device__ __forceinline__ uint64_t warp_ballot(bool pred) {
#if defined(UCCL_EP_WITH_HIP)
  return (uint64_t)__ballot(pred);
#else
  return (uint64_t)__ballot_sync(0xffffffffu, pred);
#endif
}

__device__ __forceinline__ bool warp_any(bool pred) {
#if defined(UCCL_EP_WITH_HIP)
  return __any(pred) != 0;
#else
  return __any_sync(0xffffffffu, pred) != 0;
#endif
}

__device__ __forceinline__ int warp_shfl(int v, int src) {
#if defined(UCCL_EP_WITH_HIP)
  return __shfl(v, src);
#else
  return __shfl_sync(0xffffffffu, v, src);
#endif
}

// Work beside a launch's communication blocks (the dispatch's expert-major expansion, the combine's fold):
// items [0, total) go to whichever warp claims them first, side blocks from their start and communication
// warps once their own part is done (or, for an item they wait on, at once). So the launch completes when
// its side blocks never become resident (another kernel on another stream holds those SMs): progress does
// not depend on which blocks run. A side block whose items may wait on peers first checks that every
// communication block of its launch has started (`comm_resident`), else leaves at once: it must not hold an
// SM a communication block still needs (the peers' rows it would wait for may come from such a block).
// Counters at kSideWorkOffset of this rank's buffer: items claimed, items finished, communication blocks
// started; the last block of the launch to exit zeroes them for the next launch (OpSeq::exit_block).
struct SideWork {
  unsigned long long* claimed;
  unsigned long long* done;
  unsigned int* started;

  __device__ static SideWork at(char* header) {
    auto* c = reinterpret_cast<unsigned long long*>(header + kSideWorkOffset);
    return SideWork{c, c + 1, reinterpret_cast<unsigned int*>(c + 2)};
  }
  // The next unclaimed item (the whole warp calls; every lane gets it).
  __device__ int64_t claim(int lane) const {
    int64_t k = 0;
    if (lane == 0) k = (int64_t)atomicAdd(claimed, 1ULL);
    const int lo = warp_shfl((int)(k & 0xffffffff), 0), hi = warp_shfl((int)(k >> 32), 0);
    return ((int64_t)hi << 32) | (uint32_t)lo;
  }
  // n items finished by this thread's warp (lane 0 calls): its writes and reads happen before the count.
  __device__ void finish(uint64_t n) const {
    __threadfence();
    atomicAdd(done, (unsigned long long)n);
  }
  // A communication block has started (one thread per block, before any wait).
  __device__ void comm_started() const { atomicAdd(started, 1u); }
  // Whether all `comm_blocks` communication blocks started within `patience` cycles (one thread calls).
  __device__ bool comm_resident(unsigned int comm_blocks, int64_t patience) const {
    const long long t0 = clock64();
    while (*(volatile unsigned int*)started < comm_blocks)
      if (clock64() - t0 > patience) return false;
    return true;
  }
  __device__ void reset() const {
    *claimed = 0;
    *done = 0;
    *started = 0;
  }
};

// The calls without a notify (a cached dispatch, every combine) would land rows of different sizes in each
// other's buffers when the ranks disagree on the call's shape (row bytes, scales, top-k, weights, dtype). Each
// sender writes its shape into slot [me] of every peer once that peer freed its buffer, before any row flag;
// a receiver compares a source's slot with its own shape once a row of that source landed (the flag orders
// the slot before it) and reports a mismatch as kErrShape, naming the field (kShapeFields).
// publish_shape: one thread per peer r (tid == r), after the block's wait for r's free signal.
__device__ __forceinline__ void publish_shape(char* peer, int me, const int* shape) {
  int* slot = reinterpret_cast<int*>(peer + kShapeSlotsOffset) + me * kShapeInts;
#pragma unroll
  for (int i = 0; i < kShapeInts; ++i) slot[i] = shape[i];
  __threadfence_system();  // before the block barrier that precedes the row flags of every warp
}
// Out of line (scalar arguments only): inlined, the report's code costs the hot kernels registers.
static __device__ __noinline__ void report_shape_mismatch(ErrorRecord* err, int* claim, int me, int src, int phase, int need,
                                                          int have, int field) {
  report_error(err, claim, kErrShape, me, src, phase, need, have, field);
}
// shape_agrees: one thread, after acquiring a row flag of source `src`. False: reported (every rank stops).
__device__ __forceinline__ bool shape_agrees(const char* my, int src, const int* shape, ErrorRecord* err, int* claim,
                                             int me, int phase) {
  const volatile int* slot = reinterpret_cast<const volatile int*>(my + kShapeSlotsOffset) + src * kShapeInts;
#pragma unroll
  for (int i = 1; i < kShapeInts; ++i) {  // (not field 0: the token counts may differ)
    const int theirs = slot[i];
    if (theirs != shape[i]) {
      report_shape_mismatch(err, claim, me, src, phase, shape[i], theirs, i);
      return false;
    }
  }
  return true;
}

// The signal base of an op: the blocks that every earlier op signalled to each peer (the same number on every
// rank: they run the same ops with the same SM counts), from which the op's waits and row-flag values are
// counted. It lives in this rank's buffer, not in the kernel arguments, so that a launch captured in a CUDA
// graph reads the current base at every replay: every block reads it at its start, and the last block of the
// launch to exit advances it by the blocks that signalled (then zeroes the SideWork counters). The next op on
// the stream starts after that.
struct OpSeq {
  unsigned long long* base;
  unsigned int* exited;
  char* header;

  __device__ static OpSeq at(char* header) {
    auto* b = reinterpret_cast<unsigned long long*>(header + kOpSeqOffset);
    return OpSeq{b, reinterpret_cast<unsigned int*>(b + 1), header};
  }
  __device__ uint64_t read() const { return *reinterpret_cast<volatile unsigned long long*>(base); }
  // One thread per block, after every thread of the block is done with the base and the SideWork counters.
  __device__ void exit_block(uint64_t signalled) const {
    __threadfence();
    if (atomicAdd(exited, 1u) == gridDim.x - 1) {
      *base += signalled;
      *exited = 0;
      SideWork::at(header).reset();
      __threadfence();
    }
  }
};

__device__ __forceinline__ float bf16_to_float(uint16_t b) { return __uint_as_float((uint32_t)b << 16); }

// Round to nearest even, as torch does; NaN stays NaN.
__device__ __forceinline__ uint16_t float_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// Row elements as float32 (the reductions' accumulator type): load element i of a row, store a rounded one.
struct ElemBf16 {
  static constexpr int kSize = 2;
  __device__ __forceinline__ static float load(const void* p, int64_t i) {
    return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
  __device__ __forceinline__ static void store(void* p, int64_t i, float f) {
    static_cast<uint16_t*>(p)[i] = float_to_bf16(f);
  }
};
struct ElemFp16 {
  static constexpr int kSize = 2;
  __device__ __forceinline__ static float load(const void* p, int64_t i) {
    return __half2float(static_cast<const __half*>(p)[i]);
  }
  __device__ __forceinline__ static void store(void* p, int64_t i, float f) {
    static_cast<__half*>(p)[i] = __float2half_rn(f);
  }
};
struct ElemFp32 {
  static constexpr int kSize = 4;
  __device__ __forceinline__ static float load(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
  __device__ __forceinline__ static void store(void* p, int64_t i, float f) { static_cast<float*>(p)[i] = f; }
};

// Copies `n` bytes, all threads of the grid cooperating (thread `tid` of `nthreads`), widest aligned vector.
__device__ __forceinline__ void grid_copy_bytes(void* dst, const void* src, int64_t n, int64_t tid,
                                                int64_t nthreads) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | (uintptr_t)n;
  if ((a & 15u) == 0) {
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    const int64_t m = n / 16;
    int64_t i = tid;
    for (; i + 3 * nthreads < m; i += 4 * nthreads) {
      int4 v0 = ld_nc_v4(s + i), v1 = ld_nc_v4(s + i + nthreads), v2 = ld_nc_v4(s + i + 2 * nthreads),
           v3 = ld_nc_v4(s + i + 3 * nthreads);
      d[i] = v0;
      d[i + nthreads] = v1;
      d[i + 2 * nthreads] = v2;
      d[i + 3 * nthreads] = v3;
    }
    for (; i < m; i += nthreads) d[i] = ld_nc_v4(s + i);
  } else if ((a & 3u) == 0) {
    const int* s = reinterpret_cast<const int*>(src);
    int* d = reinterpret_cast<int*>(dst);
    for (int64_t i = tid; i < n / 4; i += nthreads) d[i] = s[i];
  } else {
    const char* s = reinterpret_cast<const char*>(src);
    char* d = reinterpret_cast<char*>(dst);
    for (int64_t i = tid; i < n; i += nthreads) d[i] = s[i];
  }
}

// Zeroes `n` bytes with all threads of the grid, 16 bytes at a time where aligned.
__device__ __forceinline__ void grid_zero_bytes(void* dst, int64_t n, int64_t tid, int64_t nthreads) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | (uintptr_t)n;
  if ((a & 15u) == 0) {
    int4* d = reinterpret_cast<int4*>(dst);
    for (int64_t i = tid; i < n / 16; i += nthreads) d[i] = make_int4(0, 0, 0, 0);
  } else {
    char* d = reinterpret_cast<char*>(dst);
    for (int64_t i = tid; i < n; i += nthreads) d[i] = 0;
  }
}

}  // namespace uccl_ep::intranode
