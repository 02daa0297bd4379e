"""Spawn N ranks (gloo on CPU, NCCL on GPUs) running one function; failures come back with tracebacks."""
from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from uccl_ep_train.localhost import free_loopback_port


def _worker(rank: int, world: int, port: int, device: str, fn: Callable, args: tuple, env: dict, q,
            hard_exit: bool) -> None:
    os.environ.update(env)
    try:
        torch.set_num_threads(1)
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(rank)
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
              env: dict | None = None, hard_exit: bool = False) -> list[Any]:
    """Run fn(rank, world, device, *args) on `world` spawned ranks; returns per-rank results.
    hard_exit: ranks leave without destroying the process group (for tests that break it)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_loopback_port()
    base_env = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "NCCL_NVLS_ENABLE": "0",
                "NVSHMEM_DISABLE_NVLS": "1", "OMP_NUM_THREADS": "1"}
    base_env.update(env or {})
    procs = [ctx.Process(target=_worker, args=(r, world, port, device, fn, args, base_env, q, hard_exit), daemon=True)
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
