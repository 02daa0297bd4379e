"""Megatron-LM's DDP gradient all-reduce on gloo groups holding CUDA tensors (ranks sharing a GPU).

Megatron's `_ParamAndGradBucketGroup.start_grad_sync` (megatron/core/distributed/param_and_grad_buffer.py)
issues each bucket's all-reduce inside `torch.distributed._coalescing_manager`, which turns them into one
`allreduce_coalesced`; ProcessGroupGloo implements that for CPU tensors only ("allreduce_coalesced:
unsupported device type cuda"), so Megatron-LM on `--distributed-backend gloo` with CUDA tensors stops at
its first gradient sync. `apply()` replaces the module's `_coalescing_manager` with one that, on a gloo
group, lets each collective run by itself (the same sums, one call per bucket) and keeps torch's on every
other group. The asynchronous form (`--overlap-grad-reduce`) would need the calls' handles, which the
coalescing manager alone collects: it is refused with a message saying so.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch.distributed as dist


class _Uncoalesced:
    """What `with _coalescing_manager(...) as cm` yields on gloo: the collectives already ran synchronously,
    so there is nothing to wait for."""

    def wait(self) -> None:
        return None


@contextlib.contextmanager
def _coalescing_manager(group: Optional[dist.ProcessGroup] = None, device=None,
                        async_ops: bool = False) -> Iterator[object]:
    if dist.get_backend(group) != "gloo":
        with dist._coalescing_manager(group, device=device, async_ops=async_ops) as cm:
            yield cm
        return
    if async_ops:
        raise RuntimeError("Megatron-LM's asynchronous gradient sync (--overlap-grad-reduce / "
                           "--overlap-param-gather) cannot run on a gloo group with CUDA tensors: gloo has no "
                           "coalesced all-reduce for them. Leave those flags off with --distributed-backend gloo")
    yield _Uncoalesced()


def apply() -> None:
    """Install the gloo-aware coalescing manager in the imported megatron.core (idempotent: an assignment)."""
    from megatron.core.distributed import param_and_grad_buffer
    param_and_grad_buffer._coalescing_manager = _coalescing_manager
