"""What a rank holds, measured before and after a soak (tests/test_soak.py, tests/test_soak_gpu.py): open file
descriptors, threads, child processes (the ipc transport's copy agents), and on GPUs device memory in use
(torch.cuda.mem_get_info) and the tensors torch has allocated (torch.cuda.memory_allocated). A leak of one
of them per cycle shows after hundreds of cycles as growth far beyond the stated bounds."""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import torch

MIB = 1 << 20


@dataclass(frozen=True)
class Held:
    fds: int
    threads: int
    children: int
    device_used: int = 0  # bytes in use on the GPU, every process's (ranks sharing it measure at a barrier)
    allocated: int = 0  # bytes of live torch tensors of this process


@dataclass(frozen=True)
class Bounds:
    """The growth a soak may show, per rank: a few descriptors / threads for lazily made pools (gloo's,
    torch's), no child process, and memory within the allocator's rounding."""
    fds: int = 8
    threads: int = 4
    children: int = 0
    device_used: int = 256 * MIB
    allocated: int = 1 * MIB


def _children() -> int:
    """Live child processes of this process (every thread's /proc children list), zombies not counted."""
    kids: set[str] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                kids.update(f.read().split())
        except OSError:
            continue
    alive = 0
    for pid in kids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                alive += f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            continue
    return alive


def held(device: torch.device) -> Held:
    """This process's resources now (on a GPU, after its work finished and torch's cache was released)."""
    used = allocated = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        used, allocated = total - free, torch.cuda.memory_allocated(device)
    return Held(len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")), _children(), used,
                allocated)


def growth(before: Held, device: torch.device, bounds: Bounds = Bounds(), settle_s: float = 10.0) -> dict:
    """{resource: growth} now vs `before`; raises AssertionError naming each resource past its bound, after
    waiting up to `settle_s` for threads and processes that are already exiting (a closed proxy's agent)."""
    deadline = time.monotonic() + settle_s
    while True:
        now = held(device)
        grown = {k: v - asdict(before)[k] for k, v in asdict(now).items()}
        over = {k: v for k, v in grown.items() if v > asdict(bounds)[k]}
        if not over or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not over, f"grew past the bounds {asdict(bounds)}: {over} (before {before}, after {now})"
    return grown
