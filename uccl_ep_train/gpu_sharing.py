"""Several ranks on one GPU (emulated nodes): is NVIDIA MPS running, how many ranks share a GPU, and the
check that refuses such runs without MPS.

Why: the communication kernels spin on flags that other ranks' kernels raise. Ranks sharing a GPU without
MPS are time-sliced by the driver: two spinning kernels of two processes hand over in ~5 ms, against
~2-3 us with MPS, where they run side by side. Such runs crawl or time out, so `check_gpu_sharing` stops
them up front, on every rank, with an error that says to start MPS (`bash scripts/mps.sh start`).
`UCCL_EP_ALLOW_SHARED_GPU=1` (on every rank) skips the error: for debugging only.

Which device a Buffer's tensors live on (`group_device`): NCCL groups use the current CUDA device; gloo
groups use the CPU unless `UCCL_EP_DEVICE=cuda` says to keep the tensors on the current CUDA device, as
ranks sharing a GPU must (NCCL refuses two ranks on one GPU, so they talk over gloo).
"""
from __future__ import annotations

import errno
import os
import socket
import stat
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # where CUDA clients look when CUDA_MPS_PIPE_DIRECTORY is unset
# scripts/mps.sh's directories (its defaults), where the commands that start a daemon themselves put it too
SCRIPT_PIPE_DIRECTORY = "/tmp/mps-pipe"
SCRIPT_LOG_DIRECTORY = "/tmp/mps-log"
ALLOW_SHARED_GPU_ENV = "UCCL_EP_ALLOW_SHARED_GPU"
DEVICE_ENV = "UCCL_EP_DEVICE"


def mps_pipe_directory() -> str:
    """The directory where this process's CUDA driver looks for the MPS control daemon."""
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY


def mps_active(pipe_directory: Optional[str] = None) -> bool:
    """True when an MPS control daemon answers in `pipe_directory` (default: `mps_pipe_directory()`), i.e.
    when a CUDA context this process creates from now on becomes an MPS client.

    The daemon listens on the `control` socket there (a named pipe with older drivers); a stale one stays
    behind after `quit`. So this connects and hangs up at once, sending nothing: no command reaches the
    daemon and no CUDA call is made. A context created before the daemon started is not a client."""
    control = os.path.join(pipe_directory or mps_pipe_directory(), "control")
    try:
        mode = os.stat(control).st_mode
    except OSError:
        return False
    if stat.S_ISSOCK(mode):
        for kind in (socket.SOCK_SEQPACKET, socket.SOCK_STREAM):  # the daemon's socket type varies
            with socket.socket(socket.AF_UNIX, kind) as s:
                s.settimeout(1.0)  # a listener with a full backlog must not hang the caller
                try:
                    s.connect(control)
                    return True
                except OSError as exc:
                    if exc.errno != errno.EPROTOTYPE:
                        return False
        return False
    if stat.S_ISFIFO(mode):  # opening a FIFO for writing without blocking fails (ENXIO) unless a reader has it
        try:
            os.close(os.open(control, os.O_WRONLY | os.O_NONBLOCK))
            return True
        except OSError:
            return False
    return False


class RankGpu(NamedTuple):
    """What one rank reports to the sharing check."""
    host: str
    gpu: Optional[str]  # the GPU's UUID; None for a rank without a CUDA device
    mps: bool           # mps_active() on that rank
    allow: bool         # UCCL_EP_ALLOW_SHARED_GPU=1 on that rank
    eager: bool = True  # CUDA_MODULE_LOADING=EAGER on that rank (see sharing_verdict)


def gpu_uuid(device: torch.device) -> Optional[str]:
    """The UUID of `device`'s physical GPU (the same for every process using it); None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def loads_modules_eagerly() -> bool:
    """Whether this process loads its CUDA modules at start (CUDA_MODULE_LOADING=EAGER) rather than at each
    kernel's first launch, which waits for the kernels running then (sharing_verdict; proxy.py's warning)."""
    return os.environ.get("CUDA_MODULE_LOADING", "").upper() == "EAGER"


def local_report(device: torch.device) -> RankGpu:
    """This rank's RankGpu for `device`."""
    return RankGpu(socket.gethostname(), gpu_uuid(device), mps_active(),
                   os.environ.get(ALLOW_SHARED_GPU_ENV) == "1", loads_modules_eagerly())


def gather_reports(group: Any, device: torch.device) -> list[RankGpu]:
    """Every rank's RankGpu, by rank of `group` (a collective: every rank of the group must call it)."""
    mine = local_report(device)
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return [mine]
    out: list = [None] * size
    dist.all_gather_object(out, tuple(mine), group=group)
    return [RankGpu(*r) for r in out]


def ranks_by_gpu(reports: Sequence[RankGpu]) -> dict[tuple[str, str], list[int]]:
    """{(host, GPU UUID): the ranks using that GPU}; ranks without a CUDA device are left out."""
    by_gpu: dict[tuple[str, str], list[int]] = {}
    for rank, r in enumerate(reports):
        if r.gpu is not None:
            by_gpu.setdefault((r.host, r.gpu), []).append(rank)
    return by_gpu


