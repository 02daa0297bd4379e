"""High-throughput Buffer calls on spawned ranks, each compared with the dense oracle."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from oracle import dest_ranks, expected_dispatch, expected_per_expert, make_inputs
from uccl_ep_train import Buffer, Config
from uccl_ep_train.fp8 import per_token_cast_back, per_token_cast_to_fp8

# (tokens per rank, a rank with zero tokens?, hidden, topk, experts)
SHAPES = [(37, False, 256, 4, 8), (1, True, 128, 2, 16), (96, True, 512, 8, 32), (0, False, 128, 1, 4)]


def _tokens(rank: int, base: int, zero_rank: bool) -> int:
    return 0 if zero_rank and rank == 1 else base + 3 * rank


def _check_ht(rank: int, world: int, device: str) -> int:
    group = dist.new_group(list(range(world)))
    buf = Buffer(group, int(1e6), 0)
    assert buf.backend_name in ("reference", "native")
    checks = 0
    for si, (base, zero_rank, hidden, topk, experts) in enumerate(SHAPES):
        counts = [_tokens(r, base, zero_rank) for r in range(world)]
        for dtype in (torch.bfloat16, torch.float32):
            seed = 100 * si + (dtype == torch.float32)
            all_in = [make_inputs(r, counts[r], hidden, topk, experts, seed, dtype) for r in range(world)]
            me = all_in[rank]
            x, idx, w = me.x.to(device), me.topk_idx.to(device), me.topk_weights.to(device)

            per_rank, rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
            ref_in_rank = dest_ranks(me.topk_idx, experts, world)
            assert rdma is None
            assert torch.equal(in_rank.cpu(), ref_in_rank)
            assert per_rank.cpu().tolist() == ref_in_rank.sum(0).tolist()
            assert per_expert.cpu().tolist() == [int((me.topk_idx == e).sum()) for e in range(experts)]

            ex_x, ex_idx, ex_w, ex_src, ex_counts = expected_dispatch(all_in, rank, experts)
            for alignment in (1, 4):
                for async_mode, previous in ((False, False), (True, True)):
                    prev = buf.capture() if previous else None
                    recv_x, recv_idx, recv_w, per_exp, handle, ev = buf.dispatch(
                        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=idx, topk_weights=w, expert_alignment=alignment, previous_event=prev,
                        async_finish=async_mode, allocate_on_comm_stream=previous)
                    if async_mode:
                        ev.current_stream_wait()
                    assert torch.equal(recv_x.cpu(), ex_x), "dispatch rows differ from the oracle"
                    assert torch.equal(recv_idx.cpu(), ex_idx)
                    assert torch.equal(recv_w.cpu(), ex_w)
                    assert torch.equal(handle.recv_src_idx.cpu(), ex_src)
                    assert per_exp == expected_per_expert(all_in, rank, experts, alignment)
                    prefix = handle[0].cpu()
                    assert prefix.shape == (world, world) and prefix.dtype == torch.int32
                    assert prefix[:, rank].tolist() == torch.cumsum(torch.tensor(ex_counts), 0).tolist()
                    checks += 1

            # every receiving rank r returns its rows times (r + 1): the combine sums them per token
            factor = (ref_in_rank.float() * torch.arange(1, world + 1).float()).sum(1, keepdim=True)
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5

            # num_worst_tokens: padded outputs, same prefix, empty list
            worst = sum(counts) + 5
            wx, widx, ww, wlist, whandle, _ = buf.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx, topk_weights=w, num_worst_tokens=worst)
            n = ex_x.size(0)
            assert wlist == [] and wx.size(0) == worst and widx.size(0) == worst and ww.size(0) == worst
            assert torch.equal(wx[:n].cpu(), ex_x) and bool((widx[n:] == -1).all())
            # a padded handle: cached dispatch returns padded rows too, combine ignores the padding
            cwx, *_ = buf.dispatch(x, handle=whandle)
            assert cwx.size(0) == worst and torch.equal(cwx[:n].cpu(), ex_x)
            wcomb, _, _ = buf.combine(cwx * (rank + 1), whandle)
            torch.testing.assert_close(wcomb.cpu().float(), me.x.float() * factor, atol=tol * 4, rtol=tol)

            # cached dispatch reproduces the rows; combine sums them back (with weights and biases)
            cx, cidx, cw, clist, chandle, _ = buf.dispatch(x * 2, handle=handle)
            assert cidx is None and cw is None and clist is None and chandle is None
            assert torch.equal(cx.cpu(), ex_x * 2)
            y = recv_x * (rank + 1)
            bias0 = torch.ones_like(x)
            bias1 = torch.full_like(x, 0.5)
            comb, comb_w, _ = buf.combine(y, handle, topk_weights=recv_w, bias=(bias0, bias1))
            expect = me.x.float() * factor + 1.5
            assert comb.dtype == dtype and comb.shape == x.shape
            torch.testing.assert_close(comb.cpu().float(), expect, atol=tol * 4, rtol=tol)
            torch.testing.assert_close(comb_w.cpu(), me.topk_weights.masked_fill(me.topk_idx < 0, 0.0))
            # combine of a worst-padded receive ignores the padding rows
            comb2, _, _ = buf.combine(torch.cat([y, torch.full_like(y[:5], 1e4)]), handle)
            torch.testing.assert_close(comb2.cpu().float(), expect - 1.5, atol=tol * 4, rtol=tol)
            checks += 1
    buf.destroy()
    return checks


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dispatch_combine_match_oracle(world):
    checks = run_ranks(_check_ht, world)
    assert all(c == len(SHAPES) * 2 * 5 for c in checks)


def _check_fp8(rank: int, world: int, device: str) -> None:
    group = dist.new_group(list(range(world)))
    buf = Buffer(group, int(1e6), 0)
    experts, hidden = 8, 256
    all_in = [make_inputs(r, 20 + r, hidden, 3, experts, seed=7) for r in range(world)]
    me = all_in[rank]
    q, scales = per_token_cast_to_fp8(me.x)
    scales_cm = scales.T.contiguous().T  # column-major scales, as DeepEP's own test passes them
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(me.topk_idx.to(device), experts)
    (rq, rs), ridx, rw, _, handle, _ = buf.dispatch(
        (q.to(device), scales_cm.to(device)), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=me.topk_idx.to(device), topk_weights=me.topk_weights.to(device))
    ex_x, ex_idx, _, ex_src, _ = expected_dispatch(all_in, rank, experts)
    all_q = [per_token_cast_to_fp8(inp.x) for inp in all_in]
    ex_q = torch.cat([all_q[s][0][torch.nonzero(dest_ranks(all_in[s].topk_idx, experts, world)[:, rank],
                                                as_tuple=True)[0]] for s in range(world)])
    assert rq.dtype == torch.float8_e4m3fn and rs.dtype == torch.float32
    assert torch.equal(rq.cpu().view(torch.uint8), ex_q.view(torch.uint8)), "FP8 payload must be bit-exact"
    torch.testing.assert_close(per_token_cast_back(rq.cpu(), rs.cpu()).float(), ex_x.float(), atol=0.15, rtol=0.07)
    (cq, cs), *_ = buf.dispatch((q.to(device), scales.to(device)), handle=handle)
    assert torch.equal(cq.cpu().view(torch.uint8), rq.cpu().view(torch.uint8)) and torch.equal(cs, rs)


def test_fp8_dispatch_bit_exact():
    run_ranks(_check_fp8, 2)


def _check_gpu(rank: int, world: int, device: str) -> int:
    return _check_ht(rank, world, device)


@pytest.mark.gpu
def test_dispatch_combine_on_gpus():
    world = 2
    if torch.cuda.device_count() < world:
        pytest.skip("needs 2 GPUs")
    run_ranks(_check_gpu, world, device="cuda")
    run_ranks(_check_fp8, world, device="cuda")


def test_config_and_hints():
    c = Config(24, 8, 256)
    assert c.num_max_rdma_chunked_send_tokens == 6 and c.num_channels == 12
    assert c.get_nvl_buffer_size_hint(7168 * 2, 8) >= 12 * 8 * 256 * 7168 * 2
    assert c.get_nvl_buffer_size_hint(7168 * 2, 8) % 128 == 0
    assert c.get_rdma_buffer_size_hint(7168 * 2, 8) == 0 and c.get_rdma_buffer_size_hint(7168 * 2, 16) > 0
    with pytest.raises(ValueError, match="num_sms"):
        Config(0, 8, 256)
    assert Buffer.get_dispatch_config(4).num_sms == Buffer.num_sms
    assert Buffer.get_combine_config(3).num_max_nvl_chunked_send_tokens == Buffer.get_combine_config(2).num_max_nvl_chunked_send_tokens
    big = Buffer.get_low_latency_rdma_size_hint(128, 7168, 16, 256)
    assert big > Buffer.get_low_latency_rdma_size_hint(64, 7168, 16, 256) > 0


def _capture_refused(rank: int, world: int, device: str) -> int:
    group = dist.new_group(list(range(world)))
    buf = Buffer(group, num_nvl_bytes=1 << 20)
    x = torch.randn(4, 64, device=device).to(torch.bfloat16)
    idx = torch.tensor([[0], [1], [0], [1]], device=device)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 2)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    torch.cuda.synchronize()
    refusals = [
        ("dispatch: cannot be captured in a CUDA graph: a fresh dispatch sizes its outputs .* num_worst_tokens",
         lambda: buf.dispatch(x, topk_idx=idx, **layout)),
        ("dispatch_expert_major: cannot be captured in a CUDA graph: its outputs are sized",
         lambda: buf.dispatch_expert_major(x, idx, None, 2)),
    ]
    if buf.backend_name == "native":  # the small buffer would have to grow: collective, so not in a graph
        big_x, big_idx = torch.randn(4096, 4096, device=device).to(torch.bfloat16), idx.repeat(1024, 1)
        big_rank, _, big_expert, big_in, _ = buf.get_dispatch_layout(big_idx, 2)
        torch.cuda.synchronize()
        refusals.append(("must grow to .* inside CUDA-graph capture", lambda: buf.dispatch(
            big_x, topk_idx=big_idx, num_tokens_per_rank=big_rank, is_token_in_rank=big_in,
            num_tokens_per_expert=big_expert, num_worst_tokens=4096)))
    for pattern, call in refusals:
        with pytest.raises(RuntimeError, match=pattern):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                call()
    out = buf.dispatch(x, topk_idx=idx, **layout)  # outside capture the Buffer still works
    assert torch.equal(out[0].cpu(), x.cpu())
    buf.destroy()
    return 1


def _capture_refused_by_reference(rank: int, world: int, device: str) -> int:
    buf = Buffer(dist.new_group(list(range(world))), num_nvl_bytes=1 << 20)
    assert buf.backend_name == "reference"
    x = torch.randn(4, 64, device=device).to(torch.bfloat16)
    idx = torch.tensor([[0], [1], [0], [1]], device=device)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 2)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="on the reference backend: it synchronises with the host"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                         topk_idx=idx, num_worst_tokens=8)
    buf.destroy()
    return 1


@pytest.mark.gpu
def test_graph_capture_refuses_host_sized_calls_with_a_clear_error():
    """Capture takes only what replays exactly (tests/test_cuda_graphs.py replays it): a fresh dispatch without
    num_worst_tokens, the fresh expert-major dispatch (both size outputs on the host), a call that would grow
    the buffer, and every call of the reference backend raise before any work (a host sync inside capture
    failed with CUDA's own 'operation not permitted')."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert run_ranks(_capture_refused, 1, device="cuda") == [1]
    assert run_ranks(_capture_refused_by_reference, 1, device="cuda", env={"UCCL_EP_BACKEND": "reference"}) == [1]
