"""Internode layout and handle on the reference backend (CPU gloo ranks playing several nodes through
UCCL_EP_RANKS_PER_NODE), and topology.py's rules.

Each spawned run holds two Buffers over the same ranks: an internode one (N nodes x L ranks) and an
intranode one (UCCL_EP_RANKS_PER_NODE = world). Their dispatch rows, cached dispatch, combine and
expert-major calls must agree bit for bit (receive order is the same across nodes); the per-node layout
and every InternodeHandle item are checked against a brute-force computation from the global routing
(every rank regenerates every rank's inputs from seeds).
"""
from __future__ import annotations

import os
import sys
import types

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from oracle import RankInputs, dest_ranks
from uccl_ep_train import Buffer
from uccl_ep_train import autograd as ep_autograd
from uccl_ep_train.fp8 import per_token_cast_to_fp8
from uccl_ep_train.handles import InternodeHandle
from uccl_ep_train.topology import Topology, _this_rank, topology_from

EXPERTS_PER_RANK = 4
# (seed, tokens of rank 0, hidden, topk, dtype, skewed routing, FP8 x, rank with zero tokens, expert_alignment)
CASES = [(1, 17, 64, 3, torch.bfloat16, False, False, 1, 4),
         (2, 11, 128, 4, torch.bfloat16, True, True, -1, 1),
         (3, 9, 32, 2, torch.float32, False, False, 0, 1)]


def _inputs(rank: int, world: int, rpn: int, case: tuple) -> RankInputs:
    """This case's inputs of `rank`: random top-k with -1 holes, token 0 routed nowhere, token 1 with all of
    its top-k on the last node; skewed: most tokens on rank 0's experts."""
    seed, tokens, hidden, topk, dtype, skew, _, zero_rank, _ = case
    n = 0 if rank == zero_rank else tokens + 2 * rank
    E = EXPERTS_PER_RANK * world
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn((n, hidden), generator=g).to(dtype)
    scores = torch.rand((n, E), generator=g)
    if skew:
        scores[:, :EXPERTS_PER_RANK] += (torch.rand((n, 1), generator=g) < 0.8).float()
    idx = torch.topk(scores, topk, dim=1).indices.masked_fill(torch.rand((n, topk), generator=g) < 0.2, -1)
    if n >= 2:
        idx[0] = -1
        last_node = (world - rpn) * EXPERTS_PER_RANK
        idx[1] = last_node + torch.randperm(rpn * EXPERTS_PER_RANK, generator=g)[:topk]
    return RankInputs(x, idx, torch.rand((n, topk), generator=g))


def _expected_handle(routing: list[torch.Tensor], me: int, topo: Topology, rows: int) -> dict:
    """Every InternodeHandle item, by loops over the global routing (routing[s]: rank s's is_token_in_rank)."""
    R, N, L = topo.num_ranks, topo.num_nodes, topo.ranks_per_node
    node, local = topo.node_of(me), topo.local_of(me)
    cnt = [[int(routing[s][:, r].sum()) for r in range(R)] for s in range(R)]
    mine = routing[me]

    def on_node(t: int, s: int, n: int) -> bool:  # token t of rank s has a destination on node n
        return bool(routing[s][t, n * L:(n + 1) * L].any())

    meta = [[t, s] for s in range(R) for t in range(routing[s].size(0)) if routing[s][t, me]]
    rdma_head, sent = [], [0] * N
    for t in range(mine.size(0)):
        row = []
        for n in range(N):
            row.append(sent[n] if on_node(t, me, n) else -1)
            sent[n] += on_node(t, me, n)
        rdma_head.append(row)
    nvl_head, recv_rdma = [], []
    for n in range(N):
        s = topo.rank_of(n, local)
        forwarded = [t for t in range(routing[s].size(0)) if on_node(t, s, node)]
        recv_rdma.append(len(forwarded))
        for t in forwarded:
            row = []
            for j in range(L):
                d = topo.rank_of(node, j)
                start = sum(cnt[p][d] for p in range(s))
                row.append(start + int(routing[s][:t, d].sum()) if routing[s][t, d] else -1)
            nvl_head.append(row)
    received = [cnt[s][me] for s in range(R)]
    return {
        "rdma_channel_prefix_matrix": [[sum(on_node(t, me, n) for t in range(mine.size(0)))] for n in range(N)],
        "gbl_channel_prefix_matrix": [[c] for c in cnt[me]],
        "recv_rdma_channel_prefix_matrix": [[c] for c in recv_rdma],
        "recv_rdma_rank_prefix_sum": [sum(recv_rdma[:n + 1]) for n in range(N)],
        "recv_gbl_channel_prefix_matrix": [[sum(received[:s])] for s in range(R)],
        "recv_gbl_rank_prefix_sum": [sum(received[:s + 1]) for s in range(R)],
        "recv_src_meta": meta + [[-1, -1]] * (rows - len(meta)),
        "send_rdma_head": rdma_head,
        "send_nvl_head": nvl_head,
    }


