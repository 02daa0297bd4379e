"""uccl_ep_train.sizing, the one home of the EP buffers' sizes: its layouts against the kernels' (the native
module's host arithmetic, in every build), its typical-step counts against real dispatches, and the capacity
layouts' receive bound against skewed routing (reference backend on gloo ranks)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from uccl_ep_train import sizing

needs_layouts = pytest.mark.skipif(not sizing.layouts_available(), reason="native module not built")


@needs_layouts
@pytest.mark.parametrize("x_bytes, scale_bytes, num_topk, with_src", [
    (7168 * 2, 0, 8, True), (7168 * 2, 0, 8, False), (7168, 56 * 4, 8, True), (64 * 4, 0, 2, True), (4096, 0, 0, False),
])
def test_intranode_sizes_hold_the_rows_in_the_kernels_layout(x_bytes, scale_bytes, num_topk, with_src):
    """intranode_bytes_for(rows) holds `rows` rows in the kernels' make_row_layout, and a buffer that must grow
    is rebuilt at the bytes needed + 1/8 rounded up to GROW_STEP, once: the rebuilt buffer holds them."""
    per_row = x_bytes + scale_bytes + num_topk * 12 + (4 if with_src else 0)
    for rows in (1, 1000, 65536, 400_000):
        nbytes = sizing.intranode_bytes_for(rows, x_bytes, scale_bytes, num_topk, with_src)
        cap = sizing.intranode_row_capacity(nbytes, x_bytes, scale_bytes, num_topk, with_src)
        assert rows <= cap < rows + 1 + 4096 // per_row + 1
        grown = sizing.intranode_grow_to(sizing.MIN_BYTES, rows, x_bytes, scale_bytes, num_topk, with_src)
        if rows <= sizing.intranode_row_capacity(sizing.MIN_BYTES, x_bytes, scale_bytes, num_topk, with_src):
            assert grown is None
        else:
            assert grown % sizing.GROW_STEP == 0 and grown >= nbytes + nbytes // 8
            assert sizing.intranode_grow_to(grown, rows, x_bytes, scale_bytes, num_topk, with_src) is None


@needs_layouts
def test_internode_worst_case_holds_any_routing():
    """The worst-case layout (what get_rdma_buffer_size_hint(num_tokens=...) reserves) is at least the layout of
    every routing of that many tokens, and equals the hint."""
    import random

    from uccl_ep_train.config import Config

    R, L, T, hb, k = 16, 4, 300, 7168 * 2, 8
    N = R // L
    w_rdma, w_nvl = sizing.internode_worst_need(T, hb, R, L, k)
    rng = random.Random(0)
    for _ in range(20):
        rd = [rng.randint(0, T) for _ in range(R * N)]
        rdma, nvl = sizing.internode_need(rd, R, L, hb, 0, k, hb, rng.randint(0, R * T))
        assert rdma <= w_rdma and nvl <= w_nvl
    import os
    old = os.environ.get("UCCL_EP_RANKS_PER_NODE")
    os.environ["UCCL_EP_RANKS_PER_NODE"] = str(L)
    try:
        assert Config().get_rdma_buffer_size_hint(hb, R, num_tokens=T, num_topk=k) == w_rdma
    finally:
        if old is None:
            del os.environ["UCCL_EP_RANKS_PER_NODE"]
        else:
            os.environ["UCCL_EP_RANKS_PER_NODE"] = old


def _uniform_topk(n: int, k: int, experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)]).to(torch.int64)


def _typical_step(rank, world, device, tokens, k, experts, ranks_per_node):
    """A real dispatch of uniformly routed tokens: rows this rank received, tokens it sends each node."""
    from uccl_ep_train import Buffer

    buf = Buffer(dist.group.WORLD, int(1e6), 0)
    topk = _uniform_topk(tokens, k, experts, seed=100 + rank)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, experts)
    x = torch.randn(tokens, 8)
    recv_x, *_ = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                              is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk,
                              topk_weights=torch.ones(tokens, k))
    buf.destroy()
    nodes = world // ranks_per_node
    sent_to_node = [int(in_rank[:, n * ranks_per_node:(n + 1) * ranks_per_node].any(1).sum()) for n in range(nodes)]
    return recv_x.size(0), sent_to_node


def test_typical_step_counts_match_real_dispatches():
    """typical_rows / typical_node_tokens (what plan's eager step is sized from) are the mean of what ranks
    really receive and send per node when tokens are routed uniformly (4 ranks, 2 emulated nodes)."""
    world, L, T, k, E = 4, 2, 3000, 4, 16
    out = run_ranks(_typical_step, world, T, k, E, L, env={"UCCL_EP_RANKS_PER_NODE": str(L)})
    recv = [r for r, _ in out]
    node_tokens = [t for _, ts in out for t in ts]
    expected_rows = sizing.typical_rows(T, k, E, world)
    expected_node = sizing.typical_node_tokens(T, k, E, world // L)
    assert abs(sum(recv) / len(recv) - expected_rows) < 0.01 * expected_rows, (recv, expected_rows)
    assert abs(sum(node_tokens) / len(node_tokens) - expected_node) < 0.01 * expected_node, (node_tokens, expected_node)
    # and not a coincidence of the formula: top-1 routing reaches a quarter of the ranks' rows
    assert sizing.typical_rows(T, 1, E, world) == T


def _budget_step(rank, world, device, tokens, k, experts, factor, hot):
    """A static receive budget (megatron_patch.budget.RecvBudget) over routing that sends every token to the
    experts of rank 0 (`hot`) or uniformly: dispatch with its num_worst_tokens and capacity."""
    from megatron_patch.budget import RecvBudget
    from uccl_ep_train import Buffer, permute

    epr = experts // world
    budget = RecvBudget(SimpleNamespace(moe_expert_rank_capacity_factor=factor), epr, world, k, dist.group.WORLD)
    n = tokens - rank  # uneven token counts: the budget takes the largest
    # hot: token t to rank 0's expert t % epr, and its other slots to the next ones (distinct experts there)
    topk = ((torch.arange(n)[:, None] + torch.arange(k)[None, :]) % epr if hot
            else _uniform_topk(n, k, experts, seed=7 + rank))
    routing_map = torch.zeros(n, experts, dtype=torch.bool).scatter_(1, topk, True)
    budget.bootstrap(n, torch.device("cpu"))
    kept = budget.limit(routing_map)
    idx, w = permute.topk_from_routing_map(kept, kept.float(), k)
    buf = Buffer(dist.group.WORLD, int(1e6), 0)
    x_em, recv_idx, *_ = buf.dispatch_expert_major(torch.randn(n, 8), idx, w, experts,
                                                   num_worst_tokens=budget.worst_recv_tokens,
                                                   expert_capacity=budget.capacity)
    real = int((recv_idx >= 0).any(1).sum())  # rows really received (the rest is padding)
    buf.destroy()
    return budget.capacity, budget.worst_recv_tokens, real, x_em.size(0)


@pytest.mark.parametrize("hot, k", [(True, 1), (False, 2)])
def test_capacity_layout_reserves_its_bound_not_the_worst_case(hot, k):
    """The static budget's num_worst_tokens (sizing.capacity_recv_tokens) holds what a rank receives under any
    routing (the reference backend refuses a receive above it), is reached when every token goes to one
    rank's experts, and is below every token of every rank when the budget is small (4 ranks)."""
    world, T, E, factor = 4, 64, 16, 0.5
    out = run_ranks(_budget_step, world, T, k, E, factor, hot)
    epr = E // world
    cap = sizing.budget_capacity(T, k, factor, epr, world)
    bound = sizing.capacity_recv_tokens(T, epr, world, cap)
    assert bound < world * T
    for capacity, worst, real, rows in out:
        assert (capacity, worst, rows) == (cap, bound, epr * world * cap)
        assert real <= worst
    if hot:
        assert out[0][2] == bound  # rank 0 gets each source's `epr * capacity` tokens: the bound is tight


def test_a_sync_free_combine_is_sized_from_what_every_rank_passes_alike():
    """num_worst_tokens (and the capacity, and num_max_tokens_per_rank when given) bound the combine's rows, never
    the rank's own token count: ranks holding different counts grew their buffers apart (GPU fuzz seeds 14, 15)."""
    assert sizing.worst_send_rows(2053, 3, 88, 0) == 3 * 2053
    assert sizing.worst_send_rows(2053, 3, 88, 0, 1024) == 3 * 1024
    assert sizing.worst_send_rows(2053, 3, 8, 16) == 3 * 8 * 16
    assert sizing.worst_send_rows(2053, 3, 8, 16, 100) == 3 * 100
    assert sizing.worst_send_rows(64, 8, 8, 0, 4096) == 8 * 64


@needs_layouts
@pytest.mark.parametrize("R,L", [(4, 1), (4, 2), (6, 3), (8, 4)])
def test_internode_sync_free_bound_holds_every_routing_it_allows(R, L):
    """A sync-free internode dispatch sizes its buffers before the counts, from internode_worst_counts (only
    what every rank passes: num_worst_tokens, an expert capacity, a token bound): every routing that keeps within
    them (the counts kernel refuses the others) has per-node counts within the bound, and every rank's layout
    fits the buffers sized from it."""
    N, epr, K, hb = R // L, 3, 2, 256
    E = R * epr
    g = torch.Generator().manual_seed(R * 10 + L)
    for trial in range(12):
        # odd trials: one sender (a node gets more of its tokens than any of its ranks); even: skewed to one rank
        tokens = ([30] + [0] * (R - 1)) if trial % 2 else torch.randint(0, 30, (R,), generator=g).tolist()
        hot = int(torch.randint(0, R, (1,), generator=g))
        routes = []
        for T in tokens:
            idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
            skew = (torch.rand(idx.shape, generator=g) < 0.5) & (trial % 2 == 0)
            idx = torch.where(skew, hot * epr + idx % epr, idx).long()
            routes.append(idx)
        to_rank = [[int(((r.view(-1, K) // epr) == d).any(1).sum()) if r.numel() else 0 for d in range(R)]
                   for r in routes]
        per_node = [[int(((r.view(-1, K) // epr // L) == n).any(1).sum()) if r.numel() else 0 for n in range(N)]
                    for r in routes]
        per_expert = [torch.bincount(r.reshape(-1), minlength=E) if r.numel() else torch.zeros(E, dtype=torch.long)
                      for r in routes]
        recv = [sum(to_rank[s][d] for s in range(R)) for d in range(R)]
        rd = [v for row in per_node for v in row]
        exact = sizing.internode_need(rd, R, L, hb, 0, K, hb, max(recv))
        worst = max(max(recv), 1)
        capacity = int(max(int(c.max()) for c in per_expert)) or 1
        for cap, most in ((0, 0), (capacity, 0), (0, max(tokens) or 1), (capacity, max(tokens) or 1)):
            bound, max_recv = sizing.internode_worst_counts(R, L, worst, epr, cap, most)
            assert max(rd) <= bound[0] and max_recv == worst, (rd, bound[0], cap, most)
            need = sizing.internode_need(bound, R, L, hb, 0, K, hb, max_recv, ranks=[0])
            assert exact[0] <= need[0] and exact[1] <= need[1], (exact, need, cap, most)


@needs_layouts
def test_internode_growth_stops_at_the_largest_rdma_region():
    """Growth adds headroom (grown_bytes), but never past what the RDMA region can address (32-bit offsets):
    a need just under the limit gets a region at the limit, not one the allocation would refuse."""
    most = sizing.internode_max_rdma_bytes()
    assert most < 1 << 32 and most % (1 << 20) == 0  # 32-bit offsets; a page-aligned size
    need = most - (1 << 20)
    assert sizing.grown_bytes(need) > most  # (the headroom alone would pass it)
    assert need <= sizing.internode_grow(1 << 20, need, most) <= most
    assert sizing.internode_grow(1 << 30, 1 << 29, most) == 1 << 30  # enough already: unchanged
