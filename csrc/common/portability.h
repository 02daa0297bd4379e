// Portability: one set of macros so the shared headers compile as CUDA, HIP or plain C++.
//
//   UCCL_EP_WITH_CUDA / UCCL_EP_WITH_HIP   set by native_build.py when a GPU toolchain is present
//   UCCL_HOST_DEVICE                       __host__ __device__ under a GPU compiler, empty otherwise
//   UCCL_DEVICE_CODE                       1 while compiling device code (nvcc/hipcc device pass)
//   gpu*                                   runtime API aliases (gpuMemcpyAsync = cuda/hipMemcpyAsync, ...)
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define UCCL_HOST_DEVICE __host__ __device__
#define UCCL_FORCEINLINE __forceinline__
#else
#define UCCL_HOST_DEVICE
#define UCCL_FORCEINLINE inline __attribute__((always_inline))
#endif

// Lanes that execute in lockstep and vote together: a CUDA warp, an AMD CDNA wavefront.
#if defined(UCCL_EP_WITH_HIP) || defined(__HIP_PLATFORM_AMD__)
#define UCCL_WARP_SIZE 64
#else
#define UCCL_WARP_SIZE 32
#endif

#if (defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__))
#define UCCL_DEVICE_CODE 1
#else
#define UCCL_DEVICE_CODE 0
#endif

#if defined(UCCL_EP_WITH_HIP)
#include <hip/hip_runtime.h>
#define UCCL_EP_WITH_GPU 1
#define gpuError_t hipError_t
#define gpuSuccess hipSuccess
#define gpuGetErrorString hipGetErrorString
#define gpuStream_t hipStream_t
#define gpuEvent_t hipEvent_t
#define gpuIpcMemHandle_t hipIpcMemHandle_t
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuMemcpyDefault hipMemcpyDefault
#define gpuMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define gpuMemcpyDeviceToHost hipMemcpyDeviceToHost
#define gpuDeviceSynchronize hipDeviceSynchronize
#define gpuFuncAttributes hipFuncAttributes
#define gpuFuncGetAttributes hipFuncGetAttributes
#define gpuStreamCreateWithFlags hipStreamCreateWithFlags
#define gpuStreamNonBlocking hipStreamNonBlocking
#define gpuStreamDestroy hipStreamDestroy
#define gpuStreamSynchronize hipStreamSynchronize
#define gpuStreamQuery hipStreamQuery
#define gpuEventCreateWithFlags hipEventCreateWithFlags
#define gpuEventDisableTiming hipEventDisableTiming
#define gpuEventRecord hipEventRecord
#define gpuEventQuery hipEventQuery
#define gpuEventSynchronize hipEventSynchronize
#define gpuEventDestroy hipEventDestroy
#define gpuErrorNotReady hipErrorNotReady
#define gpuSetDevice hipSetDevice
#define gpuGetDevice hipGetDevice
#define gpuGetDeviceCount hipGetDeviceCount
#define gpuHostAlloc hipHostMalloc
#define gpuHostAllocMapped hipHostMallocMapped
#define gpuHostAllocPortable hipHostMallocPortable
#define gpuHostGetDevicePointer hipHostGetDevicePointer
#define gpuFreeHost hipHostFree
#define gpuMalloc hipMalloc
#define gpuFree hipFree
#define gpuMemset hipMemset
#define gpuMemsetAsync hipMemsetAsync
#define gpuIpcGetMemHandle hipIpcGetMemHandle
#define gpuIpcOpenMemHandle hipIpcOpenMemHandle
#define gpuIpcCloseMemHandle hipIpcCloseMemHandle
#define gpuIpcMemLazyEnablePeerAccess hipIpcMemLazyEnablePeerAccess
#define gpuDeviceGetPCIBusId hipDeviceGetPCIBusId
#define gpuGetLastError hipGetLastError
#define gpuPointerGetAttributes hipPointerGetAttributes
#define gpuPointerAttributes hipPointerAttribute_t
#elif defined(UCCL_EP_WITH_CUDA)
#include <cuda_runtime.h>
#define UCCL_EP_WITH_GPU 1
#define gpuError_t cudaError_t
#define gpuSuccess cudaSuccess
#define gpuGetErrorString cudaGetErrorString
#define gpuStream_t cudaStream_t
#define gpuEvent_t cudaEvent_t
#define gpuIpcMemHandle_t cudaIpcMemHandle_t
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuMemcpyDefault cudaMemcpyDefault
#define gpuMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define gpuMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define gpuDeviceSynchronize cudaDeviceSynchronize
#define gpuFuncAttributes cudaFuncAttributes
#define gpuFuncGetAttributes cudaFuncGetAttributes
#define gpuStreamCreateWithFlags cudaStreamCreateWithFlags
#define gpuStreamNonBlocking cudaStreamNonBlocking
#define gpuStreamDestroy cudaStreamDestroy
#define gpuStreamSynchronize cudaStreamSynchronize
#define gpuStreamQuery cudaStreamQuery
#define gpuEventCreateWithFlags cudaEventCreateWithFlags
#define gpuEventDisableTiming cudaEventDisableTiming
#define gpuEventRecord cudaEventRecord
#define gpuEventQuery cudaEventQuery
#define gpuEventSynchronize cudaEventSynchronize
#define gpuEventDestroy cudaEventDestroy
#define gpuErrorNotReady cudaErrorNotReady
#define gpuSetDevice cudaSetDevice
#define gpuGetDevice cudaGetDevice
#define gpuGetDeviceCount cudaGetDeviceCount
#define gpuHostAlloc cudaHostAlloc
#define gpuHostAllocMapped cudaHostAllocMapped
#define gpuHostAllocPortable cudaHostAllocPortable
#define gpuHostGetDevicePointer cudaHostGetDevicePointer
#define gpuFreeHost cudaFreeHost
#define gpuMalloc cudaMalloc
#define gpuFree cudaFree
#define gpuMemset cudaMemset
#define gpuMemsetAsync cudaMemsetAsync
#define gpuIpcGetMemHandle cudaIpcGetMemHandle
#define gpuIpcOpenMemHandle cudaIpcOpenMemHandle
#define gpuIpcCloseMemHandle cudaIpcCloseMemHandle
#define gpuIpcMemLazyEnablePeerAccess cudaIpcMemLazyEnablePeerAccess
#define gpuDeviceGetPCIBusId cudaDeviceGetPCIBusId
#define gpuGetLastError cudaGetLastError
#define gpuPointerGetAttributes cudaPointerGetAttributes
#define gpuPointerAttributes cudaPointerAttributes
#else
#define UCCL_EP_WITH_GPU 0
#endif

// CPU spin hint.
static inline void uccl_cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}