def _check_handle(h, routing, me: int, topo: Topology, rows: int, num_tokens: int) -> None:
    assert isinstance(h, InternodeHandle) and h.ranks_per_node == topo.ranks_per_node
    assert h.num_recv_tokens == rows and h.num_tokens == num_tokens
    assert h[0] is h.is_token_in_rank and torch.equal(h.is_token_in_rank, routing[me])
    assert h.recv_src_meta.dtype == torch.uint8 and tuple(h.recv_src_meta.shape) == (rows, 8)
    for name, want in _expected_handle(routing, me, topo, rows).items():
        got = getattr(h, name)
        if name == "recv_src_meta":
            got = got.view(torch.int32)
        else:
            assert got.dtype == torch.int32, name
        assert got.tolist() == want, f"{name}: {got.tolist()} != {want}"


def _same(a, b, what: str) -> None:
    if isinstance(a, tuple):
        _same(a[0].view(torch.uint8), b[0].view(torch.uint8), what + " (fp8)")
        _same(a[1], b[1], what + " (scales)")
        return
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{what} differs"


def _check_errors(buf: Buffer, ref: Buffer, x, layout: dict, per_node: torch.Tensor, handle) -> None:
    """Argument errors, raised before any communication (so every rank raises and the group stays usable)."""
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank is required"):
        buf.dispatch(x, **layout)
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank must be None"):
        ref.dispatch(x, num_tokens_per_rdma_rank=per_node, **layout)
    with pytest.raises(ValueError, match=r"num_tokens_per_rdma_rank: expected \["):
        buf.dispatch(x, num_tokens_per_rdma_rank=torch.cat([per_node, per_node[:1]]), **layout)
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank: .* disagrees"):
        buf.dispatch(x, num_tokens_per_rdma_rank=per_node + 1, **layout)
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank must be None with a cached handle"):
        buf.dispatch(x, handle=handle, num_tokens_per_rdma_rank=per_node)


def _check_case(buf: Buffer, ref: Buffer, rank: int, world: int, topo: Topology, case: tuple) -> None:
    hidden, fp8, alignment = case[2], case[6], case[8]
    all_in = [_inputs(r, world, topo.ranks_per_node, case) for r in range(world)]
    me, E = all_in[rank], EXPERTS_PER_RANK * world
    routing = [dest_ranks(inp.topk_idx, E, world) for inp in all_in]
    L = topo.ranks_per_node

    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(me.topk_idx, E)
    want = [int(routing[rank][:, n * L:(n + 1) * L].any(dim=1).sum()) for n in range(topo.num_nodes)]
    assert per_node.dtype == torch.int32 and per_node.tolist() == want
    ref_layout = ref.get_dispatch_layout(me.topk_idx, E)
    assert ref_layout[1] is None
    for a, b in zip((per_rank, per_expert, in_rank), (ref_layout[0], ref_layout[2], ref_layout[3])):
        assert torch.equal(a, b)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    x = per_token_cast_to_fp8(me.x) if fp8 else me.x
    topk = dict(topk_idx=me.topk_idx, topk_weights=me.topk_weights, expert_alignment=alignment)

    got = buf.dispatch(x, num_tokens_per_rdma_rank=per_node, **layout, **topk)
    exp = ref.dispatch(x, **layout, **topk)
    for i, what in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
        _same(got[i], exp[i], what)
    assert got[3] == exp[3], "per-expert counts"
    handle, ref_handle = got[4], exp[4]
    rows = handle.num_recv_tokens
    _check_handle(handle, routing, rank, topo, rows, me.x.size(0))

    # cached dispatch and combine (with weights and two biases) as on one node
    x2 = (x[0], x[1] * 2) if fp8 else x * 2
    _same(buf.dispatch(x2, handle=handle)[0], ref.dispatch(x2, handle=ref_handle)[0], "cached dispatch")
    y = (got[0][0].float() if fp8 else got[0]) * (rank + 1)
    bias = (torch.ones((me.x.size(0), hidden), dtype=y.dtype), torch.full((me.x.size(0), hidden), 0.5, dtype=y.dtype))
    for a, b in zip(buf.combine(y, handle, topk_weights=got[2], bias=bias)[:2],
                    ref.combine(y, ref_handle, topk_weights=exp[2], bias=bias)[:2]):
        _same(a, b, "combine")

    # num_worst_tokens: padded rows, -1 source meta there; cached dispatch and combine of a padded handle
    worst = sum(inp.x.size(0) for inp in all_in) + 3
    wgot = buf.dispatch(x, num_tokens_per_rdma_rank=per_node, num_worst_tokens=worst, **layout, **topk)
    wexp = ref.dispatch(x, num_worst_tokens=worst, **layout, **topk)
    for i in range(3):
        _same(wgot[i], wexp[i], f"num_worst_tokens output {i}")
    assert wgot[3] == wexp[3] == []
    _check_handle(wgot[4], routing, rank, topo, worst, me.x.size(0))
    assert bool((wgot[4].recv_src_meta[rows:].view(torch.int32) == -1).all())
    _same(buf.dispatch(x2, handle=wgot[4])[0], ref.dispatch(x2, handle=wexp[4])[0], "padded cached dispatch")
    wy = torch.cat([y, torch.full((worst - rows, hidden), 1e4, dtype=y.dtype)])
    _same(buf.combine(wy, wgot[4])[0], ref.combine(wy, wexp[4])[0], "padded combine")

    if not fp8:  # expert-major calls and the autograd pair build on the same handle
        em = buf.dispatch_expert_major(me.x, me.topk_idx, me.topk_weights, E)
        em_ref = ref.dispatch_expert_major(me.x, me.topk_idx, me.topk_weights, E)
        for i in (0, 1, 2, 4):
            _same(em[i], em_ref[i], f"dispatch_expert_major output {i}")
        assert isinstance(em[5], InternodeHandle) and em[3] == em_ref[3]
        _same(buf.dispatch_expert_major_cached(me.x, em[5], em[4], sum(em[3]))[0],
              ref.dispatch_expert_major_cached(me.x, em_ref[5], em_ref[4], sum(em_ref[3]))[0], "cached expert-major")
        _same(buf.combine_expert_major(em[0], em[5], em[4], topk_weights=em[2])[0],
              ref.combine_expert_major(em_ref[0], em_ref[5], em_ref[4], topk_weights=em_ref[2])[0],
              "combine_expert_major")
        xa = me.x.clone().requires_grad_(True)
        recv, *_, ahandle = ep_autograd.dispatch(buf, xa, me.topk_idx, me.topk_weights, E)
        assert isinstance(ahandle, InternodeHandle)
        _same(recv.detach(), got[0], "autograd dispatch")
        (recv.float() * (rank + 1)).sum().backward()
        assert xa.grad is not None and xa.grad.shape == me.x.shape
    _check_errors(buf, ref, x, layout, per_node, handle)


