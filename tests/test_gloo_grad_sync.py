"""megatron_patch.gloo_grad_sync: Megatron's coalesced gradient all-reduce, split into single calls on gloo
groups (gloo has no coalesced all-reduce for CUDA tensors), torch's coalescing kept elsewhere."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from dist_utils import run_ranks  # noqa: E402


def _sums(rank: int, world: int, device: str) -> list:
    from megatron_patch import gloo_grad_sync
    buckets = [torch.full((3,), float(rank + 1), device=device), torch.full((5,), 10.0 * (rank + 1), device=device)]
    with gloo_grad_sync._coalescing_manager(None, async_ops=False) as cm:
        for b in buckets:
            dist.all_reduce(b)
    cm.wait()
    with pytest.raises(RuntimeError, match="overlap-grad-reduce"):
        with gloo_grad_sync._coalescing_manager(None, async_ops=True):
            pass
    refused = None
    if device == "cuda":  # what the patch is for: torch's own coalescing refuses CUDA tensors on gloo
        try:
            with dist._coalescing_manager(None):
                dist.all_reduce(torch.ones(2, device=device))
        except RuntimeError as exc:
            refused = str(exc)
    return [b.tolist() for b in buckets] + [refused]


def _expected(world: int) -> list:
    total = world * (world + 1) / 2
    return [[total] * 3, [10.0 * total] * 5]


def test_buckets_all_reduce_one_by_one_on_gloo():
    for result in run_ranks(_sums, 2):
        assert result[:2] == _expected(2)


def test_apply_installs_it_in_megatron_ddp():
    from megatron.core.distributed import param_and_grad_buffer
    from megatron_patch import gloo_grad_sync
    gloo_grad_sync.apply()
    assert param_and_grad_buffer._coalescing_manager is gloo_grad_sync._coalescing_manager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_buckets_on_gloo(mps):
    results = run_ranks(_sums, 2, device="cuda", backend="gloo", ranks_per_gpu=2)
    for result in results:
        assert result[:2] == _expected(2)
    assert results[0][2], "torch's own coalescing took CUDA tensors on gloo: the patch would not be needed"
    print("torch's coalescing on gloo/CUDA:", results[0][2])
