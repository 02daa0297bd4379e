// The one small interface every transport implements: register memory -> key, write with immediate,
// atomic add, poll completions. Transports know nothing of tokens, experts or rings.
//
// Immediate data (32 bits, fits verbs' imm_data): bits 31..25 channel, bit 24 "signal" (OP_WRITE_IMM),
// bits 23..0 sequence number per (source rank, channel). The proxy assigns it; the transport only carries it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace uccl {

constexpr uint32_t kSeqBits = 24;
constexpr uint32_t kSeqMask = (1u << kSeqBits) - 1;
constexpr uint32_t kImmSignalBit = 1u << 24;

inline uint32_t make_imm(uint32_t channel, uint32_t seq, bool signal) {
  return (channel << 25) | (signal ? kImmSignalBit : 0u) | (seq & kSeqMask);
}
inline uint32_t imm_channel(uint32_t imm) { return imm >> 25; }
inline uint32_t imm_seq(uint32_t imm) { return imm & kSeqMask; }
inline bool imm_signal(uint32_t imm) { return (imm & kImmSignalBit) != 0; }

// The 4-byte remote CQ data some providers offer (libfabric's efa: cq_data_size 4) cannot hold the 32-bit
// immediate plus the writer's rank, so the fabric transport packs both into 32 bits there: bits 31..24 the
// writer's rank (a proxy world is at most 256 ranks), 23..18 the channel (kMaxChannels = 64), 17 the signal
// bit, 16..0 the low 17 bits of the sequence number. The receiver's ordering emulation then compares sequence
// numbers modulo 2^17 (Transport::imm_seq_bits): 65536 operations of one (rank, channel) may be in flight,
// far more than a proxy ring holds.
constexpr uint32_t kCompactSeqBits = 17;
constexpr int kCompactMaxRanks = 256;

inline uint32_t pack_compact_cq_data(int sender, uint32_t imm) {
  return (uint32_t(sender) << 24) | ((imm_channel(imm) & 63u) << 18) | (imm_signal(imm) ? 1u << 17 : 0u) |
         (imm_seq(imm) & ((1u << kCompactSeqBits) - 1));
}
// The writer's rank and the immediate (sequence number truncated to kCompactSeqBits) of packed CQ data.
inline int compact_cq_sender(uint32_t data) { return int(data >> 24); }
inline uint32_t compact_cq_imm(uint32_t data) {
  return make_imm((data >> 18) & 63u, data & ((1u << kCompactSeqBits) - 1), (data >> 17) & 1u);
}

// Region id meaning "no memory effect" (ordering markers, barriers).
constexpr uint32_t kNoRegion = 0xffffffffu;

struct Completion {
  enum Kind : uint8_t {
    kLocal = 0,    // an operation this endpoint posted has completed locally (wr_id identifies it)
    kArrival = 1,  // a write with immediate from `peer` landed here
    kAtomic = 2,   // an emulated atomic from `peer`: apply region[offset] += value in sequence order
    kMarker = 3,   // a sequenced marker (no memory effect): barrier
    kFailure = 4,  // unsequenced: `peer`'s proxy failed or its rank aborted a call (value: send_failure's)
  };
  Kind kind = kLocal;
  int peer = -1;
  uint32_t imm = 0;
  uint32_t region = kNoRegion;
  uint64_t wr_id = 0;
  uint64_t offset = 0;
  int64_t value = 0;
};

// wr_id of what a transport posts for itself (send_failure): its local completion is not the caller's.
constexpr uint64_t kUntrackedWr = ~0ull;

