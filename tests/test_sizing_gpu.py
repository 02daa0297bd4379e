"""GPU test: the native intranode backend's buffer is the size uccl_ep_train.sizing (and so `uccl-ep-train
plan`) predicts from the call's counts, and a capacity layout sizes alike on ranks with different token
counts (2 ranks on one GPU under MPS, or one GPU each). UCCL_EP_TIMEOUT_S=30: a rank growing alone would
leave its peer's kernels waiting, and the test fails in seconds instead of hanging."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from uccl_ep_train import sizing

pytestmark = [pytest.mark.gpu]

WORLD, EXPERTS = 2, 8


def _sizes(rank: int, world: int, device: str) -> dict:
    import os

    import torch.distributed as dist

    from uccl_ep_train import Buffer, permute

    os.environ["UCCL_EP_BACKEND"] = "native"
    group = dist.new_group(list(range(world)), backend="gloo")
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(5 + rank)
    got = {}

    # eager: a buffer opened at the minimum grows to what sizing says the realized counts need
    buf = Buffer(group, 0, 0)
    assert type(buf.backend).__name__ == "NativeBackend", type(buf.backend).__name__
    got["start"] = buf.backend._nbytes
    T, H, K = 12000 - 1000 * rank, 2048, 2
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(T)]).to(dev)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, EXPERTS)
    buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                              num_tokens_per_expert=per_expert, topk_idx=idx,
                              topk_weights=torch.ones(T, K, device=dev))
    torch.cuda.synchronize()
    counts = [torch.zeros(world, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, per_rank.cpu().to(torch.int64), group=group)
    recv = max(int(sum(c[r] for c in counts)) for r in range(world))
    send = max(int(c.sum()) for c in counts)
    got["eager"] = buf.backend._nbytes
    got["eager_predicted"] = sizing.intranode_bytes_after(
        got["start"], sizing.intranode_dispatch_needs(recv, send, H * 2, 0, K, H * 2))
    buf.destroy()

    # a receive budget's capacity layout, uneven token counts: the combine's send rows are bounded by the
    # capacity (the same on every rank), not by this rank's tokens
    buf = Buffer(group, 0, 0)
    # (7168 wide: the 3000 receive rows grow the buffer to 64 MiB, which holds the 3000 send rows too; sized by
    # this rank's tokens, rank 0 would need 6000 send rows, grow alone, and leave rank 1 waiting)
    Tmax, H = 6000, 7168
    n = Tmax - 5000 * rank
    epr = EXPERTS // world
    cap = sizing.budget_capacity(Tmax, K, 0.25, epr, world)
    worst = sizing.capacity_recv_tokens(Tmax, epr, world, cap)
    routing = torch.zeros(n, EXPERTS, dtype=torch.bool)
    routing.scatter_(1, torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(n)]), True)
    routing &= routing.to(torch.int32).cumsum(0) <= cap  # what RecvBudget.limit keeps
    idx, w = permute.topk_from_routing_map(routing, routing.float(), K)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    x_em, _, rw, _, em_map, h, _ = buf.dispatch_expert_major(x.to(dev), idx.to(dev), w.to(dev), EXPERTS,
                                                             num_worst_tokens=worst, expert_capacity=cap)
    y = buf.combine_expert_major(x_em, h, em_map, topk_weights=rw)[0]
    torch.cuda.synchronize()
    buf.backend.check_errors()
    got["static"] = buf.backend._nbytes
    got["static_predicted"] = sizing.intranode_bytes_after(got["start"], sizing.intranode_dispatch_needs(
        worst, sizing.worst_send_rows(worst, world, epr, cap), H * 2, 0, K, H * 2))
    got["static_rows"] = x_em.size(0)
    got["combined"] = bool(torch.isfinite(y.float()).all())
    buf.destroy()
    return got


def test_native_buffer_sizes_are_what_sizing_predicts(mps):
    from uccl_ep_train.backends.native import native_available

    if not native_available():
        pytest.skip("native module built without intranode kernels")
    env = {"UCCL_EP_RANKS_PER_NODE": str(WORLD), "UCCL_EP_TIMEOUT_S": "30"}
    got = run_ranks(_sizes, WORLD, device="cuda", backend="gloo", ranks_per_gpu=WORLD, timeout=300, env=env)
    for g in got:
        assert g["start"] == sizing.MIN_BYTES
        assert g["eager"] == g["eager_predicted"] > g["start"], g  # it grew, to the predicted size
        assert g["static"] == g["static_predicted"], g
        assert g["static_rows"] == EXPERTS * sizing.budget_capacity(6000, 2, 0.25, EXPERTS // WORLD, WORLD)
        assert g["combined"]
    assert len({g["eager"] for g in got}) == 1 and len({g["static"] for g in got}) == 1, got