def sharing_verdict(reports: Sequence[RankGpu], what: str) -> tuple[int, Optional[str]]:
    """The pure decision behind `check_gpu_sharing`: (largest number of ranks on one GPU, error or None).

    Ranks share a GPU when they report the same (host, GPU UUID). The error names each shared GPU whose
    ranks do not all see MPS running, unless every rank set UCCL_EP_ALLOW_SHARED_GPU=1. Ranks sharing a GPU
    must also load their CUDA modules eagerly (CUDA_MODULE_LOADING=EAGER, set before CUDA starts): under MPS
    the ranks' kernels run in one server context, and a kernel loaded lazily while another rank's kernel
    spins waiting for this rank waits for that kernel to finish -- measured on one H100: the second op of
    two ranks hung until the timeout, with EAGER it passed. Every rank gets the same reports, hence the same
    verdict."""
    by_gpu = ranks_by_gpu(reports)
    per_gpu = max((len(ranks) for ranks in by_gpu.values()), default=1)
    if all(r.allow for r in reports):
        return per_gpu, None
    unserved = [(key, ranks) for key, ranks in by_gpu.items()
                if len(ranks) > 1 and not all(reports[r].mps for r in ranks)]
    lazy = sorted(r for ranks in by_gpu.values() if len(ranks) > 1 for r in ranks if not reports[r].eager)
    if not unserved and lazy:
        return per_gpu, (
            f"{what}: ranks {lazy} share a GPU with other ranks but load CUDA modules lazily; set "
            f"CUDA_MODULE_LOADING=EAGER in their environment before CUDA starts (a kernel loaded lazily while "
            f"another rank's kernel spins on this one would wait for it forever). {ALLOW_SHARED_GPU_ENV}=1 on "
            f"every rank skips this check (debugging only).")
    if not unserved:
        return per_gpu, None
    shared = "; ".join(f"ranks {ranks} share GPU {gpu} on {host} (MPS not running for ranks "
                       f"{[r for r in ranks if not reports[r].mps]})" for (host, gpu), ranks in unserved)
    return per_gpu, (
        f"{what}: {shared}. Without NVIDIA MPS the driver time-slices the ranks' spinning kernels (~5 ms "
        f"per hand-over instead of ~2-3 us), so the run would crawl or time out. Start MPS before launching "
        f"the ranks: `bash scripts/mps.sh start`, then export the CUDA_MPS_PIPE_DIRECTORY / "
        f"CUDA_MPS_LOG_DIRECTORY it prints in every rank's environment. {ALLOW_SHARED_GPU_ENV}=1 on every "
        f"rank skips this check (debugging only).")


def check_gpu_sharing(group: Any, device: torch.device, what: str) -> int:
    """Collective over `group`: raises RuntimeError on every rank when ranks share a GPU without MPS
    (see `sharing_verdict`; `what` names the caller in the message). Call it before any communication
    kernel runs. Returns the largest number of ranks sharing one GPU (1: none share), by which a backend
    divides the SMs it takes."""
    per_gpu, error = sharing_verdict(gather_reports(group, device), what)
    if error:
        raise RuntimeError(error)
    return per_gpu


def ranks_per_gpu(group: Any, device: torch.device) -> int:
    """Collective over `group`: the largest number of its ranks that use one physical GPU (1 off CUDA)."""
    return sharing_verdict(gather_reports(group, device), "ranks_per_gpu")[0]


def group_device(group: Any) -> torch.device:
    """The device a communication buffer over `group` keeps its tensors on: the current CUDA device for
    NCCL groups; for other (gloo) groups the CPU, unless UCCL_EP_DEVICE=cuda asks for the current CUDA
    device (several ranks on one GPU talk over gloo). UCCL_EP_DEVICE is `cpu` or `cuda` when set."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend or "cuda" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    choice = os.environ.get(DEVICE_ENV, "cpu").lower()
    if choice == "cpu":
        return torch.device("cpu")
    if choice != "cuda":
        raise ValueError(f"{DEVICE_ENV} must be 'cpu' or 'cuda', got {choice!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"{DEVICE_ENV}=cuda but CUDA is not available in this process")
    return torch.device("cuda", torch.cuda.current_device())


def ranks_per_gpu_on_host(local_ranks: int, gpus: int) -> int:
    """How many of a host's `local_ranks` ranks share each of its `gpus` GPUs (consecutive ranks share one:
    rank r uses GPU r // ranks_per_gpu_on_host); 0 without GPUs, 1 when every rank has a GPU of its own."""
    if gpus < 1:
        return 0
    return max(1, -(-local_ranks // gpus))


def comm_sms_share(sms: int, per_gpu: int) -> int:
    """The most SMs one rank's high-throughput kernels may occupy when `per_gpu` ranks share a GPU of `sms`
    SMs (all of them when it has the GPU to itself).

    The ranks' kernels wait for each other, so every rank's blocks must be resident together, while the other
    ranks' model kernels (GEMMs, norms) take SMs of their own meanwhile. An even split leaves them nothing:
    measured on one H200 (132 SMs) under MPS, `train --ranks 4` with 32 SMs per rank (4 x 32 = 128) hung in the
    first step's combine ("signal -1 < 32": a peer's kernel never started), with 16 or 8 it trained. So each
    rank takes half of its even share."""
    if per_gpu <= 1:
        return sms
    return max(1, sms // (2 * per_gpu))


def shared_gpu_env(per_gpu: int) -> dict[str, str]:
    """What ranks sharing a GPU need in their environment before CUDA starts: CUDA tensors in the Buffers over
    a gloo group, and eager module loading (`sharing_verdict` says why); nothing otherwise."""
    if per_gpu <= 1:
        return {}
    return {DEVICE_ENV: "cuda", "CUDA_MODULE_LOADING": "EAGER"}
