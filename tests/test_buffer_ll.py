"""Low-latency dispatch/combine on spawned ranks against the dense oracle: the reference backend on CPU ranks;
the native LL kernels on GPUs (tests/test_low_latency_gpu.py runs the same check there, on one GPU too)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from oracle import make_inputs
from uccl_ep_train import Buffer
from uccl_ep_train.fp8 import per_token_cast_back, per_token_cast_to_fp8


def _expected_expert_rows(all_in, expert: int):
    """(source rank, token index) pairs expert receives: by source rank, then token."""
    pairs = []
    for src, inp in enumerate(all_in):
        toks = torch.nonzero((inp.topk_idx == expert).any(dim=1), as_tuple=True)[0]
        pairs += [(src, int(t)) for t in toks]
    return pairs


def ll_checks(hidden: int) -> int:
    """How many checks _check_ll passes: 2 x 2 per mode (hook or not, zero_copy or not); 4 modes, 3 without UE8M0."""
    return 16 if hidden % 512 == 0 else 12


def _settle_stream(device) -> None:
    """Before reading GPU results into pageable memory: the copy would hold the CUDA driver until the kernels
    queued before it ran, and with the proxies on the fabric transport (shm copies GPU memory through the
    driver) those kernels wait for the proxies (docs/internode.md, "Host copies and the fabric transport")."""
    from uccl_ep_train.events import await_current_stream

    await_current_stream(device)


def _check_ll(rank: int, world: int, device: str, max_tokens: int, hidden: int, experts: int,
              topk: int) -> tuple[int, str]:
    """Every LL mode (BF16, FP8, FP8 with round_scale, UE8M0; hook or not; zero_copy or not) against the oracle,
    the hook both on the current stream (before any async_finish call) and on the comm stream (after); UE8M0
    only where hidden is a multiple of 512 (its exponents pack 4 per int32). Returns (checks passed, class name
    of the backend that served the LL calls)."""
    group = dist.new_group(list(range(world)))
    rdma = Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world, experts)
    buf = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=experts // world)
    local = experts // world
    counts = [max_tokens - r % 3 if max_tokens > 2 else max_tokens for r in range(world)]
    if world > 2:
        counts[1] = 0  # a rank with no tokens at all is a normal case
    all_in = [make_inputs(r, counts[r], hidden, topk, experts, seed=11) for r in range(world)]
    me = all_in[rank]
    x, idx, w = me.x.to(device), me.topk_idx.to(device), me.topk_weights.to(device)
    checks = 0
    modes = [(False, False, False), (True, False, False), (True, True, False)]
    if hidden % 512 == 0:
        modes.append((True, True, True))
    for use_fp8, round_scale, ue8m0 in modes:
        for hook_mode in (True, False):  # hook first: on the current stream while the Buffer has not overlapped
            stats = torch.zeros(local, dtype=torch.int32, device=device)
            recv, recv_count, handle, event, hook = buf.low_latency_dispatch(
                x, idx, max_tokens, experts, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
                round_scale=round_scale, use_ue8m0=ue8m0, async_finish=not hook_mode, return_recv_hook=hook_mode)
            hook() if hook_mode else event.current_stream_wait()
            _settle_stream(device)
            if use_fp8:
                q, s = recv
                assert q.shape == (local, world * max_tokens, hidden)
                assert s.stride(1) == 1, "scales are column-major in the last two dims"
                values = torch.stack([per_token_cast_back(q[e].cpu(), s[e].cpu()) for e in range(local)])
            else:
                values = recv.cpu()
                assert recv.shape == (local, world * max_tokens, hidden) and recv.dtype == torch.bfloat16
            src_info, layout = handle[0].cpu(), handle[1].cpu()
            for e in range(local):
                pairs = _expected_expert_rows(all_in, rank * local + e)
                n = len(pairs)
                assert int(recv_count[e]) == n == int(stats[e])
                assert src_info[e, :n].tolist() == [t for _, t in pairs]
                for src in range(world):
                    begin, cnt = int(layout[e, src]) >> 32, int(layout[e, src]) & 0xFFFFFFFF
                    rows = [i for i, (s, _) in enumerate(pairs) if s == src]
                    assert cnt == len(rows) and (cnt == 0 or begin == rows[0])
                ref = torch.stack([all_in[s].x[t] for s, t in pairs]) if n else torch.zeros(0, hidden)
                if not use_fp8:
                    assert torch.equal(values[e, :n], ref)
                else:
                    if n:  # the cast runs where the data lives: the oracle casts on the same device
                        fq, fs = per_token_cast_to_fp8(ref.to(device), round_scale=round_scale, use_ue8m0=ue8m0)
                        fq, fs = fq.cpu(), fs.cpu()
                        assert torch.equal(q[e, :n].cpu().view(torch.uint8), fq.view(torch.uint8))
                        torch.testing.assert_close(values[e, :n].float(), per_token_cast_back(fq, fs).float())
            # combine: expert output = its input value * (global expert id + 1); weighted sum back home
            sim = torch.zeros((local, world * max_tokens, hidden), dtype=torch.bfloat16)
            for e in range(local):
                sim[e] = (values[e].float() * (rank * local + e + 1)).to(torch.bfloat16)
            sim = sim.to(device)
            for zero_copy in (False, True):
                if zero_copy:
                    buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = sim
                out = torch.empty_like(x)
                combined, event, chook = buf.low_latency_combine(
                    sim, idx, w, handle, zero_copy=zero_copy, async_finish=not hook_mode,
                    return_recv_hook=hook_mode, out=out)
                chook() if hook_mode else event.current_stream_wait()
                _settle_stream(device)
                assert combined.data_ptr() == out.data_ptr()
                base = me.x.float() if not use_fp8 else per_token_cast_back(*[t.cpu() for t in per_token_cast_to_fp8(
                    me.x.to(device), round_scale=round_scale, use_ue8m0=ue8m0)]).float()
                factor = (me.topk_weights * (me.topk_idx + 1).float()).masked_fill(me.topk_idx < 0, 0).sum(1, keepdim=True)
                torch.testing.assert_close(combined.cpu().float(), base * factor, atol=0.08, rtol=0.03)
                checks += 1
    served_by = type(buf.low_latency_backend).__name__
    buf.clean_low_latency_buffer(max_tokens, hidden, experts)
    buf.destroy()
    return checks, served_by


@pytest.mark.parametrize("world,hidden", [(1, 512), (2, 512), (4, 512), (2, 384)])
def test_low_latency_matches_oracle(world, hidden):
    assert run_ranks(_check_ll, world, 9, hidden, 8, 3) == [(ll_checks(hidden), "ReferenceBackend")] * world


def test_low_latency_layout_sends_a_token_once_per_rank():
    """The one LL layout: a dispatch block holds its counts header, a row index for every row a source can send
    (M x min(top-k limit, L)) and one message per token (a token crosses to a rank once, however many of its
    experts live there); the areas of each half follow each other without overlap; the region's first bytes
    hold what the built native module keeps there (error words, counters)."""
    from uccl_ep_train.backends import low_latency as LL
    M, H, R, E = 128, 7168, 4, 256
    lay = LL.low_latency_layout(M, H, R, E)
    L = E // R
    assert lay.slots == M * min(LL.MAX_TOPK, L) and lay.idx_bytes >= 4 * lay.slots and lay.hdr_bytes >= 4 * L
    need = lay.hdr_bytes + lay.idx_bytes + M * lay.msg_bytes
    assert need <= lay.block_bytes < need + 256 and lay.cblock_bytes >= lay.slots * 2 * H
    ends = []
    for d_send, d_recv, c_send, c_recv, c_zero in lay.areas:
        ends += [(d_send, R * lay.block_bytes), (d_recv, R * lay.block_bytes), (c_send, R * lay.cblock_bytes),
                 (c_recv, R * lay.cblock_bytes), (c_zero, L * R * M * 2 * H)]
    ordered = sorted(ends)
    assert ordered[0][0] >= LL._SIGNALS + 4 * 8 * R  # after the error words, counters and signals
    assert all(a + n <= b for (a, n), (b, _) in zip(ordered, ordered[1:])) and ordered[-1][0] + ordered[-1][1] <= \
        lay.total_bytes
    assert lay.proxied_end <= min(off for off, _ in ends[4::5])  # the proxied areas come first
    try:
        from uccl_ep_train import _native
    except ImportError:
        pytest.skip("native module not built")
    if hasattr(_native, "LL_COUNTER_BYTES"):
        assert _native.LL_ERROR_WORDS_BYTES <= LL._ERROR_WORDS
        assert _native.LL_COUNTER_BYTES <= LL._COUNTERS_BYTES
        assert _native.LL_MSG_HEADER_BYTES == LL._MSG_HEADER
        assert all(len(half) == _native.LL_LAYOUT_FIELDS for half in lay.kernel_args)
