// Python bindings for the command channel: Proxy, the command constants, OrderingEmulator (for tests).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "bindings.h"
#include "common/check.h"
#include "proxy/fault.h"
#include "proxy/ordering.h"
#include "proxy/proxy.h"
#include "common/env.h"

namespace py = pybind11;
using namespace uccl;

namespace {

py::dict ring_dict(const RingDesc& d) {
  py::dict r;
  r["slots"] = reinterpret_cast<uintptr_t>(d.slots);
  r["claim"] = reinterpret_cast<uintptr_t>(d.claim);
  r["tail_cache"] = reinterpret_cast<uintptr_t>(d.tail_cache);
  r["tail"] = reinterpret_cast<uintptr_t>(d.tail);
  r["flushed"] = reinterpret_cast<uintptr_t>(d.flushed);
  r["echo"] = reinterpret_cast<uintptr_t>(d.echo);
  r["capacity"] = d.capacity;
  r["publish"] = std::string(ring_publish_name(d.publish));
  return r;
}

py::dict stats_dict(const ProxyStats& s) {
  py::dict d;
  d["commands"] = s.commands;
  d["writes"] = s.writes;
  d["atomics"] = s.atomics;
  d["flushes"] = s.flushes;
  d["nops"] = s.nops;
  d["rejected"] = s.rejected;
  d["bytes"] = s.bytes;
  d["local_completions"] = s.local_completions;
  d["arrivals"] = s.arrivals;
  d["out_of_order"] = s.out_of_order;
  d["fault_held"] = s.fault_held;
  d["idle_sleeps"] = s.idle_sleeps;
  d["held"] = s.held;
  d["undelivered"] = s.undelivered;
  d["bytes_to"] = s.bytes_to;        // list, index = destination rank
  d["commands_to"] = s.commands_to;
  return d;
}

unsigned long long load(const unsigned long long* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

// Test harness around OrderingEmulator: its own signal block and 64 int64 counters as region 0.
struct OrderingHarness {
  OrderingHarness(int world, uint32_t seq_bits)
      : world(world), seq(size_t(world) * kMaxChannels), imm(size_t(world) * kMaxChannels), bar(size_t(world)),
        counters(64, 0) {
    SignalBlock s;
    s.seq_tail = seq.data();
    s.imm_count = imm.data();
    s.barrier_count = bar.data();
    s.world = world;
    emu.reset(new OrderingEmulator(world, s, [this](uint32_t region, uint64_t off, int64_t v, int) {
      if (region != 0 || off / 8 >= counters.size()) UCCL_THROW("harness: bad atomic target " << region << "/" << off);
      // Record what had been applied on that stream when the atomic ran (checks "in order").
      counters[off / 8] += v;
      log.push_back(v);
    }, seq_bits));
  }
  int world;
  std::vector<unsigned long long> seq, imm, bar;
  std::vector<int64_t> counters;
  std::vector<int64_t> log;
  std::unique_ptr<OrderingEmulator> emu;
};

}  // namespace

void register_proxy(py::module_& m) {
  m.attr("COMMAND_BYTES") = int(sizeof(Command));
  m.attr("MAX_CHANNELS") = kMaxChannels;
  m.attr("OP_WRITE") = int(OP_WRITE);
  m.attr("OP_WRITE_IMM") = int(OP_WRITE_IMM);
  m.attr("OP_ATOMIC_ADD") = int(OP_ATOMIC_ADD);
  m.attr("OP_FLUSH") = int(OP_FLUSH);
  m.attr("OP_BARRIER") = int(OP_BARRIER);
  m.attr("OP_NOP") = int(OP_NOP);
  m.attr("KIND_ARRIVAL") = int(Completion::kArrival);
  m.attr("KIND_ATOMIC") = int(Completion::kAtomic);
  m.attr("KIND_MARKER") = int(Completion::kMarker);

  m.def("make_imm", &make_imm, py::arg("channel"), py::arg("seq"), py::arg("signal") = false);
  m.attr("SEQ_BITS") = kSeqBits;
  m.attr("COMPACT_SEQ_BITS") = kCompactSeqBits;
  m.def("pack_compact_cq_data", &pack_compact_cq_data, py::arg("sender"), py::arg("imm"),
        "the 4-byte remote CQ data the fabric transport sends where the provider carries only 4 bytes");
  m.def("unpack_compact_cq_data", [](uint32_t data) { return py::make_tuple(compact_cq_sender(data), compact_cq_imm(data)); },
        py::arg("data"), "(sender rank, immediate) of 4-byte CQ data");
  m.def("parse_fault", [](const std::string& s) {
    FaultSpec f;
    try {
      f = FaultSpec::parse(s);
    } catch (const std::invalid_argument& e) {
      throw py::value_error(e.what());
    }
    py::dict d;
    d["reorder"] = f.reorder;
    d["delay_us"] = f.delay_us;
    d["seed"] = f.seed;
    d["die_after"] = f.die_after;
    return d;
  });
  m.def("cpus_near_gpu", &cpus_near_gpu, py::arg("gpu"));
  m.def("gpu_place_on_node", &gpu_place_on_node, py::arg("gpu"),
        "(place of the GPU among its NUMA node's GPUs in PCI order, their count); (0, 1) when unknown.");
  m.def("ring_vector_publish_supported", &ring_vector_publish_supported,
        "Whether this host guarantees 16-byte single-copy atomic loads/stores (x86-64 AVX, aarch64 LSE2).");
  m.def("ring_publish_default", []() { return std::string(ring_publish_name(ring_publish_default())); },
        "The ring publish mode used when UCCL_EP_RING_PUBLISH is unset: 'vector' or 'fence'.");
  m.def("ring_tear_check",
        [](long min_changes, double max_seconds) {
          // One thread stores 16-byte slot images with ring_host_store16 (all four words equal, alternating
          // between two values), this one reads the same slot with ring_host_load16 until it saw the value
          // change `min_changes` times (or max_seconds passed): returns (reads, torn reads, changes seen).
          // Zero torn reads is what the vector publish needs.
          long reads = 0, torn = 0, changes = 0;
          {
            py::gil_scoped_release nogil;
            void* mem = nullptr;
            if (posix_memalign(&mem, 64, 64) != 0) UCCL_THROW("ring_tear_check: out of memory");
            uint32_t* slot = static_cast<uint32_t*>(mem);
            for (int i = 0; i < 16; ++i) slot[i] = 0;
            std::atomic<bool> stop{false};
            std::thread writer([&] {
              uint32_t k = 1;
              while (!stop.load(std::memory_order_relaxed)) {
                const uint32_t w[4] = {k, k, k, k};
                ring_host_store16(slot, w);
                k = (k == 0x55555555u) ? 0xaaaaaaaau : 0x55555555u;
              }
            });
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(max_seconds);
            uint32_t prev = 0;
            while (changes < min_changes) {
              for (int i = 0; i < 4096; ++i) {
                uint32_t w[4];
                ring_host_load16(slot, w);
                if (w[0] != w[1] || w[0] != w[2] || w[0] != w[3]) ++torn;
                if (w[0] != prev) ++changes;
                prev = w[0];
              }
              reads += 4096;
              if (std::chrono::steady_clock::now() > deadline) break;
            }
            stop.store(true);
            writer.join();
            std::free(mem);
          }
          return py::make_tuple(reads, torn, changes);
        },
        py::arg("min_changes") = 100000, py::arg("max_seconds") = 5.0);
  m.def("cpu_pickup_latency",
        [](Proxy& p, int ring, int iters) {
          // CPU stand-in for the GPU probe: push OP_NOP(cookie), spin until the proxy echoes it (ns).
          if (p.config().gpu >= 0) throw py::value_error("cpu_pickup_latency: this proxy's rings belong to a GPU");
          py::gil_scoped_release nogil;
          std::vector<uint64_t> out;
          out.reserve(size_t(iters));
          const RingDesc& d = p.ring_host(ring);
          const unsigned long long base = __atomic_load_n(d.echo, __ATOMIC_ACQUIRE);
          for (int i = 0; i < iters; ++i) {
            Command c{};
            c.op = OP_NOP;
            c.length = uint32_t(base + i + 1);
            const auto t0 = std::chrono::steady_clock::now();
            p.push(ring, &c, 1);
            const auto deadline = t0 + std::chrono::seconds(10);
            while (__atomic_load_n(d.echo, __ATOMIC_ACQUIRE) != (unsigned long long)c.length) {
              if (std::chrono::steady_clock::now() > deadline) UCCL_THROW("cpu_pickup_latency: no echo within 10 s");
            }
            out.push_back(uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count()));
          }
          return out;
        },
        py::arg("proxy"), py::arg("ring"), py::arg("iters"));

