// Python bindings for the GPU producers (tests, benchmark). Only with CUDA/HIP.
#include "common/portability.h"

#if UCCL_EP_WITH_GPU

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "bindings.h"
#include "common/check.h"
#include "proxy/proxy.h"
#include "proxy/ring_gpu.h"

namespace py = pybind11;
using namespace uccl;

namespace {

// Device copy of a host array, freed on scope exit.
template <typename T>
struct DeviceArray {
  explicit DeviceArray(const std::vector<T>& v) {
    UCCL_CHECK_GPU(gpuMalloc(&p, sizeof(T) * (v.empty() ? 1 : v.size())));
    if (!v.empty()) UCCL_CHECK_GPU(cudaMemcpyCompat(p, v.data(), sizeof(T) * v.size()));
  }
  ~DeviceArray() {
    if (p) gpuFree(p);
  }
  static gpuError_t cudaMemcpyCompat(void* d, const void* s, size_t n) {
#if defined(UCCL_EP_WITH_HIP)
    return hipMemcpy(d, s, n, hipMemcpyHostToDevice);
#else
    return cudaMemcpy(d, s, n, cudaMemcpyHostToDevice);
#endif
  }
  T* get() const { return static_cast<T*>(p); }
  void* p = nullptr;
};

std::vector<RingDesc> device_rings(const Proxy& p) {
  std::vector<RingDesc> v;
  for (int t = 0; t < p.num_threads(); ++t) v.push_back(p.ring_device(t));
  return v;
}

void sync(void* stream) { UCCL_CHECK_GPU(gpuStreamSynchronize(static_cast<gpuStream_t>(stream))); }

std::vector<unsigned long long> copy_back(unsigned long long* d, int n) {
  std::vector<unsigned long long> h(static_cast<size_t>(n), 0ull);
#if defined(UCCL_EP_WITH_HIP)
  UCCL_CHECK_GPU(hipMemcpy(h.data(), d, sizeof(unsigned long long) * n, hipMemcpyDeviceToHost));
#else
  UCCL_CHECK_GPU(cudaMemcpy(h.data(), d, sizeof(unsigned long long) * n, cudaMemcpyDeviceToHost));
#endif
  return h;
}

struct PickupStamps {
  std::vector<unsigned long long> raw;  // 4 words per iteration (ring_gpu.h)
  ClockPair a, b;                       // proxy clock vs steady_clock around the run
  double ticks_per_ns = 1.0;
};

PickupStamps pickup_stamps(Proxy& p, int ring, int iters, int mode) {
  if (mode < 0 || mode >= kPickupModes)
    throw py::value_error("gpu_pickup_latency: mode must be in [0, " + std::to_string(kPickupModes) + ")");
  if (ring < 0 || ring >= p.num_threads()) throw py::value_error("gpu_pickup_latency: ring out of range");
  if (iters < 1) throw py::value_error("gpu_pickup_latency: iters must be >= 1");
  if (!p.running()) throw py::value_error("gpu_pickup_latency: the proxy is not running (the kernel would spin forever)");
  PickupStamps st;
  py::gil_scoped_release nogil;
  UCCL_CHECK_GPU(gpuSetDevice(p.config().gpu));
  DeviceArray<unsigned long long> out(std::vector<unsigned long long>(4 * size_t(iters), 0));
  // Fresh cookies: the first one differs from whatever the echo word holds now.
  const unsigned cookie_base = unsigned(__atomic_load_n(p.ring_host(ring).echo, __ATOMIC_ACQUIRE)) + 1u;
  st.a = ClockPair::now();
  launch_pickup_latency(p.ring_device(ring), iters, cookie_base, out.get(), nullptr, mode);
  sync(nullptr);
  st.b = ClockPair::now();
  st.ticks_per_ns = proxy_clock_ticks_per_ns(st.a, st.b);
  st.raw = copy_back(out.get(), 4 * iters);
  return st;
}

}  // namespace

