"""Native intranode kernels against the reference backend (the oracle), on every visible GPU of one node.

Each rank builds two Buffers on the same NCCL group, one forced to `reference` and one to `native`, runs
the same calls on both and compares: get_dispatch_layout and dispatch bit-exact (BF16 and FP8 + scales,
top-k ids and weights, per-expert counts with alignment, handle layout), cached dispatch bit-exact,
num_worst_tokens padding, async_finish + previous_event + allocate_on_comm_stream, combine (sums + biases,
top-k weights) within float32-reduction tolerance (it is bit-exact in practice: same order of adds).
Routings: random with -1 masks, ranks that send nothing, ranks that receive nothing, 0/1/odd/4096 tokens,
hidden sizes that are not multiples of 16 bytes, DeepSeek-V3's shape. Also: a kernel-side wait times
out with a message naming rank, peer and phase instead of hanging.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import gpu_ranks, run_ranks

pytestmark = pytest.mark.gpu

# (tokens of rank r as a function of r, hidden, topk, experts per rank, mask prob, rank nobody routes to,
#  fp8, num_worst_tokens?)
CASES = [
    (lambda r: 37 + 5 * r, 256, 4, 4, 0.2, None, False, False),
    (lambda r: 1, 128, 2, 8, 0.0, None, False, False),
    (lambda r: 0 if r == 1 else 96, 512, 8, 8, 0.3, None, True, False),
    (lambda r: 300 + r, 1024, 6, 16, 0.1, 0, False, True),
    (lambda r: 65, 100, 3, 4, 0.5, None, False, False),  # 200-byte rows: the 4-byte vector path
    (lambda r: 513, 2048, 8, 32, 0.0, None, True, True),
    (lambda r: 0, 128, 2, 4, 0.0, None, False, False),
    (lambda r: 4096, 7168, 8, 256 // 2, 0.0, None, True, False),  # DeepSeek-V3 (experts per rank at 2 ranks)
]


def _inputs(rank, n, hidden, topk, experts, mask_p, avoid_rank, seed, world):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    scores = torch.rand((n, experts), generator=g)
    epr = experts // world
    if avoid_rank is not None and world > 1:
        scores[:, avoid_rank * epr:(avoid_rank + 1) * epr] = -1.0
    k = min(topk, experts - (epr if avoid_rank is not None and world > 1 else 0))
    idx = torch.topk(scores, k, dim=1).indices.to(torch.int64)
    idx = idx.masked_fill(torch.rand((n, k), generator=g) < mask_p, -1)
    w = torch.rand((n, k), generator=g)
    x = torch.randn((n, hidden), generator=g).to(torch.bfloat16)
    return x, idx, w


def _fp8(x):
    from uccl_ep_train.fp8 import per_token_cast_to_fp8

    return per_token_cast_to_fp8(x)


def _bits(t):
    if t is None:
        return None
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        return t.view(torch.uint8)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t


def _same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one side is None"
        return
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(_bits(a), _bits(b)), f"{what}: differs ({int((_bits(a) != _bits(b)).sum())} elements)"


def _make_buffers(group):
    from uccl_ep_train import Buffer

    old = os.environ.get("UCCL_EP_BACKEND")
    try:
        os.environ["UCCL_EP_BACKEND"] = "reference"
        ref = Buffer(group, int(1e6), 0)
        os.environ["UCCL_EP_BACKEND"] = "native"
        nat = Buffer(group, int(64e6), 0)  # small on purpose: the large cases make it grow
    finally:
        if old is None:
            os.environ.pop("UCCL_EP_BACKEND", None)
        else:
            os.environ["UCCL_EP_BACKEND"] = old
    assert ref.backend_name == "reference" and nat.backend_name == "native"
    return ref, nat


def _check_all(rank, world, device):
    from uccl_ep_train import Config

    group = dist.new_group(list(range(world)))
    ref, nat = _make_buffers(group)
    checks = 0
    for ci, (ntok, hidden, topk, epr, mask_p, avoid, fp8, worst) in enumerate(CASES):
        experts = epr * world
        n = ntok(rank)
        x, idx, w = _inputs(rank, n, hidden, topk, experts, mask_p, avoid, ci, world)
        x, idx, w = x.cuda(), idx.cuda(), w.cuda()
        xin = _fp8(x) if fp8 else x
        for sms, push, batch, ck in ((4, 16, 1, None), (24, None, None, None), (8, 3, 1000000, 2)):
            # warp roles: all push then copy out / default split / mostly copy-out and reduce warps;
            # row flags released after every row / default batch / only at the end of a warp's work;
            # combine's register reduce (default) / its shared-memory staged variant
            cfg = Config(sms, 6, 256, dispatch_push_warps=push, combine_push_warps=push, flag_batch=batch,
                         combine_flag_batch=batch, combine_kernel=ck)
            outs = {}
            for name, buf in (("ref", ref), ("nat", nat)):
                per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
                asyn = name == "nat" and sms == 24
                prev = buf.capture() if asyn else None
                num_worst = max(ntok(r) for r in range(world)) * world if worst else 0
                recv, ridx, rw, counts, handle, ev = buf.dispatch(
                    xin, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                    topk_idx=idx, topk_weights=w, expert_alignment=1 + ci % 3, num_worst_tokens=num_worst,
                    config=cfg, previous_event=prev, async_finish=asyn, allocate_on_comm_stream=asyn)
                if asyn:
                    ev.current_stream_wait()
                cached, *_ = buf.dispatch(xin, handle=handle, config=cfg)
                outs[name] = (per_rank, per_expert, in_rank, recv, ridx, rw, counts, handle, cached)
            r_, n_ = outs["ref"], outs["nat"]
            tag = f"case {ci} sms {sms} rank {rank}"
            for i, what in enumerate(("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank")):
                _same(n_[i], r_[i], f"{tag}: {what}")
            rh, nh = r_[7], n_[7]
            num_recv = int(rh.rank_prefix_matrix[-1, rank])  # valid rows (num_recv_tokens counts padding)
            _same(nh.rank_prefix_matrix, rh.rank_prefix_matrix, f"{tag}: rank_prefix_matrix")
            _same(nh.send_head, rh.send_head, f"{tag}: send_head")
            _same(nh.channel_prefix_matrix, rh.channel_prefix_matrix, f"{tag}: channel_prefix_matrix")
            _same(nh.recv_channel_prefix_matrix, rh.recv_channel_prefix_matrix, f"{tag}: recv_channel_prefix_matrix")
            _same(nh.recv_src_idx[:num_recv], rh.recv_src_idx[:num_recv], f"{tag}: recv_src_idx")
            rx, nx = (r_[3], n_[3]) if fp8 else ((r_[3], None), (n_[3], None))
            rcx, ncx = (r_[8], n_[8]) if fp8 else ((r_[8], None), (n_[8], None))
            if worst:
                assert nx[0].size(0) == num_worst and n_[6] == [], f"{tag}: worst-case padding"
                assert torch.all(n_[4][num_recv:] == -1) and torch.all(n_[5][num_recv:] == 0), f"{tag}: padding"
                assert torch.all(_bits(nx[0][num_recv:]) == 0), f"{tag}: x padding"
                assert torch.all(nh.recv_src_idx[num_recv:] == -1), f"{tag}: src padding"
            else:
                assert n_[6] == r_[6], f"{tag}: num_recv_tokens_per_expert_list {n_[6]} != {r_[6]}"
                assert nh.num_recv_tokens == num_recv
            _same(nx[0][:num_recv], rx[0][:num_recv], f"{tag}: recv_x")
            _same(None if nx[1] is None else nx[1][:num_recv], None if rx[1] is None else rx[1][:num_recv],
                  f"{tag}: recv_x_scales")
            _same(n_[4][:num_recv], r_[4][:num_recv], f"{tag}: recv_topk_idx")
            _same(n_[5][:num_recv], r_[5][:num_recv], f"{tag}: recv_topk_weights")
            _same(ncx[0][:num_recv], rcx[0][:num_recv], f"{tag}: cached recv_x")
            _same(None if ncx[1] is None else ncx[1][:num_recv], None if rcx[1] is None else rcx[1][:num_recv],
                  f"{tag}: cached recv_x_scales")

            # combine: the same expert outputs on both (each handle counts its own padding rows; they are ignored)
            g = torch.Generator().manual_seed(77 + ci)
            rows = torch.randn((nh.num_recv_tokens, hidden), generator=g).to(torch.bfloat16).cuda()
            bias = (torch.randn((n, hidden), generator=g).to(torch.bfloat16).cuda(),
                    torch.randn((n, hidden), generator=g).to(torch.bfloat16).cuda())
            for use_bias in (False, True):
                b = bias if use_bias else None
                ry, rwy, _ = ref.combine(rows[:rh.num_recv_tokens], rh, topk_weights=r_[5], bias=b, config=cfg)
                ny, nwy, _ = nat.combine(rows, nh, topk_weights=n_[5], bias=b, config=cfg)
                torch.testing.assert_close(ny.float(), ry.float(), rtol=1e-2, atol=1e-2, msg=f"{tag}: combine")
                torch.testing.assert_close(nwy, rwy, rtol=1e-5, atol=1e-5, msg=f"{tag}: combine weights")
                checks += 1
            if rank == 0:
                print(f"[native-intranode] {tag} ok: {num_recv} rows received, combine exact="
                      f"{bool(torch.equal(_bits(ny), _bits(ry)))}", flush=True)
            checks += 1
    ref.destroy()
    nat.destroy()
    return checks


def test_native_matches_reference(mps):
    from uccl_ep_train.backends.native import native_available

    if not native_available():
        pytest.skip("native module built without intranode kernels")
    world = min(max(torch.cuda.device_count(), 2), 8)
    results = run_ranks(_check_all, world, timeout=900, **gpu_ranks(world))
    assert all(r > 0 for r in results)


def _timeout(rank, world, device):
    from uccl_ep_train import Buffer

    os.environ["UCCL_EP_BACKEND"] = "native"
    os.environ["UCCL_EP_TIMEOUT_S"] = "2"
    group = dist.new_group(list(range(world)))
    buf = Buffer(group, int(64e6), 0)
    idx = torch.randint(0, 2 * world, (64, 2), device="cuda")
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 2 * world)
    x = torch.randn(64, 128, device="cuda").to(torch.bfloat16)
    _, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                         num_tokens_per_expert=per_expert, topk_idx=idx)
    msg = ""
    if rank == 0:  # rank 1 never joins this cached dispatch: rank 0's kernel must give up, not hang
        buf.dispatch(x, handle=handle)
        torch.cuda.synchronize()
        try:
            buf.backend.check_errors()
        except RuntimeError as exc:
            msg = str(exc)
        assert "rank 0 timed out after" in msg and "dispatch" in msg, msg
    dist.barrier()
    if rank == 1:  # rank 0's report reached rank 1's buffer: its next call raises it, at once
        start = time.monotonic()
        try:
            buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                         topk_idx=idx)
        except RuntimeError as exc:
            msg = str(exc)
        took = time.monotonic() - start
        assert "rank 0 timed out after" in msg and "rank 0 reported it" in msg, msg
        assert took < 1.5, f"rank 1 learnt of rank 0's error after {took:.2f}s (its own timeout is 2 s)"
    dist.barrier()
    buf.destroy()
    return msg


def test_native_wait_times_out_with_message(mps):
    from uccl_ep_train.backends.native import native_available

    if not native_available():
        pytest.skip("native module built without intranode kernels")
    results = run_ranks(_timeout, 2, timeout=300, **gpu_ranks(2))
    assert "rank 0 timed out after" in results[0] and "rank 0 reported it" in results[1]


def _streams(rank, world, device):
    """Synchronous calls return no event and run on the current stream; one on a second stream moves the
    Buffer to its comm stream, which first waits for the calls issued on the first (results stay exact)."""
    group = dist.new_group(list(range(world)))
    ref, nat = _make_buffers(group)
    x, idx, w = _inputs(rank, 257, 512, 4, 8 * world, 0.1, None, 11, world)
    x, idx, w = x.cuda(), idx.cuda(), w.cuda()

    def round_trip(buf):
        per_rank, _, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, 8 * world)
        recv_x, _, recv_w, _, handle, ev2 = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                         num_tokens_per_expert=per_expert, topk_idx=idx,
                                                         topk_weights=w, previous_event=ev)
        out, _, ev3 = buf.combine(recv_x, handle, topk_weights=recv_w)
        return recv_x, out, (ev, ev2, ev3)

    want_x, want_out, _ = round_trip(ref)
    got_x, got_out, events = round_trip(nat)
    assert all(e.event is None for e in events), "a synchronous call returned an event (DeepEP returns none)"
    assert not nat._comm_used
    _same(got_x, want_x, "dispatch on the current stream")
    _same(got_out, want_out, "combine on the current stream")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got_x, got_out, _ = round_trip(nat)
    torch.cuda.current_stream().wait_stream(side)
    assert nat._comm_used, "a synchronous call on a second stream must move the Buffer to its comm stream"
    _same(got_x, want_x, "dispatch on a second stream")
    _same(got_out, want_out, "combine on a second stream")
    torch.cuda.synchronize()
    ref.destroy()
    nat.destroy()
    return True


def test_synchronous_calls_follow_the_current_stream(mps):
    from uccl_ep_train.backends.native import native_available

    if not native_available():
        pytest.skip("native module built without intranode kernels")
    assert all(run_ranks(_streams, 2, timeout=300, **gpu_ranks(2)))