// Region as registered locally.
struct LocalRegion {
  int id = -1;
  char* base = nullptr;
  uint64_t size = 0;
  bool device = false;  // GPU memory (not dereferenceable by the CPU)
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // This endpoint's address, an opaque blob exchanged through the bootstrap.
  virtual std::string address() = 0;
  // Registers [ptr, ptr+len) as region `id` and returns its key blob for peers.
  virtual std::string register_region(const LocalRegion& region) = 0;
  // Adds peer `peer` (its address blob) and its region keys (one blob per region id, "" if absent).
  virtual void connect(int peer, const std::string& address, const std::vector<std::string>& region_keys) = 0;
  // Posts a write of `len` bytes with immediate `imm` (len may be 0: a pure sequenced notification).
  virtual void write(int peer, uint32_t region, uint64_t local_off, uint64_t remote_off, uint64_t len,
                     uint32_t imm, uint64_t wr_id) = 0;
  // Posts an atomic add of `value` to the int64 at peer's region[remote_off], sequenced by `imm`.
  // region == kNoRegion: a sequenced marker with no memory effect.
  virtual void atomic_add(int peer, uint32_t region, uint64_t remote_off, int64_t value, uint32_t imm,
                          uint64_t wr_id) = 0;
  // Tells `peer` (unsequenced, over the same control path as atomics) that this rank failed: its proxy thread
  // stopped, or it aborted a call; `value` is the proxy's encoding (Proxy::record_failure). Best effort: the
  // caller ignores a peer it cannot reach. Its local completion, if any, carries kUntrackedWr.
  virtual void send_failure(int peer, int64_t value) = 0;
  // Drains up to `max` completions (local and remote).
  virtual int poll(Completion* out, int max) = 0;
  // How many low bits of an arrival's sequence number survive the wire: the ordering emulation compares
  // sequence numbers modulo 2^imm_seq_bits().
  virtual uint32_t imm_seq_bits() const { return kSeqBits; }
  // True when the proxy thread's progress may call the GPU runtime (a libfabric provider that copies GPU
  // memory with it, having refused FI_OPT_CUDA_API_PERMITTED): such a copy can queue in the hardware queue of
  // kernels that spin until it lands, its device-to-device copies go on the legacy default stream and the
  // transport's arrivals wait for them, so kernels that wait for those arrivals must run on other streams and
  // the default stream must not wait for them. verbs (DMA) and ipc (copy agents in their own processes) never
  // do.
  // CUDA builds only: a HIP build's providers copy with the ROCm runtime untracked (false).
  virtual bool calls_gpu_runtime() const { return false; }
  // Arrivals the transport has read but not yet delivered by poll() (the fabric transport's copy fence holds
  // them until the provider's GPU copies ran): a gauge for the proxies' state in timeout reports.
  virtual size_t undelivered_arrivals() const { return 0; }
  // What this endpoint opened, as the transport resolved it (a setting may name a provider by an alias, or
  // none, leaving the choice to the library): the libfabric provider ("" where there is none: verbs, ipc) and
  // the NIC (verbs device, libfabric domain; "" for ipc). `doctor --peers` reports these, not the settings.
  virtual std::string opened_provider() const { return ""; }
  virtual std::string opened_device() const { return ""; }
  // Called once the endpoint's proxy thread has stopped, before close(): completes what this endpoint posted
  // and agrees with every connected peer's endpoint that nothing more is in flight between them, so that
  // close() releases an idle endpoint (libfabric 1.17's tcp;ofi_rxm dereferences a null context, and crashes,
  // when an endpoint closes in the middle of a peer's incoming write). Gives up at `timeout_s`. Returns "" when
  // the endpoint is idle, else what is still outstanding. Transports whose close is safe mid-transfer agree at
  // once.
  virtual std::string quiesce(double timeout_s) {
    (void)timeout_s;
    return "";
  }
  // Releases everything (also done by the destructor); idempotent.
  virtual void close() {}
};

struct TransportOptions {
  int rank = 0;
  int world = 1;
  int thread_index = 0;
  int gpu = -1;
  std::string provider;  // fabric: FI_PROVIDER-style name ("tcp", "shm", "sockets"); empty: libfabric's choice
  // The NIC this endpoint opens: verbs device name (mlx5_0, rdmap16s27) or libfabric domain name (the efa
  // provider names its domains <device>-rdm); empty: the transport's own default (first device / domain).
  std::string device;
  std::string job;           // ipc: job-unique prefix for shared-memory names
  // The proxy's flow control (UCCL_IB_MAX_INFLIGHT_*): operations / bytes in flight per destination. verbs
  // sizes its queues from the first and names both in completion errors.
  int max_inflight = 1;
  uint64_t max_inflight_bytes = 0;
};

// Factories; each throws a clear error when the transport is not compiled in.
std::unique_ptr<Transport> make_transport(const std::string& kind, const TransportOptions& opts);
std::vector<std::string> compiled_transports();

}  // namespace uccl
