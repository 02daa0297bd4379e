"""Gradients through the Dispatch/Combine pair match the dense computation they stand for."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from oracle import make_inputs
from uccl_ep_train import Buffer
from uccl_ep_train import autograd as ep_autograd


def _check_grads(rank: int, world: int, device: str, worst: bool) -> int:
    group = dist.new_group(list(range(world)))
    buf = Buffer(group, int(1e6), 0)
    experts, hidden = 8, 128
    counts = [11 + 2 * r for r in range(world)]
    counts[-1] = 0 if world > 2 else counts[-1]
    all_in = [make_inputs(r, counts[r], hidden, 3, experts, seed=5, dtype=torch.float32)
              for r in range(world)]
    me = all_in[rank]
    x = me.x.clone().to(device).requires_grad_(True)
    w = me.topk_weights.clone().to(device).requires_grad_(True)
    worst_tokens = sum(counts) if worst else 0
    recv_x, recv_idx, recv_w, _, handle = ep_autograd.dispatch(buf, x, me.topk_idx.to(device), w, experts,
                                                               num_worst_tokens=worst_tokens)
    # expert: scale the row by the sum of this rank's weights for the token and by (rank + 1)
    y = recv_x * recv_w.sum(dim=1, keepdim=True) * (rank + 1)
    out = ep_autograd.combine(buf, y, handle)
    g = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out).to(device)
    (out * g).sum().backward()

    # dense: out[t] = x[t] * sum over ranks r of (r+1) * sum of t's weights on r's experts
    xd = me.x.clone().requires_grad_(True)
    wd = me.topk_weights.clone().requires_grad_(True)
    owner = torch.where(me.topk_idx >= 0, me.topk_idx // (experts // world), -1)
    scale = ((owner + 1).float() * wd * (me.topk_idx >= 0)).sum(dim=1, keepdim=True)
    ref = xd * scale
    (ref * g.cpu()).sum().backward()
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.cpu(), xd.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.cpu(), wd.grad, atol=1e-5, rtol=1e-5)
    buf.destroy()
    return 1


@pytest.mark.parametrize("world,worst", [(2, False), (4, False), (2, True)])
def test_autograd_pair_matches_dense(world, worst):
    assert run_ranks(_check_grads, world, worst) == [1] * world


@pytest.mark.gpu
def test_autograd_on_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_ranks(_check_grads, 2, False, device="cuda")
