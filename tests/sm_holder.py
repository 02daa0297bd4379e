"""A kernel that holds SMs until the host releases it: another stream's long kernel (an NCCL collective, the
shared-expert GEMM) taking the SMs a communication kernel's later blocks would use.

Each holder block takes a whole SM (the most dynamic shared memory a block may have), writes "started" into
pinned host memory and spins until the host writes "release" (or its own deadline passes). Built with nvcc
into a cubin and launched through the CUDA driver API (ctypes), so the tests need no extension build."""
from __future__ import annotations

import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

_SOURCE = r"""
extern "C" __global__ void hold(volatile int* release, volatile int* started, long long max_cycles) {
  extern __shared__ int smem[];
  if (threadIdx.x == 0) {
    started[blockIdx.x] = 1;
    __threadfence_system();
    const long long t0 = clock64();
    while (release[0] == 0 && clock64() - t0 < max_cycles) {
    }
    smem[0] = 0;
  }
  __syncthreads();
}
"""
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_SHARED_OPTIN = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
_CLOCK_KHZ = 13  # CU_DEVICE_ATTRIBUTE_CLOCK_RATE


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUDA driver error {rc}")


class SmHolder:
    """Holds up to `max_blocks` SMs of the current device on `stream` (one block per SM)."""

    def __init__(self, max_blocks: int, seconds: float = 60.0):
        from native_build import find_gpu_compiler  # the build's own lookup (NVCC, PATH, CUDA_HOME)

        kind, nvcc = find_gpu_compiler()
        if kind != "cuda":
            raise RuntimeError(f"SmHolder needs nvcc (CUDA), found {kind or 'no GPU compiler'}")
        major, minor = torch.cuda.get_device_capability()
        with tempfile.TemporaryDirectory() as tmp:
            src, cubin = Path(tmp) / "hold.cu", Path(tmp) / "hold.cubin"
            src.write_text(_SOURCE)
            subprocess.run([nvcc, "-cubin", f"-arch=sm_{major}{minor}", "-o", str(cubin), str(src)], check=True,
                           capture_output=True, timeout=120)
            image = cubin.read_bytes()
        torch.cuda.synchronize()  # the primary context is current on this thread
        self._cuda = ctypes.CDLL("libcuda.so.1")
        self._module = ctypes.c_void_p()
        _check(self._cuda.cuModuleLoadData(ctypes.byref(self._module), image), "cuModuleLoadData")
        self._fn = ctypes.c_void_p()
        _check(self._cuda.cuModuleGetFunction(ctypes.byref(self._fn), self._module, b"hold"), "cuModuleGetFunction")
        self._smem = self._attribute(_SHARED_OPTIN)
        _check(self._cuda.cuFuncSetAttribute(self._fn, _MAX_DYNAMIC_SHARED, self._smem), "cuFuncSetAttribute")
        self._cycles = int(seconds * self._attribute(_CLOCK_KHZ) * 1e3)
        self.release = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.started = torch.zeros(max_blocks, dtype=torch.int32, pin_memory=True)
        self.stream = torch.cuda.Stream()

    def _attribute(self, which: int) -> int:
        value = ctypes.c_int()
        _check(self._cuda.cuDeviceGetAttribute(ctypes.byref(value), which, torch.cuda.current_device()),
               "cuDeviceGetAttribute")
        return value.value

    def start(self, blocks: int) -> None:
        """Launches `blocks` holder blocks (returns at once; `running()` counts the resident ones)."""
        assert blocks <= self.started.numel()
        self.release.zero_()
        self.started.zero_()
        args = [ctypes.c_void_p(self.release.data_ptr()), ctypes.c_void_p(self.started.data_ptr()),
                ctypes.c_longlong(self._cycles)]
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        _check(self._cuda.cuLaunchKernel(self._fn, blocks, 1, 1, 32, 1, 1, self._smem,
                                         ctypes.c_void_p(self.stream.cuda_stream), params, None), "cuLaunchKernel")

    def running(self) -> int:
        return int(self.started.sum())

    def wait_running(self, blocks: int, seconds: float = 10.0) -> None:
        deadline = time.monotonic() + seconds
        while self.running() < blocks:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {self.running()} of {blocks} holder blocks became resident")
            time.sleep(0.001)

    def stop(self) -> None:
        self.release.fill_(1)
        self.stream.synchronize()

    def resident_capacity(self, blocks: int) -> int:
        """How many SMs this process can hold at once (under MPS with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, its
        share): launches `blocks`, counts the resident ones after a pause, releases them."""
        self.start(blocks)
        time.sleep(0.5)
        n = self.running()
        self.stop()
        return n
