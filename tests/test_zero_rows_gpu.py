"""Zero rows never hang or fail a call (issue #42), on ONE GPU: ranks share it under MPS (gloo group, CUDA
tensors), UCCL_EP_RANKS_PER_NODE makes emulated nodes whose bytes go through the CPU proxies.

The cases: a rank that receives nothing (its dispatch outputs, and so DeepEP's
`combine(recv_x, handle, topk_weights=recv_topk_weights)`, have 0 rows: an empty tensor's data pointer is 0),
a rank that sends nothing (0 tokens), a node that receives nothing, all tokens to one rank, FP8, padded
outputs (num_worst_tokens), cached dispatch, combine with and without weights and biases, expert-major
layouts (intranode), and low-latency calls with a rank of 0 tokens and experts that receive no row. Every
output is compared with the reference backend on CPU copies of the inputs (dispatch bit-exact, combine within
reduction tolerance), and the main process checks that the routing really left the ranks it names empty, so
the zero-row paths are the ones exercised. UCCL_EP_TIMEOUT_S=20: a rank refusing alone fails the test in
seconds instead of leaving its peers spinning.
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from dist_utils import run_ranks
from test_internode_gpu import _check_handle, _dispatch, _ready, _same, _settle, reference_buffer

pytestmark = [pytest.mark.gpu]

HIDDEN, EXPERTS = 256, 48
TIMEOUT = {"UCCL_EP_TIMEOUT_S": "20"}


def _route(rank: int, T: int, experts: list[int], K: int, seed: int, hot: Optional[list[int]] = None):
    """(x bf16 [T, H], topk_idx int64 [T, K], weights float32) on CPU: each token picks K distinct experts of
    `experts` (so the ranks and nodes holding none of them receive nothing), 4 tokens of 5 of `hot` when
    given (skew), reproducible from (seed, rank)."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(T, HIDDEN, generator=g).to(torch.bfloat16)

    def pick(i: int) -> torch.Tensor:
        allowed = torch.tensor(hot if hot and i % 5 else experts, dtype=torch.int64)
        return allowed[torch.randperm(len(allowed), generator=g)[:K]]

    idx = torch.stack([pick(i) for i in range(T)]) if T else torch.empty(0, K, dtype=torch.int64)
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def _ht_round(native, ref, rank: int, x, idx, w, tag: str, dev, fp8: bool = False, worst: int = 0) -> int:
    """Fresh dispatch, cached dispatch, DeepEP-style combine (received weights, a bias), combine without
    weights or bias: each against the reference. Returns the rows this rank really received."""
    from uccl_ep_train.fp8 import per_token_cast_to_fp8

    data = per_token_cast_to_fp8(x.float()) if fp8 else x
    kw = {"num_worst_tokens": worst} if worst else {}
    (rx, ridx, rw, counts, h, _), _ = _dispatch(native, data, idx, w, EXPERTS, dev, **kw)
    _settle(native, f"{tag}: dispatch")
    (ex, eidx, ew, ecounts, eh, _), _ = _dispatch(ref, data, idx, w, EXPERTS, "cpu", **kw)
    intranode = hasattr(eh, "rank_prefix_matrix")
    # padded rows (num_worst_tokens) are compared where both backends define them: internode zeroes them
    # as the reference does; intranode leaves them unspecified
    n = int(eh.rank_prefix_matrix[-1, rank]) if intranode else eh.num_recv_tokens

    def rows(t):
        return tuple(p[:n] for p in t) if isinstance(t, tuple) else t[:n]

    _same(rows(rx), rows(ex), f"{tag}: recv_x")
    _same(ridx[:n], eidx[:n], f"{tag}: recv_topk_idx")
    _same(rw[:n], ew[:n], f"{tag}: recv_topk_weights")
    assert (rx[0] if fp8 else rx).size(0) == (worst or n), tag
    assert counts == ecounts, f"{tag}: per-expert counts {counts} vs {ecounts}"
    if intranode:
        for name in ("rank_prefix_matrix", "send_head", "channel_prefix_matrix", "recv_channel_prefix_matrix"):
            _same(getattr(h, name), getattr(eh, name), f"{tag}: handle.{name}")
        _same(h.recv_src_idx[:n], eh.recv_src_idx[:n], f"{tag}: handle.recv_src_idx")
    else:
        _check_handle(h, eh, tag)
        n = int((eh.recv_src_meta.view(torch.int32)[:, 0] >= 0).sum()) if worst else n

    cx = native.dispatch(tuple(t.to(dev) for t in data) if fp8 else x.to(dev) * 2, handle=h)[0]
    _settle(native, f"{tag}: cached dispatch")
    ecx = ref.dispatch(data if fp8 else x * 2, handle=eh)[0]
    _same(rows(cx), rows(ecx), f"{tag}: cached recv_x")

    # expert outputs: the received rows x (rank + 1), the same on both sides (padding rows included)
    ey = ((ex[0] if fp8 else ex).float() * (rank + 1)).to(torch.bfloat16)
    y = ey.to(dev)
    bias = torch.randn(x.size(0), HIDDEN, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    out, out_w, _ = native.combine(y, h, topk_weights=rw, bias=bias.to(dev))  # DeepEP's call
    _settle(native, f"{tag}: combine")
    eout, eout_w, _ = ref.combine(ey, eh, topk_weights=ew, bias=bias)
    torch.testing.assert_close(out.cpu().float(), eout.float(), rtol=2e-2, atol=2e-2, msg=f"{tag}: combine")
    torch.testing.assert_close(out_w.cpu(), eout_w, rtol=1e-5, atol=1e-5, msg=f"{tag}: combined weights")
    out, out_w, _ = native.combine(y, h)
    _settle(native, f"{tag}: combine without weights")
    eout, eout_w, _ = ref.combine(ey, eh)
    assert out_w is None and eout_w is None, tag
    torch.testing.assert_close(out.cpu().float(), eout.float(), rtol=2e-2, atol=2e-2,
                               msg=f"{tag}: combine without weights")
    return n


# world 6 = 3 emulated nodes x 2 ranks, 8 experts per rank, 16 per node: (top-k, tokens of rank r, experts
# the tokens pick from, the experts 4 tokens of 5 pick from)
INTERNODE_CASES = {
    # the report: skewed to node 0, K=8, rank 5 (experts 40..47) receives nothing
    "skewed": (8, lambda r: 64 + 5 * r, list(range(40)), list(range(16))),
    # rank 1 sends nothing, routing over every expert
    "zero_tokens": (4, lambda r: 0 if r == 1 else 48, list(range(EXPERTS)), None),
    # node 2 (ranks 4, 5) receives nothing, and rank 4 sends nothing either
    "idle_node": (8, lambda r: 0 if r == 4 else 40 + r, list(range(32)), None),
    # every token to rank 0
    "one_rank": (8, lambda r: 24 + r, list(range(8)), None),
}


def _internode(rank: int, world: int, device: str) -> dict:
    from test_internode_gpu import _buffers

    dev = torch.device("cuda", torch.cuda.current_device())
    native, ref = _buffers(world)
    got = {}
    for seed, (case, (K, tokens, experts, hot)) in enumerate(INTERNODE_CASES.items()):
        x, idx, w = _route(rank, tokens(rank), experts, K, seed, hot)
        got[case] = _ht_round(native, ref, rank, x, idx, w, f"rank {rank} {case}", dev)
    K, tokens, experts, _ = INTERNODE_CASES["idle_node"]
    x, idx, w = _route(rank, tokens(rank), experts, K, 11)
    got["fp8"] = _ht_round(native, ref, rank, x, idx, w, f"rank {rank} fp8", dev, fp8=True)
    x, idx, w = _route(rank, tokens(rank), experts, K, 12)
    _ht_round(native, ref, rank, x, idx, w, f"rank {rank} worst", dev, worst=64 * world)
    native.backend.check_errors()
    native.destroy()
    ref.destroy()
    return got


def test_internode_zero_rows(mps):
    """3 emulated nodes x 2 ranks, 48 experts (the report's shape)."""
    why = _ready()
    if why:
        pytest.skip(why)
    env = {"UCCL_EP_RANKS_PER_NODE": "2", **TIMEOUT}
    got = run_ranks(_internode, 6, device="cuda", backend="gloo", ranks_per_gpu=6, timeout=300, env=env)
    assert got[5]["skewed"] == 0 and got[4]["idle_node"] == got[5]["idle_node"] == 0, got
    assert got[4]["fp8"] == got[5]["fp8"] == 0, got
    assert all(got[r]["one_rank"] == 0 for r in range(1, 6)) and got[0]["one_rank"] > 0, got
    assert all(g["zero_tokens"] > 0 for g in got), got  # (the sender of nothing still receives)


def _intranode(rank: int, world: int, device: str) -> dict:
    import os

    import torch.distributed as dist

    from uccl_ep_train import Buffer, Config

    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(list(range(world)), backend="gloo")
    os.environ["UCCL_EP_BACKEND"] = "native"
    native = Buffer(group, int(64e6), 0)
    assert type(native.backend).__name__ == "NativeBackend", type(native.backend).__name__
    ref = reference_buffer(group)
    got = {}
    # 12 experts per rank: rank 3 receives nothing; rank 1 sends nothing
    tokens = lambda r: 0 if r == 1 else 40 + 3 * r  # noqa: E731
    experts = list(range(36))
    for seed, (case, fp8) in enumerate((("bf16", False), ("fp8", True))):
        x, idx, w = _route(rank, tokens(rank), experts, 8, 20 + seed)
        got[case] = _ht_round(native, ref, rank, x, idx, w, f"rank {rank} intranode {case}", dev, fp8=fp8)
    x, idx, w = _route(rank, tokens(rank), experts, 8, 30)
    _ht_round(native, ref, rank, x, idx, w, f"rank {rank} intranode worst", dev, worst=64 * world)

    # expert-major: fused into the kernels, on side blocks, and through the separate permute kernels
    modes = {"fused": Config(8, fuse_max_width=1e9, expand_blocks=0, fold_blocks=0),
             "side_blocks": Config(8, fuse_max_width=0, expand_blocks=2, fold_blocks=2),
             "separate": Config(8, fuse_max_width=0, expand_blocks=0, fold_blocks=0)}
    x, idx, w = _route(rank, tokens(rank), experts, 4, 40)
    for mode, config in modes.items():
        tag = f"rank {rank} expert-major {mode}"
        x_em, ridx, rw, counts, em_map, h, _ = native.dispatch_expert_major(x.to(dev), idx.to(dev), w.to(dev),
                                                                            EXPERTS, config=config)
        _settle(native, f"{tag}: dispatch")
        ex_em, eidx, ew, ecounts, eem_map, eh, _ = ref.dispatch_expert_major(x, idx, w, EXPERTS)
        _same(x_em, ex_em, f"{tag}: x_em")
        _same(ridx, eidx, f"{tag}: recv_topk_idx")
        _same(rw, ew, f"{tag}: recv_topk_weights")
        _same(em_map, eem_map, f"{tag}: em_map")
        assert counts == ecounts, tag
        cx = native.dispatch_expert_major_cached(x.to(dev) * 2, h, em_map, sum(counts), config=config)[0]
        _settle(native, f"{tag}: cached dispatch")
        _same(cx, ref.dispatch_expert_major_cached(x * 2, eh, eem_map, sum(ecounts))[0], f"{tag}: cached x_em")
        y = (x_em.float() * (rank + 1)).to(torch.bfloat16)
        out, out_w, _ = native.combine_expert_major(y, h, em_map, topk_weights=rw, config=config)
        _settle(native, f"{tag}: combine")
        eout, eout_w, _ = ref.combine_expert_major(y.cpu(), eh, eem_map, topk_weights=ew)
        torch.testing.assert_close(out.cpu().float(), eout.float(), rtol=2e-2, atol=2e-2, msg=tag)
        torch.testing.assert_close(out_w.cpu(), eout_w, rtol=1e-5, atol=1e-5, msg=tag)
        got[mode] = int(x_em.size(0))
    native.backend.check_errors()
    native.destroy()
    ref.destroy()
    return got


def test_intranode_zero_rows(mps):
    """4 ranks on one node: rank 3 receives nothing, rank 1 sends nothing."""
    from uccl_ep_train.backends.native import native_available

    if not native_available():
        pytest.skip("native module built without intranode kernels")
    env = {"UCCL_EP_RANKS_PER_NODE": "4", **TIMEOUT}
    got = run_ranks(_intranode, 4, device="cuda", backend="gloo", ranks_per_gpu=4, timeout=300, env=env)
    for case in ("bf16", "fp8", "fused", "side_blocks", "separate"):
        assert got[3][case] == 0 and all(got[r][case] > 0 for r in range(3)), (case, got)


LL_M, LL_H, LL_E, LL_K = 16, 512, 8, 3
LL_EXPERTS = [0, 1, 3, 4, 5]  # experts 2, 6, 7 receive no row: rank 1 has one empty expert, rank 3 receives nothing


def _ll_inputs(rank: int, step: int):
    T = 0 if rank == 1 else LL_M - rank
    g = torch.Generator().manual_seed(step * 31 + rank)
    x = torch.randn(T, LL_H, generator=g).to(torch.bfloat16)
    allowed = torch.tensor(LL_EXPERTS)
    idx = torch.stack([allowed[torch.randperm(len(LL_EXPERTS), generator=g)[:LL_K]] for _ in range(T)]) if T else \
        torch.empty(0, LL_K, dtype=torch.int64)
    return x, idx, torch.rand(T, LL_K, generator=g)


def _low_latency(rank: int, world: int, device: str) -> list:
    import torch.distributed as dist

    from test_low_latency_gpu import _expected
    from uccl_ep_train import Buffer
    from uccl_ep_train.fp8 import per_token_cast_back, per_token_cast_to_fp8

    dev = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(dist.new_group(list(range(world))), 0,
                 Buffer.get_low_latency_rdma_size_hint(LL_M, LL_H, world, LL_E), low_latency_mode=True)
    assert type(buf.low_latency_backend).__name__ == "NativeLowLatencyBackend"
    local = LL_E // world
    factor = (torch.arange(local, device=dev) + rank * local + 1).float().view(local, 1, 1)
    counts = []
    for step, fp8 in enumerate((False, True, False)):
        tag = f"rank {rank} LL step {step}"
        inputs = [_ll_inputs(r, step) for r in range(world)]
        want = [sum(int((idx == rank * local + e).sum()) for _, idx, _ in inputs) for e in range(local)]
        x, idx, w = (t.to(dev) for t in inputs[rank])
        recv, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, LL_M, LL_E, use_fp8=fp8)
        torch.cuda.synchronize()
        buf.low_latency_backend.check_errors()
        assert recv_count.tolist() == want, f"{tag}: received {recv_count.tolist()}, expected {want}"
        rows = torch.stack([per_token_cast_back(recv[0][e], recv[1][e]) for e in range(local)]) if fp8 else \
            recv.float()
        def cast(t: torch.Tensor) -> torch.Tensor:  # what the kernel's FP8 round trip makes of rows (on the GPU)
            return per_token_cast_back(*per_token_cast_to_fp8(t)).float() if fp8 and t.size(0) else t.float()

        for e in range(local):  # the rows of each expert: source rank, then token order, from row 0
            sent = torch.cat([xs[(ids == rank * local + e).any(1)] for xs, ids, _ in inputs]).to(dev)
            got = rows[e, :want[e]].float()
            assert got.shape == sent.shape, f"{tag}: expert {e}: {tuple(got.shape)} vs {tuple(sent.shape)}"
            torch.testing.assert_close(got, cast(sent), atol=0, rtol=0, msg=f"{tag}: expert {e} rows")
        y = (rows * factor).to(torch.bfloat16)
        out, _, _ = buf.low_latency_combine(y, idx, w, handle)
        torch.cuda.synchronize()
        buf.low_latency_backend.check_errors()
        assert out.shape == (x.size(0), LL_H), tag
        torch.testing.assert_close(out.float(), _expected(cast(x).to(torch.bfloat16), idx, w), atol=0.08,
                                   rtol=0.03, msg=tag)
        counts.append(want)
    buf.destroy()
    return counts


@pytest.mark.parametrize("per_node", [2, 4])
def test_low_latency_zero_rows(mps, per_node):
    """4 ranks: rank 1 has 0 tokens, experts 2, 6, 7 get no row (rank 3 receives nothing); per_node 2: two
    emulated nodes (proxies), 4: one node."""
    from uccl_ep_train.backends.low_latency import low_latency_available

    if not low_latency_available():
        pytest.skip("native module without the low-latency kernels")
    env = {"UCCL_EP_RANKS_PER_NODE": str(per_node), **TIMEOUT}
    got = run_ranks(_low_latency, 4, device="cuda", backend="gloo", ranks_per_gpu=4, timeout=240, env=env)
    assert all(c == [0, 0] for c in got[3]) and all(c[0] == 0 < c[1] for c in got[1]), got
