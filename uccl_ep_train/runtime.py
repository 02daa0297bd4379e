"""Process-wide UCCL runtime: `initialize_uccl` / `destroy_uccl` with the seed README's signatures.

UCCL-EP scripts call `proxies, workers = initialize_uccl(scratch, num_rdma_bytes, rank, num_ranks, group,
num_experts)` before building a Buffer and `destroy_uccl(proxies, workers)` at the end. Here the call
records the scratch (RDMA) region and, when the native module with proxies is present, starts the CPU
proxy threads for this GPU; with the reference backend there is nothing to start and both lists are empty.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

log = logging.getLogger("uccl_ep_train")


@dataclass
class UcclRuntime:
    scratch: Optional[torch.Tensor]
    num_rdma_bytes: int
    rank: int
    num_ranks: int
    num_experts: int
    group: Any
    proxies: list = field(default_factory=list)
    workers: list = field(default_factory=list)


_current: Optional[UcclRuntime] = None


def current_runtime() -> Optional[UcclRuntime]:
    return _current


def initialize_uccl(scratch: Optional[torch.Tensor], num_rdma_bytes: int, rank: int, num_ranks: int,
                    group: Optional[dist.ProcessGroup] = None, num_experts: int = 0,
                    **kwargs: Any) -> tuple[list, list]:
    """Set up the per-process runtime; returns `(proxies, workers)` to hand back to `destroy_uccl`."""
    global _current
    if not isinstance(num_rdma_bytes, int) or num_rdma_bytes < 0:
        raise ValueError(f"initialize_uccl: num_rdma_bytes must be a non-negative int, got {num_rdma_bytes!r}")
    if not (0 <= rank < num_ranks):
        raise ValueError(f"initialize_uccl: rank {rank} out of range for num_ranks {num_ranks}")
    if num_experts and num_experts % num_ranks:
        raise ValueError(f"initialize_uccl: num_experts {num_experts} not divisible by num_ranks {num_ranks}")
    if scratch is not None and scratch.numel() * scratch.element_size() < num_rdma_bytes:
        raise ValueError(f"initialize_uccl: scratch holds {scratch.numel() * scratch.element_size()} bytes, "
                         f"num_rdma_bytes asks for {num_rdma_bytes}")
    if _current is not None:
        raise RuntimeError("initialize_uccl: already initialized in this process; call destroy_uccl first")
    rt = UcclRuntime(scratch, num_rdma_bytes, rank, num_ranks, num_experts, group)
    try:
        from .proxy import start_proxies  # native proxies, when the module is built with them
    except ImportError:
        start_proxies = None
    if start_proxies is not None:
        rt.proxies, rt.workers = start_proxies(rt, **kwargs)
    else:
        log.info("uccl_ep_train: reference backend, no CPU proxies started")
    _current = rt
    return rt.proxies, rt.workers


def destroy_uccl(proxies: list, workers: list) -> None:
    """Stop the proxies started by `initialize_uccl` (joins threads, frees registrations); idempotent."""
    global _current
    for w in list(workers or []) + list(proxies or []):
        stop = getattr(w, "stop", None)
        if stop is not None:
            stop()
    _current = None
