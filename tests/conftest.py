import ctypes
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

# keep every process on loopback and off NVLink multicast, whatever the test starts
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("FI_TCP_IFACE", "lo")
os.environ.setdefault("FI_SOCKETS_IFACE", "lo")
# torch.cuda.is_available() / device_count() here (collection, skip marks, the `mps` fixture) ask NVML,
# not cudaGetDeviceCount: that one initialises the CUDA driver, and a process whose driver started before
# the MPS daemon is no MPS client. (Without NVML torch falls back to cudaGetDeviceCount.)
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

MPS_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "mps.sh"
from uccl_ep_train.gpu_sharing import SCRIPT_LOG_DIRECTORY, SCRIPT_PIPE_DIRECTORY  # noqa: E402 (env above first)

MPS_ENV = {"CUDA_MPS_PIPE_DIRECTORY": SCRIPT_PIPE_DIRECTORY, "CUDA_MPS_LOG_DIRECTORY": SCRIPT_LOG_DIRECTORY}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _cuda_initialised() -> bool:
    """Whether this process has initialised the CUDA driver (cuInit), found without initialising it: before
    cuInit every other driver call answers CUDA_ERROR_NOT_INITIALIZED (3). (`import torch` loads libcuda
    but does not initialise it.)"""
    with open("/proc/self/maps") as maps:
        if "libcuda.so" not in maps.read():
            return False
    context = ctypes.c_void_p()
    return ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(context)) != 3


def _mps_script(action: str) -> str:
    done = subprocess.run(["bash", str(MPS_SCRIPT), action], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.fail(f"bash scripts/mps.sh {action} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout


@pytest.fixture(scope="session")
def mps():
    """An NVIDIA MPS control daemon for tests that run several ranks on one GPU; yields its pipe directory.

    Uses a daemon that already answers where CUDA clients look (CUDA_MPS_PIPE_DIRECTORY, or CUDA's default
    /tmp/nvidia-mps, or mps.sh's /tmp/mps-pipe), else starts one with scripts/mps.sh and stops it at the
    end of the session. CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY are set in os.environ so that the
    ranks spawned afterwards inherit them. Nothing here initialises CUDA before the daemon runs (see
    PYTORCH_NVML_BASED_CUDA_CHECK above): contexts created before it starts would not be MPS clients."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA GPUs")
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("needs NVIDIA MPS (nvidia-cuda-mps-control is not on PATH)")
    from uccl_ep_train.gpu_sharing import mps_active, mps_pipe_directory

    saved = {k: os.environ.get(k) for k in MPS_ENV}
    started = False
    if not mps_active():
        for key, value in MPS_ENV.items():
            os.environ.setdefault(key, value)
        if not mps_active():
            if _cuda_initialised():
                warnings.warn("CUDA was initialised in the pytest process before MPS started: this process "
                              "is no MPS client (the ranks it spawns are)")
            _mps_script("start")
            started = True
            if not mps_active():
                pytest.fail(f"scripts/mps.sh started MPS but no daemon answers in {mps_pipe_directory()}")
    try:
        yield mps_pipe_directory()
    finally:
        if started and _cuda_initialised():
            # this process is an MPS client now (a test used CUDA in it): `quit` waits for its clients, so
            # it is sent without waiting, and the daemon exits once this process has
            subprocess.Popen(["bash", str(MPS_SCRIPT), "stop"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        elif started:
            _mps_script("stop")
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
