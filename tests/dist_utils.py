"""Spawn N ranks (gloo on CPU, NCCL on GPUs, or gloo with CUDA tensors for several ranks per GPU) running
one function, through the launcher the commands use (uccl_ep_train.apps.launch); failures come back with
tracebacks."""
from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from uccl_ep_train.apps.launch import spawn


def _gpu_of(rank: int, world: int, ranks_per_gpu: int | None, backend: str) -> int:
    """The GPU rank `rank` uses: rank // ranks_per_gpu when given, else rank % the GPUs present."""
    count = torch.cuda.device_count()
    gpu = rank // ranks_per_gpu if ranks_per_gpu else rank % max(count, 1)
    if gpu >= count:
        raise RuntimeError(f"rank {rank} of {world} needs GPU {gpu} ({ranks_per_gpu} ranks per GPU) but this "
                           f"machine has {count}")
    shared = ranks_per_gpu > 1 if ranks_per_gpu else world > count
    if shared and backend == "nccl":
        raise RuntimeError(f"NCCL refuses several ranks on one GPU ({world} ranks, {count} GPUs): "
                           "run_ranks(..., backend='gloo')")
    return gpu


def _rank(rank: int, world: int, device: str, backend: str, ranks_per_gpu: int | None, fn: Callable,
          args: tuple) -> Any:
    """A test rank: its GPU, then its env:// group (the launcher tears it down), then fn."""
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(_gpu_of(rank, world, ranks_per_gpu, backend))
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    return fn(rank, world, device, *args)


def run_ranks(fn: Callable, world: int, *args: Any, device: str = "cpu", timeout: float = 240,
              env: dict | None = None, hard_exit: bool = False, backend: str | None = None,
              ranks_per_gpu: int | None = None) -> list[Any]:
    """Run fn(rank, world, device, *args) on `world` spawned ranks; returns per-rank results.

    device "cpu": gloo. device "cuda": each rank selects its GPU (torch.cuda.set_device) before the
    group starts: rank // ranks_per_gpu when given, else rank % the GPUs present. backend: default NCCL
    for "cuda", gloo for "cpu"; backend="gloo" with device="cuda" runs several ranks on one GPU (NCCL
    refuses that) with CUDA tensors in the ranks (UCCL_EP_DEVICE=cuda is set for them), which must then
    run under MPS (the `mps` fixture).
    hard_exit: ranks leave without destroying the process group (for tests that break it)."""
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend not in ("gloo", "nccl") or (backend == "nccl" and device != "cuda"):
        raise ValueError(f"run_ranks: backend {backend!r} with device {device!r}")
    base_env = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                "OMP_NUM_THREADS": "1"}
    if device == "cuda" and backend == "gloo":  # Buffers keep CUDA tensors over the gloo group; ranks that
        base_env["UCCL_EP_DEVICE"] = "cuda"     # share a GPU load modules eagerly (gpu_sharing.sharing_verdict)
        base_env["CUDA_MODULE_LOADING"] = "EAGER"
    base_env.update(env or {})
    return spawn(_rank, world, device, backend, ranks_per_gpu, fn, args, env=base_env, timeout=timeout,
                 exit_at_once=hard_exit)


def gpu_ranks(world: int) -> dict:
    """run_ranks keywords for `world` ranks on the GPUs present: one per GPU when there are enough (NCCL), else
    several per GPU over gloo (the test then holds the `mps` fixture)."""
    count = torch.cuda.device_count()
    if count >= world:
        return {"device": "cuda"}
    return {"device": "cuda", "backend": "gloo", "ranks_per_gpu": -(-world // count)}


@contextlib.contextmanager
def env_set(**values: "str | None") -> Iterator[None]:
    """os.environ with `values` set (an empty value or None unsets), restored after (Buffers read it when made)."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v:
            os.environ[k] = v
        else:
            os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