  py::class_<Proxy>(m, "Proxy", "CPU proxy threads, rings and transport endpoints for one rank")
      .def(py::init([](int rank, int world, int gpu, const std::string& transport, py::object num_threads,
                       uint32_t ring_capacity, py::object provider, bool low_latency, py::object max_inflight,
                       py::object max_inflight_bytes, py::object adaptive_sleep, py::object timeout_s, py::object fault,
                       py::object pin_threads, const std::string& job, py::object ring_publish,
                       const std::vector<std::string>& devices) {
             ProxyConfig c = ProxyConfig::from_env(rank, world, gpu);
             c.transport = transport;
             c.ring_capacity = ring_capacity;
             c.job = job;
             c.low_latency = low_latency;
             if (low_latency) c.max_inflight = int(env_long("UCCL_IB_MAX_INFLIGHT_LOW_LATENCY", 32));
             if (!num_threads.is_none()) c.num_threads = num_threads.cast<int>();
             if (!provider.is_none()) c.provider = provider.cast<std::string>();
             if (!max_inflight.is_none()) c.max_inflight = max_inflight.cast<int>();
             if (!max_inflight_bytes.is_none()) c.max_inflight_bytes = max_inflight_bytes.cast<uint64_t>();
             if (!adaptive_sleep.is_none()) c.adaptive_sleep = adaptive_sleep.cast<bool>();
             // UCCL_EP_TIMEOUT_S has one default, in Python: the deadline every other wait uses too
             c.timeout_s = (timeout_s.is_none() ? py::module_::import("uccl_ep_train.config").attr("timeout_s")()
                                                : timeout_s)
                               .cast<double>();
             UCCL_CHECK(c.timeout_s > 0, "Proxy: timeout_s must be > 0, got " << c.timeout_s);
             if (!fault.is_none()) c.fault = fault.cast<std::string>();
             if (!pin_threads.is_none()) c.pin_threads = pin_threads.cast<bool>();
             if (!ring_publish.is_none()) c.ring_publish = ring_publish.cast<std::string>();
             c.devices = devices;
             return new Proxy(c);
           }),
           py::arg("rank"), py::arg("world"), py::arg("gpu") = -1, py::arg("transport") = "fabric",
           py::arg("num_threads") = py::none(), py::arg("ring_capacity") = 2048, py::arg("provider") = py::none(),
           py::arg("low_latency") = false, py::arg("max_inflight") = py::none(),
           py::arg("max_inflight_bytes") = py::none(), py::arg("adaptive_sleep") = py::none(),
           py::arg("timeout_s") = py::none(), py::arg("fault") = py::none(), py::arg("pin_threads") = py::none(),
           py::arg("job") = "", py::arg("ring_publish") = py::none(),
           py::arg("devices") = std::vector<std::string>())
      .def("register_region", &Proxy::register_region, py::arg("id"), py::arg("ptr"), py::arg("size"),
           py::arg("device") = false)
      .def("local_blob", [](Proxy& p, int t) { return py::bytes(p.local_blob(t)); })
      .def("connect",
           [](Proxy& p, const std::vector<std::vector<py::bytes>>& blobs) {
             std::vector<std::vector<std::string>> b;
             for (const auto& r : blobs) {
               b.emplace_back();
               for (const auto& x : r) b.back().push_back(std::string(x));
             }
             p.connect(b);
           })
      .def("start", &Proxy::start)
      .def("stop", &Proxy::stop, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("running", &Proxy::running)
      .def_property_readonly("num_threads", &Proxy::num_threads)
      .def_property_readonly("rank", [](const Proxy& p) { return p.config().rank; })
      .def_property_readonly("world", [](const Proxy& p) { return p.config().world; })
      .def("config",
           [](const Proxy& p) {
             const ProxyConfig& c = p.config();
             py::dict d;
             d["rank"] = c.rank;
             d["world"] = c.world;
             d["num_threads"] = c.num_threads;
             d["ring_capacity"] = c.ring_capacity;
             d["gpu"] = c.gpu;
             d["transport"] = c.transport;
             d["provider"] = c.provider;
             d["pin_threads"] = c.pin_threads;
             d["low_latency"] = c.low_latency;
             d["max_inflight"] = c.max_inflight;
             d["max_inflight_bytes"] = c.max_inflight_bytes;
             d["adaptive_sleep"] = c.adaptive_sleep;
             d["timeout_s"] = c.timeout_s;
             d["fault"] = p.fault_spec();
             d["ring_publish"] = c.ring_publish;
             d["imm_seq_bits"] = p.imm_seq_bits();
             d["calls_gpu_runtime"] = p.calls_gpu_runtime();
             d["devices"] = c.devices;
             py::list per_thread;  // the NIC each thread was given ("" : the transport's default)
             for (int t = 0; t < p.num_threads(); ++t) per_thread.append(c.device_for(t));
             d["thread_devices"] = per_thread;
             py::list opened;  // what each thread's endpoint opened: {"provider", "device"} ("" : none)
             for (const auto& o : p.opened()) {
               py::dict e;
               e["provider"] = o.first;
               e["device"] = o.second;
               opened.append(e);
             }
             d["opened"] = opened;
             return d;
           })
      .def("push",
           [](Proxy& p, int t, py::buffer buf, bool owned) {
             py::buffer_info info = buf.request();
             const size_t bytes = size_t(info.size) * size_t(info.itemsize);
             if (bytes % sizeof(Command)) throw py::value_error("push: buffer size must be a multiple of 16 bytes");
             const Command* c = static_cast<const Command*>(info.ptr);
             py::gil_scoped_release nogil;
             p.push(t, c, bytes / sizeof(Command), owned);
           },
           py::arg("ring"), py::arg("commands"), py::arg("owned") = false)
      .def("wait_seq", &Proxy::wait_seq, py::arg("src"), py::arg("channel"), py::arg("target"), py::arg("timeout_s"),
           py::arg("phase") = "arrival", py::call_guard<py::gil_scoped_release>())
      .def("wait_flushed", &Proxy::wait_flushed, py::arg("ring"), py::arg("target"), py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>())
      .def("seq_tail", [](const Proxy& p, int src, int ch) {
        if (src < 0 || src >= p.config().world || ch < 0 || ch >= kMaxChannels) throw py::index_error("seq_tail: bad src/channel");
        return load(&p.signals_host().seq_tail[size_t(src) * kMaxChannels + ch]);
      })
      .def("imm_count", [](const Proxy& p, int src, int ch) {
        if (src < 0 || src >= p.config().world || ch < 0 || ch >= kMaxChannels) throw py::index_error("imm_count: bad src/channel");
        return load(&p.signals_host().imm_count[size_t(src) * kMaxChannels + ch]);
      })
      .def("barrier_count", [](const Proxy& p, int src) {
        if (src < 0 || src >= p.config().world) throw py::index_error("barrier_count: bad src");
        return load(&p.signals_host().barrier_count[src]);
      })
      .def("flushed", [](const Proxy& p, int t) { return load(p.ring_host(t).flushed); })
      .def("echo", [](const Proxy& p, int t) { return load(p.ring_host(t).echo); })
      .def("ring_tail", [](const Proxy& p, int t) { return load(p.ring_host(t).tail); })
      .def("ring_desc", [](const Proxy& p, int t, bool device) { return ring_dict(device ? p.ring_device(t) : p.ring_host(t)); },
           py::arg("ring"), py::arg("device") = false)
      .def("signals",
           [](const Proxy& p, bool device) {
             const SignalBlock& s = device ? p.signals_device() : p.signals_host();
             py::dict d;
             d["seq_tail"] = reinterpret_cast<uintptr_t>(s.seq_tail);
             d["imm_count"] = reinterpret_cast<uintptr_t>(s.imm_count);
             d["barrier_count"] = reinterpret_cast<uintptr_t>(s.barrier_count);
             d["max_channels"] = kMaxChannels;
             return d;
           },
           py::arg("device") = false)
      .def("error", &Proxy::error)
      .def("failure_record", &Proxy::failure_record, py::arg("device"),
           "address of the failure record a stopping thread fills (device=True: as the GPU sees it)")
      .def("abort", &Proxy::abort, py::arg("op"), "tell every peer's proxy that this rank aborted call ABORT_OPS[op]")
      .def("failure_code", [](const Proxy& p) { return *reinterpret_cast<const volatile int*>(p.failure_record(false)); })
      .def("stats", [](const Proxy& p) { return stats_dict(p.stats()); })
      .def("thread_cpus", &Proxy::thread_cpus);

  py::class_<OrderingHarness>(m, "OrderingEmulator",
                              "OrderingEmulator with its own signal block and 64 int64 counters as region 0 (tests)")
      .def(py::init<int, uint32_t>(), py::arg("world"), py::arg("seq_bits") = kSeqBits)
      .def("on_arrival",
           [](OrderingHarness& h, int kind, int peer, uint32_t imm, uint32_t region, uint64_t offset, int64_t value) {
             Completion c;
             c.kind = Completion::Kind(kind);
             c.peer = peer;
             c.imm = imm;
             c.region = region;
             c.offset = offset;
             c.value = value;
             h.emu->on_arrival(c);
           },
           py::arg("kind"), py::arg("peer"), py::arg("imm"), py::arg("region") = kNoRegion, py::arg("offset") = 0,
           py::arg("value") = 0)
      .def("seq_tail", [](const OrderingHarness& h, int src, int ch) { return h.seq.at(size_t(src) * kMaxChannels + ch); })
      .def("imm_count", [](const OrderingHarness& h, int src, int ch) { return h.imm.at(size_t(src) * kMaxChannels + ch); })
      .def("barrier_count", [](const OrderingHarness& h, int src) { return h.bar.at(size_t(src)); })
      .def("counter", [](const OrderingHarness& h, int i) { return h.counters.at(size_t(i)); })
      .def_property_readonly("atomic_log", [](const OrderingHarness& h) { return h.log; })
      .def_property_readonly("waiting", [](const OrderingHarness& h) { return h.emu->waiting(); })
      .def_property_readonly("out_of_order", [](const OrderingHarness& h) { return h.emu->out_of_order(); });
}
