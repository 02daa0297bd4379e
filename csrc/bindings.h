// The pybind11 module `uccl_ep_train._native`: each subsystem registers its own functions.
//
//   register_proxy      csrc/proxy/proxy_bindings.cpp       rings, proxies, ordering emulator, fault spec
//   register_transport  csrc/transport/transport_bindings.cpp  compiled transports, RDMA device queries
//   register_proxy_gpu  csrc/proxy/proxy_gpu_bindings.cpp    GPU producer kernels for tests/benchmarks (CUDA/HIP)
//   register_intranode  csrc/kernels/bindings_intranode.cpp  intranode NVLink buffer and kernels (CUDA/HIP)
//   register_permute    csrc/kernels/bindings_permute.cpp    expert-major expand / reduce kernels (CUDA/HIP)
//   register_internode  csrc/kernels/bindings_internode.cpp  internode buffers and kernels (CUDA/HIP)
//   register_low_latency csrc/kernels/bindings_low_latency.cpp low-latency buffers and kernels (CUDA/HIP)
//
// Optional registrars are weak symbols: a subsystem that is not compiled in simply is not called.
#pragma once

#include <pybind11/pybind11.h>

void register_proxy(pybind11::module_& m);
void register_transport(pybind11::module_& m);
__attribute__((weak)) void register_proxy_gpu(pybind11::module_& m);
__attribute__((weak)) void register_intranode(pybind11::module_& m);
__attribute__((weak)) void register_permute(pybind11::module_& m);
__attribute__((weak)) void register_internode(pybind11::module_& m);
__attribute__((weak)) void register_low_latency(pybind11::module_& m);