# (nodes, ranks per node): each on the first nodes * ranks_per_node ranks of one 6-rank run (one spawn)
CONFIGS = [(2, 1), (2, 2), (4, 1), (3, 2)]


def _check_config(group: dist.ProcessGroup, topo: Topology) -> None:
    rank, world = group.rank(), group.size()
    os.environ["UCCL_EP_RANKS_PER_NODE"] = str(topo.ranks_per_node)
    buf = Buffer(group, int(1e6), 0)
    os.environ["UCCL_EP_RANKS_PER_NODE"] = str(world)  # one node: the receive-order reference
    ref = Buffer(group, int(1e6), 0)
    assert buf.topology == topo and buf.backend_name == "reference" and not ref.topology.internode
    for case in CASES:
        _check_case(buf, ref, rank, world, topo, case)
    buf.destroy()
    ref.destroy()


def _check_internode(rank: int, world: int, device: str) -> list:
    done = []
    for nodes, ranks_per_node in CONFIGS:
        size = nodes * ranks_per_node
        group = dist.new_group(list(range(size)))  # collective over the world: every rank makes every group
        if rank < size:
            try:
                _check_config(group, Topology(size, ranks_per_node))
            except Exception as exc:
                raise AssertionError(f"{nodes} nodes x {ranks_per_node} ranks failed") from exc
            done.append((nodes, ranks_per_node))
    return done


def test_internode_matches_intranode_and_brute_force():
    world = max(n * l for n, l in CONFIGS)
    results = run_ranks(_check_internode, world)
    assert results == [[(n, l) for n, l in CONFIGS if r < n * l] for r in range(world)]