void register_proxy_gpu(py::module_& m) {
  m.def("gpu_push_commands",
        [](Proxy& p, uint64_t cmds_ptr, const std::vector<int>& offsets, int warps_per_ring, uint64_t stream) {
          if (int(offsets.size()) != p.num_threads() + 1)
            throw py::value_error("gpu_push_commands: offsets needs num_threads + 1 entries");
          if (warps_per_ring < 1 || warps_per_ring > 32) throw py::value_error("gpu_push_commands: warps_per_ring in [1, 32]");
          py::gil_scoped_release nogil;
          UCCL_CHECK_GPU(gpuSetDevice(p.config().gpu));
          DeviceArray<RingDesc> rings(device_rings(p));
          DeviceArray<int> offs(offsets);
          void* s = reinterpret_cast<void*>(stream);
          launch_push_commands(rings.get(), p.num_threads(), reinterpret_cast<const Command*>(cmds_ptr), offs.get(),
                               warps_per_ring, s);
          sync(s);
        },
        py::arg("proxy"), py::arg("cmds_ptr"), py::arg("offsets"), py::arg("warps_per_ring") = 1, py::arg("stream") = 0,
        "A kernel pushes device commands into the proxy's rings (ring r: cmds[offsets[r]:offsets[r+1]]); waits for the kernel.");

  m.def("gpu_bench_nops",
        [](Proxy& p, int warps_per_ring, int per_warp, double timeout_s) {
          py::gil_scoped_release nogil;
          UCCL_CHECK_GPU(gpuSetDevice(p.config().gpu));
          const int T = p.num_threads();
          per_warp = (per_warp + 31) / 32 * 32;
          std::vector<unsigned long long> start(static_cast<size_t>(T), 0ull), target(static_cast<size_t>(T), 0ull);
          for (int t = 0; t < T; ++t) {
            start[t] = __atomic_load_n(p.ring_host(t).tail, __ATOMIC_ACQUIRE);
            target[t] = start[t] + (unsigned long long)warps_per_ring * per_warp;
          }
          DeviceArray<RingDesc> rings(device_rings(p));
          gpuStream_t s;
          UCCL_CHECK_GPU(gpuStreamCreateWithFlags(&s, gpuStreamNonBlocking));
          const auto t0 = std::chrono::steady_clock::now();
          launch_push_nops(rings.get(), T, warps_per_ring, per_warp, s);
          const auto deadline = t0 + std::chrono::duration<double>(timeout_s);
          for (int t = 0; t < T; ++t)
            while (__atomic_load_n(p.ring_host(t).tail, __ATOMIC_ACQUIRE) < target[t]) {
              if (std::chrono::steady_clock::now() > deadline) {
                gpuStreamDestroy(s);
                UCCL_THROW("gpu_bench_nops: ring " << t << " drained " << (__atomic_load_n(p.ring_host(t).tail, __ATOMIC_ACQUIRE) - start[t])
                           << " of " << (target[t] - start[t]) << " commands before the timeout");
              }
            }
          const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          sync(s);
          gpuStreamDestroy(s);
          return sec;
        },
        py::arg("proxy"), py::arg("warps_per_ring"), py::arg("per_warp"), py::arg("timeout_s") = 60.0,
        "NOP flood from GPU warps; returns seconds from launch until every ring's tail reached the total.");

  m.def("gpu_pickup_latency",
        [](Proxy& p, int ring, int iters, int mode) {
          auto st = pickup_stamps(p, ring, iters, mode);
          std::vector<unsigned long long> rtt(static_cast<size_t>(iters));
          for (int i = 0; i < iters; ++i) rtt[i] = st.raw[4 * size_t(i) + 2] - st.raw[4 * size_t(i)];
          return rtt;
        },
        py::arg("proxy"), py::arg("ring"), py::arg("iters"), py::arg("mode") = 0,
        "GPU->CPU->GPU round trips (ns): push a NOP, wait for the proxy's echo (mode: see ring_gpu.h).");

  m.def("gpu_pickup_stamps",
        [](Proxy& p, int ring, int iters, int mode) {
          auto st = pickup_stamps(p, ring, iters, mode);
          const size_t n = static_cast<size_t>(iters);
          std::vector<long long> start(n), publish(n), seen(n), pickup(n);
          for (int i = 0; i < iters; ++i) {
            const unsigned long long* w = &st.raw[4 * size_t(i)];
            start[i] = (long long)w[0];
            publish[i] = (long long)w[1];
            seen[i] = (long long)w[2];
            // proxy ticks -> steady_clock ns, with the rate measured over this run
            pickup[i] = st.a.ns + (long long)std::llround(double((long long)(w[3] - st.a.ticks)) / st.ticks_per_ns);
          }
          py::dict d;
          d["start_ns"] = start;
          d["publish_ns"] = publish;
          d["seen_ns"] = seen;
          d["pickup_ns"] = pickup;
          d["ticks_per_ns"] = st.ticks_per_ns;
          d["mode"] = mode;
          return d;
        },
        py::arg("proxy"), py::arg("ring"), py::arg("iters"), py::arg("mode") = 0,
        "Per-iteration stamps of the pickup probe: start/publish/seen (GPU globaltimer ns) and pickup (proxy "
        "clock, converted to steady_clock ns). The two clocks have an unknown offset: calibrate it "
        "(uccl_ep_train.apps.bench.proxy.one_way_pickup).");

  m.def("gpu_timer_resolution",
        [](int gpu, int reads) {
          py::gil_scoped_release nogil;
          UCCL_CHECK_GPU(gpuSetDevice(gpu));
          DeviceArray<unsigned long long> out(std::vector<unsigned long long>(3, 0));
          launch_timer_resolution(reads, out.get(), nullptr);
          sync(nullptr);
          auto h = copy_back(out.get(), 3);
          return std::vector<unsigned long long>(h.begin(), h.end());
        },
        py::arg("gpu"), py::arg("reads") = 4096,
        "globaltimer granularity on `gpu`: [smallest step ns, steps seen, span ns] over `reads` reads.");

  m.def("gpu_visibility_latency",
        [](Proxy& p, int ring, int region, uint32_t bytes, uint32_t local_off, uint32_t remote_off, int iters) {
          py::gil_scoped_release nogil;
          UCCL_CHECK_GPU(gpuSetDevice(p.config().gpu));
          const int rank = p.config().rank;
          Command c{};
          c.op = OP_WRITE_IMM;
          c.dst_rank = uint8_t(rank);
          c.channel = uint8_t(ring);
          c.region = uint8_t(region);
          c.length = bytes;
          c.local_off = local_off;
          c.remote_off = remote_off;
          const unsigned long long* counter = p.signals_device().imm_count + size_t(rank) * kMaxChannels + ring;
          DeviceArray<unsigned long long> out(std::vector<unsigned long long>(size_t(iters), 0));
          launch_visibility_latency(p.ring_device(ring), c, counter, iters, out.get(), nullptr);
          sync(nullptr);
          return copy_back(out.get(), iters);
        },
        py::arg("proxy"), py::arg("ring"), py::arg("region"), py::arg("bytes"), py::arg("local_off") = 0,
        py::arg("remote_off") = 0, py::arg("iters") = 1000,
        "GPU push of a signalled write to this rank -> proxy -> transport -> in-order arrival visible to the GPU (ns).");
}

#endif
