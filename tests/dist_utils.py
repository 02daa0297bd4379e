"""Spawn N ranks (gloo on CPU, NCCL on GPUs, or gloo with CUDA tensors for several ranks per GPU) running
one function; failures come back with tracebacks."""
from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from uccl_ep_train.apps.launch import free_loopback_port


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


def _worker(rank: int, world: int, port: int, device: str, backend: str, ranks_per_gpu: int | None,
            fn: Callable, args: tuple, env: dict, q, hard_exit: bool) -> None:
    os.environ.update(env)
    try:
        torch.set_num_threads(1)
        if device == "cuda":
            torch.cuda.set_device(_gpu_of(rank, world, ranks_per_gpu, backend))
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        result = fn(rank, world, device, *args)
        q.put((rank, "ok", result))
        if hard_exit:  # the group may be broken on purpose: skip the teardown collective
            q.close()
            q.join_thread()
            os._exit(0)
    except BaseException:  # report every failure, including assertion errors
        q.put((rank, "error", traceback.format_exc()))
        q.close()
        q.join_thread()  # flush before the hard exit
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


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
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_loopback_port()
    base_env = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "NCCL_NVLS_ENABLE": "0",
                "NVSHMEM_DISABLE_NVLS": "1", "OMP_NUM_THREADS": "1"}
    if device == "cuda" and backend == "gloo":  # Buffers keep CUDA tensors over the gloo group; ranks that
        base_env["UCCL_EP_DEVICE"] = "cuda"     # share a GPU load modules eagerly (gpu_sharing.sharing_verdict)
        base_env["CUDA_MODULE_LOADING"] = "EAGER"
    base_env.update(env or {})
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world, port, device, backend, ranks_per_gpu, fn, args, base_env, q, hard_exit))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import queue as _queue
    import time
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world and time.monotonic() < deadline:
        try:
            rank, status, payload = q.get(timeout=1)
        except _queue.Empty:
            if all(not p.is_alive() for p in procs) and q.empty():
                break
            continue
        if status == "ok":
            results[rank] = payload
        else:
            errors.append(f"--- rank {rank} ---\n{payload}")
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    if len(results) < world:
        raise AssertionError(f"only ranks {sorted(results)} of {world} finished within {timeout}s")
    return [results[r] for r in range(world)]


def gpu_ranks(world: int) -> dict:
    """run_ranks keywords for `world` ranks on the GPUs present: one per GPU when there are enough (NCCL), else
    several per GPU over gloo (the test then holds the `mps` fixture)."""
    count = torch.cuda.device_count()
    if count >= world:
        return {"device": "cuda"}
    return {"device": "cuda", "backend": "gloo", "ranks_per_gpu": -(-world // count)}