def test_topology_from_environment_and_host_names(monkeypatch):
    assert topology_from([(2, "a")] * 4) == Topology(4, 2)  # the setting wins over host names
    assert topology_from([(8, "a")] * 4) == Topology(4, 4)  # more than the group: one node
    assert topology_from([(None, h) for h in "aabbcc"]) == Topology(6, 2)
    assert not topology_from([(None, "a")] * 3).internode
    with pytest.raises(ValueError, match="ranks disagree on ranks per node.*rank 1=4"):
        topology_from([(2, "a"), (4, "a"), (2, "b"), (2, "b")])
    with pytest.raises(ValueError, match=r"ranks_per_node \(3\) must divide the number of ranks \(4\)"):
        topology_from([(3, "a")] * 4)
    for hosts in ("abab", "abb", "aab"):
        with pytest.raises(ValueError, match="must be consecutive.*set UCCL_EP_RANKS_PER_NODE"):
            topology_from([(None, h) for h in hosts])
    # LOCAL_WORLD_SIZE counts world ranks: an expert-parallel group of every other rank of 2 x 8 has 4 per node
    monkeypatch.delenv("UCCL_EP_RANKS_PER_NODE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert topology_from([_this_rank(g) for g in range(0, 16, 2)]) == Topology(8, 4)
    monkeypatch.setenv("UCCL_EP_RANKS_PER_NODE", "two")
    with pytest.raises(ValueError, match="UCCL_EP_RANKS_PER_NODE='two' is not an int"):
        _this_rank(0)


def test_backend_choice_across_nodes(monkeypatch):
    """GPU ranks on several nodes get the native internode backend (auto and native) when the module has
    it; without it auto falls back to the reference backend and UCCL_EP_BACKEND=native raises, saying why.
    Availability faked: nothing here touches a GPU."""
    from uccl_ep_train.backends import native
    from uccl_ep_train.buffer import _make_backend

    class FakeInternode:
        def __init__(self, *args, topology, proxy_groups, open_at_first_dispatch):
            self.args, self.topology, self.proxy_groups = args, topology, proxy_groups
            self.open_at_first_dispatch = open_at_first_dispatch

    fake = types.ModuleType("uccl_ep_train.backends.internode")
    fake.NativeInternodeBackend, fake.internode_available = FakeInternode, lambda: False
    monkeypatch.setitem(sys.modules, "uccl_ep_train.backends.internode", fake)
    monkeypatch.setattr(native, "native_available", lambda: True)
    topo, device = Topology(4, 2), torch.device("cuda", 0)
    args = (None, 0, 4, 1, 0, 0, device, topo, False)
    monkeypatch.setenv("UCCL_EP_BACKEND", "native")
    with pytest.raises(RuntimeError, match="span 2 nodes .*without the internode path"):
        _make_backend(*args)
    monkeypatch.setenv("UCCL_EP_BACKEND", "auto")
    assert _make_backend(*args).name == "reference"
    fake.internode_available = lambda: True
    for choice in ("auto", "native"):
        monkeypatch.setenv("UCCL_EP_BACKEND", choice)
        chosen = _make_backend(*args)
        assert isinstance(chosen, FakeInternode) and chosen.topology is topo and chosen.args[-1] == device
        assert chosen.proxy_groups == 1 and not chosen.open_at_first_dispatch
    # a low-latency Buffer's ranks also run the LL calls' proxies: the HT backend counts them, and opens its
    # own only in the first HT dispatch (ranks making LL calls only run one proxy group)
    chosen = _make_backend(*args[:-1], True)
    assert chosen.proxy_groups == 2 and chosen.open_at_first_dispatch


def test_proxy_threads_of_ranks_sharing_a_gpu(monkeypatch):
    """Emulated nodes: each proxy thread brings a spinning copy agent, so a rank's share of the cores holds
    (share - 1) / 2 threads, divided between its proxy groups; unpinned; UCCL_EP_PROXY_THREADS wins; a GPU of
    its own changes nothing."""
    from uccl_ep_train.backends.internode import _shared_gpu_proxy_options

    monkeypatch.delenv("UCCL_EP_PROXY_THREADS", raising=False)
    assert _shared_gpu_proxy_options(1, 16, 1) == {}
    assert _shared_gpu_proxy_options(2, 16, 1) == {"pin_threads": False, "num_threads": 3}
    assert _shared_gpu_proxy_options(2, 16, 2) == {"pin_threads": False, "num_threads": 1}
    assert _shared_gpu_proxy_options(4, 16, 1) == {"pin_threads": False, "num_threads": 1}
    assert _shared_gpu_proxy_options(4, 2, 1) == {"pin_threads": False, "num_threads": 1}
    assert _shared_gpu_proxy_options(2, 128, 1) == {"pin_threads": False, "num_threads": 4}
    assert _shared_gpu_proxy_options(2, 128, 2) == {"pin_threads": False, "num_threads": 4}
    assert _shared_gpu_proxy_options(2, 40, 2) == {"pin_threads": False, "num_threads": 4}
    assert _shared_gpu_proxy_options(2, 24, 2) == {"pin_threads": False, "num_threads": 2}
    monkeypatch.setenv("UCCL_EP_PROXY_THREADS", "2")
    assert _shared_gpu_proxy_options(4, 16, 1) == {"pin_threads": False}
