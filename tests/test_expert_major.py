"""Expert-major dispatch/combine (Buffer.dispatch_expert_major, dispatch_expert_major_cached,
combine_expert_major and their autograd pair) against the composed path they replace.

On CPU gloo ranks (reference backend): dispatch_expert_major equals dispatch + permute.expert_major_map +
expand_rows bit for bit, the cached form equals cached dispatch + expand, combine_expert_major equals
reduce_rows + combine, and gradients through the autograd pair equal those through the old
Dispatch/expand/reduce/Combine chain. Bad arguments raise naming the argument, before any communication.
On GPUs (marked, 2 ranks): the native backend's three methods against the reference backend's.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from dist_utils import gpu_ranks, run_ranks
from oracle import make_inputs
from record_check import assert_complete
from uccl_ep_train import Buffer, permute
from uccl_ep_train import autograd as ep_autograd


def _bits(t):
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else \
        t.view(torch.int32) if t.dtype == torch.float32 else t


def _same(a, b, what):
    assert (a is None) == (b is None), f"{what}: one side is None"
    if a is not None:
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.dtype} {tuple(a.shape)} != {b.dtype} " \
                                                          f"{tuple(b.shape)}"
        assert torch.equal(_bits(a), _bits(b)), f"{what}: differs"


def _tokens(rank, world):
    counts = [13 + 3 * r for r in range(world)]
    if world > 2:
        counts[1] = 0  # a rank that sends nothing
    return counts[rank]


def _calls_match_composed(rank, world, device):
    group = dist.new_group(list(range(world)))
    buf = Buffer(group, int(1e6), 0)
    checks = 0
    for seed, (dtype, hidden, topk, experts, with_w, idx32) in enumerate(
            [(torch.bfloat16, 96, 4, 8, True, False), (torch.float32, 70, 3, 4 * world, True, True),
             (torch.float16, 33, 2, world, False, False)]):
        me = make_inputs(rank, _tokens(rank, world), hidden, topk, experts, seed=seed + 11, dtype=dtype, mask_prob=0.3)
        idx = me.topk_idx.to(torch.int32) if idx32 else me.topk_idx
        w = me.topk_weights if with_w else None
        # composed (today's path)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        recv_x, ridx, rw, counts, handle, _ = buf.dispatch(me.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                           num_tokens_per_expert=per_expert, topk_idx=idx,
                                                           topk_weights=w)
        em = permute.expert_major_map(ridx, counts)
        m = sum(counts)
        # expert-major
        prev = buf.capture()
        x_em, ridx2, rw2, counts2, em2, handle2, ev = buf.dispatch_expert_major(me.x, idx, w, experts,
                                                                                previous_event=prev, async_finish=True)
        ev.current_stream_wait()
        tag = f"seed {seed} rank {rank}"
        assert counts2 == counts, f"{tag}: counts {counts2} != {counts}"
        _same(em2, em, f"{tag}: em_map")
        _same(x_em, permute.expand_rows(recv_x, em, m), f"{tag}: x_em")
        _same(ridx2, ridx, f"{tag}: recv_topk_idx")
        _same(rw2, rw, f"{tag}: recv_topk_weights")
        _same(handle2.rank_prefix_matrix, handle.rank_prefix_matrix, f"{tag}: rank_prefix_matrix")
        assert handle2.num_recv_tokens == em2.size(0) == ridx2.size(0)

        # cached: another tensor along the same layout
        x2 = torch.randn(me.x.shape, generator=torch.Generator().manual_seed(rank + 100 * seed)).to(dtype)
        cached, _ = buf.dispatch_expert_major_cached(x2, handle2, em2, m)
        ref_cached, *_ = buf.dispatch(x2, handle=handle)
        _same(cached, permute.expand_rows(ref_cached, em, m), f"{tag}: cached x_em")

        # combine: expert outputs in expert-major order, weights in receive order
        y_em = torch.randn((m, hidden), generator=torch.Generator().manual_seed(7 + rank)).to(dtype)
        for tw in ((None, None) if rw is None else (None, (rw2, rw))):
            got, got_w, _ = buf.combine_expert_major(y_em, handle2, em2, topk_weights=None if tw is None else tw[0])
            ref, ref_w, _ = buf.combine(permute.reduce_rows(y_em, em, ridx.size(0)), handle,
                                        topk_weights=None if tw is None else tw[1])
            _same(got, ref, f"{tag}: combined x")
            _same(got_w, ref_w, f"{tag}: combined topk_weights")
            checks += 1
    # the reference backend composes every expert-major call from a receive-order one and the permute module
    assert buf.expert_major_paths == dict.fromkeys(
        ("dispatch_expert_major", "dispatch_expert_major_cached", "combine_expert_major"), "permute")
    buf.destroy()
    return checks


@pytest.mark.parametrize("world", [2, 4])
def test_expert_major_calls_equal_composed_path(world):
    assert run_ranks(_calls_match_composed, world) == [6] * world


def _grads(rank, world, device):
    group = dist.new_group(list(range(world)))
    buf = Buffer(group, int(1e6), 0)
    experts, hidden = 4 * world, 64
    me = make_inputs(rank, _tokens(rank, world), hidden, 3, experts, seed=5, dtype=torch.float32, mask_prob=0.25)
    scale = torch.linspace(0.5, 2.0, experts // world)  # a different "expert" per local expert
    results = []
    for new in (False, True):
        x = me.x.clone().requires_grad_(True)
        w = me.topk_weights.clone().requires_grad_(True)
        if new:
            x_em, _, recv_w, counts, em, handle = ep_autograd.dispatch_expert_major(buf, x, me.topk_idx, w, experts)
        else:
            recv_x, ridx, recv_w, counts, handle = ep_autograd.dispatch(buf, x, me.topk_idx, w, experts)
            em = permute.expert_major_map(ridx, counts)
            x_em = permute.expand_rows(recv_x, em, sum(counts))
        m = sum(counts)
        probs = permute.expand_probs(recv_w, em, m)
        per_row = torch.repeat_interleave(scale, torch.tensor(counts))
        y_em = torch.tanh(x_em) * (probs * per_row)[:, None]  # expert, probability applied as Megatron does
        if new:
            out = ep_autograd.combine_expert_major(buf, y_em, handle, em)
        else:
            out = ep_autograd.combine(buf, permute.reduce_rows(y_em, em, em.size(0)), handle)
        g = torch.linspace(-1, 1, out.numel()).view_as(out)
        (out * g).sum().backward()
        results.append((out.detach(), x.grad, w.grad))
    for (a, b, what) in zip(results[0], results[1], ("out", "x.grad", "topk_weights.grad")):
        _same(b, a, f"rank {rank}: {what}")
    assert results[1][1].abs().sum() > 0 or _tokens(rank, world) == 0
    buf.destroy()
    return 1


@pytest.mark.parametrize("world", [2, 4])
def test_autograd_pair_matches_composed_gradients(world):
    assert run_ranks(_grads, world) == [1] * world


def _capacity_layout(rank, world, device):
    """dispatch_expert_major with num_worst_tokens and expert_capacity (Megatron's drop-and-pad sizes, no host
    sync on the native backend) against the exact layout: the same rows, each (local expert, source rank)
    block padded with zero rows to the capacity; the receive-order outputs padded to num_worst_tokens
    (ids -1, map -1); the combine and the gradients through the autograd pair equal the exact path's bit for
    bit. A capacity too small raises naming expert_capacity."""
    group = dist.new_group(list(range(world)))
    buf = Buffer(group, int(1e6), 0)
    experts, hidden, topk = 3 * world, 48, 3
    epr = experts // world
    me = make_inputs(rank, _tokens(rank, world), hidden, topk, experts, seed=21, dtype=torch.float32, mask_prob=0.2)
    worst = sum(_tokens(r, world) for r in range(world))
    # the most tokens any source sends to one expert (every rank computes the same from the shared seed)
    most = max(int((make_inputs(r, _tokens(r, world), hidden, topk, experts, seed=21, dtype=torch.float32,
                                mask_prob=0.2).topk_idx == e).sum()) for r in range(world) for e in range(experts))
    cap = most + 2  # room to spare: every block has padding rows
    results = []
    for capacity in (0, cap):
        x = me.x.clone().requires_grad_(True)
        w = me.topk_weights.clone().requires_grad_(True)
        x_em, ridx, recv_w, counts, em, handle = ep_autograd.dispatch_expert_major(
            buf, x, me.topk_idx, w, experts, num_worst_tokens=worst if capacity else 0, expert_capacity=capacity)
        m = sum(counts)
        probs = permute.expand_probs(recv_w, em, m, padded=bool(capacity))
        y_em = torch.tanh(x_em) * probs[:, None]
        out = ep_autograd.combine_expert_major(buf, y_em, handle, em, expert_capacity=capacity)
        g = torch.linspace(-1, 1, out.numel()).view_as(out)
        (out * g).sum().backward()
        results.append((x_em.detach(), ridx, em, counts, handle, out.detach(), x.grad, w.grad))
    exact, padded = results
    n = exact[1].size(0)  # rows received
    tag = f"rank {rank}"
    assert padded[3] == [world * cap] * epr, f"{tag}: tokens_per_expert {padded[3]}"
    assert padded[0].shape == (epr * world * cap, hidden)
    assert padded[1].size(0) == padded[2].size(0) == padded[4].num_recv_tokens == worst
    _same(padded[1][:n], exact[1], f"{tag}: recv_topk_idx")
    assert bool((padded[1][n:] == -1).all()) and bool((padded[2][n:] == -1).all()), f"{tag}: padding rows"
    em_e, em_p = exact[2], padded[2][:n]
    assert torch.equal(em_e >= 0, em_p >= 0), f"{tag}: the same slots are named"
    named = em_p[em_p >= 0].long()
    _same(padded[0][named], exact[0][em_e[em_e >= 0].long()], f"{tag}: rows at their capacity slots")
    unnamed = torch.ones(padded[0].size(0), dtype=torch.bool)
    unnamed[named] = False
    assert bool((padded[0][unnamed] == 0).all()) and int(unnamed.sum()) > 0, f"{tag}: padding rows are zeros"
    # block (e, s) starts at (e * world + s) * cap: the first row of expert 0 from source 0 is slot 0
    src_rows = torch.diff(exact[4].rank_prefix_matrix[:, rank].long(), prepend=torch.zeros(1, dtype=torch.long))
    first = torch.nonzero(exact[1][: int(src_rows[0])] == 0)
    if len(first):
        assert int(em_p[first[0, 0], first[0, 1]]) == 0, f"{tag}: block (0, 0) starts at row 0"
    for i, what in ((5, "combined"), (6, "x.grad"), (7, "topk_weights.grad")):
        _same(padded[i], exact[i], f"{tag}: {what}")
    with pytest.raises(ValueError, match="expert_capacity"):
        buf.dispatch_expert_major(me.x, me.topk_idx, me.topk_weights, experts, num_worst_tokens=worst,
                                  expert_capacity=1 if most > 1 else 0)
    buf.destroy()
    return 1


@pytest.mark.parametrize("world", [2, 4])
def test_capacity_layout_equals_exact_layout_padded(world):
    assert run_ranks(_capacity_layout, world) == [1] * world


def _errors(rank, world, device):
    """Every bad call raises on every rank before communicating (so nothing hangs); then a good call works."""
    group = dist.new_group(list(range(world)))
    buf = Buffer(group, int(1e6), 0)
    other = Buffer(group, int(1e6), 0)
    experts = 2 * world
    me = make_inputs(rank, 9, 128, 2, experts, seed=3, dtype=torch.bfloat16)
    x, idx, w = me.x, me.topk_idx, me.topk_weights
    x_em, ridx, rw, counts, em, handle, _ = buf.dispatch_expert_major(x, idx, w, experts)
    m = sum(counts)
    y_em = torch.zeros((m, 128), dtype=torch.bfloat16)
    seen = []

    def bad(kind, pattern, fn):
        with pytest.raises(kind, match=pattern):
            fn()
        seen.append(pattern)

    from uccl_ep_train.fp8 import per_token_cast_to_fp8
    fp8 = per_token_cast_to_fp8(x.float())
    bad(TypeError, "^x: .*FP8", lambda: buf.dispatch_expert_major(fp8, idx, w, experts))
    bad(TypeError, "^x: .*FP8", lambda: buf.dispatch_expert_major(fp8[0], idx, w, experts))
    bad(TypeError, "^x: .*FP8", lambda: buf.dispatch_expert_major_cached(fp8, handle, em, m))
    bad(TypeError, "^x: dtype", lambda: buf.dispatch_expert_major(x.to(torch.int32), idx, w, experts))
    bad(ValueError, r"^topk_idx\[\d+, \d+\] = \d+ is outside \[-1, ", lambda: buf.dispatch_expert_major(x, idx + experts, w, experts))
    bad(ValueError, "^topk_idx: has", lambda: buf.dispatch_expert_major(x, idx[1:], w, experts))
    bad(ValueError, "^topk_weights: shape", lambda: buf.dispatch_expert_major(x, idx, w[:, :1].contiguous(), experts))
    bad(TypeError, "^topk_weights: dtype", lambda: buf.dispatch_expert_major(x, idx, w.double(), experts))
    bad(ValueError, "^num_experts", lambda: buf.dispatch_expert_major(x, idx, w, experts + 1))
    bad(TypeError, "^config", lambda: buf.dispatch_expert_major(x, idx, w, experts, config=3))
    bad(ValueError, "^num_worst_tokens: .*only with expert_capacity",
        lambda: buf.dispatch_expert_major(x, idx, w, experts, num_worst_tokens=64))
    bad(ValueError, "^expert_capacity: ", lambda: buf.dispatch_expert_major(x, idx, w, experts, expert_capacity=-1))
    bad(ValueError, "^num_rows: .*whole blocks",
        lambda: buf.dispatch_expert_major_cached(x, handle, em, m, expert_capacity=m + 1))
    bad(ValueError, "^y_em: .*whole blocks", lambda: buf.combine_expert_major(y_em, handle, em, expert_capacity=m + 1))
    # cached
    bad(TypeError, "^em_map: dtype", lambda: buf.dispatch_expert_major_cached(x, handle, em.long(), m))
    bad(ValueError, "^em_map: has", lambda: buf.dispatch_expert_major_cached(x, handle, em[1:].contiguous(), m))
    bad(ValueError, "^em_map: expected 2", lambda: buf.dispatch_expert_major_cached(x, handle, em.view(-1), m))
    bad(ValueError, "^num_rows: ", lambda: buf.dispatch_expert_major_cached(x, handle, em, m + 1))
    bad(ValueError, "^num_rows: ", lambda: buf.dispatch_expert_major_cached(x, handle, em, -1))
    bad(ValueError, "^x: has", lambda: buf.dispatch_expert_major_cached(x[1:], handle, em, m))
    bad(TypeError, "^handle: ", lambda: buf.dispatch_expert_major_cached(x, None, em, m))
    bad(ValueError, "^handle: .*another Buffer", lambda: other.dispatch_expert_major_cached(x, handle, em, m))
    if m >= 2:
        dup = em.clone()
        dup[dup == 1] = 0  # row 0 named twice, row 1 never
        bad(ValueError, "^em_map: must name each", lambda: buf.dispatch_expert_major_cached(x, handle, dup, m))
    # combine
    bad(ValueError, "^y_em: ", lambda: buf.combine_expert_major(torch.zeros((m + 1, 128), dtype=torch.bfloat16),
                                                                handle, em))
    bad(TypeError, "^y_em: dtype", lambda: buf.combine_expert_major(y_em.to(torch.int16), handle, em))
    bad(TypeError, "^em_map: dtype", lambda: buf.combine_expert_major(y_em, handle, em.long()))
    bad(ValueError, "^em_map: entries", lambda: buf.combine_expert_major(y_em, handle, em - 2))
    bad(ValueError, "^topk_weights: shape", lambda: buf.combine_expert_major(y_em, handle, em, rw[:, :1].contiguous()))
    bad(TypeError, "^topk_weights: dtype", lambda: buf.combine_expert_major(y_em, handle, em, rw.double()))
    bad(TypeError, "^previous_event", lambda: buf.combine_expert_major(y_em, handle, em, previous_event=1))
    # the Buffer still works on every rank: no rank went into a collective
    combined, _, _ = buf.combine_expert_major(y_em, handle, em)
    assert combined.shape == x.shape
    buf.destroy()
    other.destroy()
    return len(seen)


def test_bad_arguments_are_named_before_communication():
    results = run_ranks(_errors, 2)
    assert results[0] == results[1] and results[0] >= 26


# ---- GPU: native against reference -------------------------------------------------------------------
# (tokens of rank r, hidden, topk, experts per rank, mask prob, dtype)
GPU_CASES = [
    (lambda r: 300 + r, 7168, 8, 16, 0.2, torch.bfloat16),
    (lambda r: 300 + r, 7168, 8, 16, 0.2, torch.float32),
    (lambda r: 65, 1000, 6, 8, 0.3, torch.bfloat16),
    (lambda r: 65, 1000, 6, 8, 0.3, torch.float32),
    (lambda r: 0 if r == 1 else 96, 100, 4, 4, 0.5, torch.bfloat16),  # 200-byte rows; a rank sends nothing
    (lambda r: 33, 1001, 3, 4, 0.0, torch.float32),  # hidden not a multiple of 8 elements
    (lambda r: 1, 128, 2, 8, 1.0, torch.bfloat16),  # every slot dropped (-1): nothing moves
    (lambda r: 1500, 7168, 8, 16, 0.2, torch.float32),  # outgrows the 64 MB buffer: the call grows it
]


def _native_vs_reference(rank, world, device, knobs):
    from test_native_intranode import _make_buffers

    # Config.fuse_max_width: the native backend expands / folds inside its kernels up to this fold width,
    # else it runs the separate permute kernels: check both paths, and its own choice (ranks with different
    # widths, e.g. a rank that receives nothing, must still agree on the fresh dispatch's wire format)
    # Config.fold_blocks / expand_blocks: where the fold / expansion does not fuse, it runs on that many
    # blocks beside the combine's / dispatch's (0: the separate permute kernels). The Buffer's default
    # Configs otherwise, as calls without a Config get.
    dispatch_cfg = replace(Buffer.get_dispatch_config(world), **knobs)
    combine_cfg = replace(Buffer.get_combine_config(world), **knobs)

    group = dist.new_group(list(range(world)))
    ref, nat = _make_buffers(group)
    assert nat.expert_major_paths == {}, nat.expert_major_paths  # no call yet
    # the path the knobs force on a rank with rows (auto: the backend's choice per call; a cached dispatch or
    # combine of no rows has fold width 0, which every fuse_max_width lets fuse)
    forced = {"fuse_max_width": {1e9: "fused"}, "expand_blocks": {0: "permute", 3: "side_blocks"}}
    forced_path = forced["expand_blocks"].get(knobs.get("expand_blocks"), forced["fuse_max_width"].get(
        knobs.get("fuse_max_width")))
    checks = 0
    for ci, (ntok, hidden, topk, epr, mask_p, dtype) in enumerate(GPU_CASES):
        experts = epr * world
        n = ntok(rank)
        g = torch.Generator().manual_seed(1000 * ci + rank)
        idx = torch.topk(torch.rand((n, experts), generator=g), topk, dim=1).indices
        idx = idx.masked_fill(torch.rand((n, topk), generator=g) < mask_p, -1).cuda()
        w = torch.rand((n, topk), generator=g).cuda()
        x = torch.randn((n, hidden), generator=g).to(dtype).cuda()
        x2 = torch.randn((n, hidden), generator=g).to(dtype).cuda()
        # exact counts, then (small cases) the sync-free capacity layout: every source's tokens fit a block
        sizes = [(0, 0)]
        if max(ntok(r) for r in range(world)) <= 512:
            sizes.append((sum(ntok(r) for r in range(world)), max(ntok(r) for r in range(world)) + 1))
        for worst, capacity in sizes:
            tag = f"case {ci} ({dtype}, hidden {hidden}{', capacity %d' % capacity if capacity else ''}) rank {rank}"
            outs = {}
            for name, buf in (("ref", ref), ("nat", nat)):
                x_em, ridx, rw, counts, em, handle, _ = buf.dispatch_expert_major(
                    x, idx, w, experts, config=dispatch_cfg, num_worst_tokens=worst, expert_capacity=capacity)
                cached, _ = buf.dispatch_expert_major_cached(x2, handle, em, sum(counts), config=dispatch_cfg,
                                                             expert_capacity=capacity)
                outs[name] = (x_em, ridx, rw, counts, em, handle, cached)
            want = forced_path if sum(outs["nat"][3]) else None
            paths = {k: nat.expert_major_paths.get(k)
                     for k in ("dispatch_expert_major", "dispatch_expert_major_cached")}
            assert want is None or set(paths.values()) == {want}, f"{tag}: {paths} with {knobs}"
            r_, n_ = outs["ref"], outs["nat"]
            assert n_[3] == r_[3], f"{tag}: tokens_per_expert {n_[3]} != {r_[3]}"
            for i, what in ((0, "x_em"), (1, "recv_topk_idx"), (2, "recv_topk_weights"), (4, "em_map"),
                            (6, "cached x_em")):
                _same(n_[i].cpu(), r_[i].cpu(), f"{tag}: {what}")
            m = sum(r_[3])
            y_em = torch.randn((m, hidden), generator=g).to(dtype).cuda()
            for tw in (False, True):
                ry, rwy, _ = ref.combine_expert_major(y_em, r_[5], r_[4], topk_weights=r_[2] if tw else None,
                                                      config=combine_cfg, expert_capacity=capacity)
                ny, nwy, _ = nat.combine_expert_major(y_em, n_[5], n_[4], topk_weights=n_[2] if tw else None,
                                                      config=combine_cfg, expert_capacity=capacity)
                assert want is None or nat.expert_major_paths["combine_expert_major"] == want, \
                    f"{tag}: {nat.expert_major_paths} with {knobs}"
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(ny.float(), ry.float(), rtol=tol, atol=tol, msg=f"{tag}: combine")
                if tw:
                    torch.testing.assert_close(nwy, rwy, rtol=1e-5, atol=1e-5, msg=f"{tag}: combine weights")
                else:
                    assert nwy is None and rwy is None
                checks += 1
            if rank == 0:
                print(f"[native-expert-major] {tag} ok: {m} expert rows, combine exact="
                      f"{bool(torch.equal(_bits(ny), _bits(ry)))}", flush=True)
    ref.destroy()
    nat.destroy()
    return checks


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [{"fuse_max_width": 1e9},
                                   {"fuse_max_width": 0, "fold_blocks": 0, "expand_blocks": 0},
                                   {"fuse_max_width": 0, "fold_blocks": 3, "expand_blocks": 3},
                                   {}],
                         ids=["fused", "separate-permute", "side-blocks", "auto"])
def test_native_expert_major_matches_reference(knobs, mps):
    from uccl_ep_train.backends.native import native_available

    if not native_available():
        pytest.skip("native module built without intranode kernels")
    # two combines per case and size; the capacity layout for the 7 cases of at most 512 tokens
    assert run_ranks(_native_vs_reference, 2, knobs, timeout=300, **gpu_ranks(2)) == [2 * (2 * len(GPU_CASES) - 1)] * 2


# ---- the benchmark -----------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_bench_expert_major_needs_gpus(capsys):
    from uccl_ep_train.apps.bench import expert_major

    with pytest.raises(SystemExit):
        expert_major.main(["--iters", "1"])
    assert "needs CUDA" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_bench_expert_major_small_shape_runs_and_checks_exactness(tmp_path):
    from uccl_ep_train.backends.native import native_available
    from uccl_ep_train.apps.bench import expert_major

    if not native_available():
        pytest.skip("native module built without intranode kernels")
    out = tmp_path / "em.json"
    expert_major.main(["--num-processes", "2", "--num-tokens", "256", "--hidden", "512", "--num-experts", "16",
                       "--sms", "8", "--iters", "2", "--json", str(out)])
    import json
    recs = json.loads(out.read_text())
    assert {r["op"] for r in recs} == {"fresh", "cached", "combine"} and all(r["fused_us"] > 0 for r in recs)
    assert all(r["side_blocks_us"] > 0 for r in recs)
    assert_complete(recs)  # what tests/test_records.py asks of committed records
    assert all(r["timing"] == "api" and r["gpus"] == 2 for r in recs)
    assert all(r["sms_occupied"]["communication"] == 8 for r in recs)


# ---- received rows without local experts --------------------------------------------------------------
def _rows_without_experts(rank, world, device):
    """A handle from a plain dispatch that sends every token to every rank (is_token_in_rank all true), so
    many received rows name no local expert: their fold is zeros. CPU: combine_expert_major equals
    reduce_rows + combine; GPUs: the native backend's fold inside combine equals the reference backend's."""
    fold_inside = replace(Buffer.get_combine_config(world), fuse_max_width=1e9)  # native: fold inside combine
    group = dist.new_group(list(range(world)))
    if device == "cuda":
        from test_native_intranode import _make_buffers

        bufs = dict(zip(("ref", "nat"), _make_buffers(group)))
    else:
        bufs = {"ref": Buffer(group, int(1e6), 0)}
    n, hidden, topk, epr = 64, 256, 2, 4
    experts = epr * world
    g = torch.Generator().manual_seed(rank)
    idx = torch.topk(torch.rand((n, experts), generator=g), topk, dim=1).indices.to(device)
    x = torch.randn((n, hidden), generator=g).to(device)
    outs = {}
    for name, buf in bufs.items():
        _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, experts)
        in_rank = torch.ones((n, world), dtype=torch.bool, device=device)
        per_rank = torch.full((world,), n, dtype=torch.int32, device=device)
        _, ridx, _, counts, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                     num_tokens_per_expert=per_expert, topk_idx=idx)
        em = permute.expert_major_map(ridx, counts)
        assert int((em < 0).all(dim=1).sum()) > 0, "the case needs received rows without local experts"
        y_em = torch.randn((sum(counts), hidden), generator=torch.Generator().manual_seed(7 + rank)).to(device)
        out, _, _ = buf.combine_expert_major(y_em, handle, em, config=fold_inside)
        composed, _, _ = buf.combine(permute.reduce_rows(y_em, em, ridx.size(0)), handle)
        torch.testing.assert_close(out, composed, rtol=1e-6, atol=1e-6)
        outs[name] = out
    if "nat" in outs:
        torch.testing.assert_close(outs["nat"], outs["ref"], rtol=1e-5, atol=1e-5)
    for buf in bufs.values():
        buf.destroy()
    return True


def test_fold_of_rows_without_local_experts_is_zero():
    assert run_ranks(_rows_without_experts, 2, device="cpu") == [True, True]


@pytest.mark.gpu
def test_native_fold_of_rows_without_local_experts_is_zero(mps):
    from uccl_ep_train.backends.native import native_available

    if not native_available():
        pytest.skip("native module built without intranode kernels")
    assert run_ranks(_rows_without_experts, 2, timeout=120, **gpu_ranks(2)) == [True, True]


@pytest.mark.parametrize("R,epr,rank", [(2, 3, 0), (4, 2, 3), (6, 4, 1)])
def test_internode_expert_major_blocks_match_the_permute_map(R, epr, rank):
    """Where an expert-major dispatch across nodes lands its rows (NativeInternodeBackend: each block's base
    from every source's counts, plus the sender's position): the row permute.expert_major_map gives the same
    received row, exact counts; with a capacity, (expert, source) blocks of it, and an overflow names its
    source, count, expert and rank alike on every rank."""
    import numpy as np

    from uccl_ep_train.backends.internode import _ExpertMajor

    g = torch.Generator().manual_seed(R * 100 + epr)
    sent = torch.randint(0, 6, (R, R * epr), generator=g).numpy()  # tokens source s sends to expert e
    em = _ExpertMajor(torch.empty(0), 0)
    em.place(sent, R, R * epr, rank, "cpu")
    mine = sent[:, rank * epr:(rank + 1) * epr]
    assert em.per_expert == mine.sum(0).tolist()
    # the receive order: source by source, each source's rows (one local expert each) in a shuffled order
    rows, where = [], []
    for s in range(R):
        experts = [e for e in range(epr) for _ in range(int(mine[s, e]))]
        order = torch.randperm(len(experts), generator=g).tolist()
        seen = [0] * epr
        for i in order:
            e = experts[i]
            rows.append(e)
            where.append(int(em.em_base[s, e]) + seen[e])  # the sender's position of the row: seen[e]
            seen[e] += 1
    want = permute.expert_major_map(torch.tensor(rows, dtype=torch.int64).view(-1, 1), em.per_expert)
    assert want.view(-1).tolist() == where
    capped = _ExpertMajor(torch.empty(0), 7)
    capped.place(sent, R, R * epr, rank, "cpu")
    assert capped.per_expert == [R * 7] * epr
    assert capped.em_base.tolist() == [[(e * R + s) * 7 for e in range(epr)] for s in range(R)]
    blind = _ExpertMajor(torch.empty(0), 7)  # a sync-free dispatch: the same blocks without the counts
    blind.place(None, R, R * epr, rank, "cpu")
    assert blind.em_base.tolist() == capped.em_base.tolist() and blind.per_expert == capped.per_expert
    over = sent.copy()
    over[R - 1, 1] = 9
    with pytest.raises(ValueError, match=rf"^dispatch_expert_major: rank {R - 1} sends 9 tokens to local expert 1 of "
                                         r"rank 0, more than expert_capacity=8"):
        _ExpertMajor(torch.empty(0), 8).place(np.asarray(over), R, R * epr, rank, "cpu")
