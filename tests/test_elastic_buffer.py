"""DeepEP V2's ElasticBuffer call shapes over our Buffer (uccl_ep_train.elastic), checked on CPU gloo ranks
against a dense oracle (every rank regenerates every rank's inputs): the expanding layout with expert
alignment, with and without a CPU sync, cached dispatches, the expanded and plain combines, the handle's
counts, and `import deep_ep` giving it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dist_utils import run_ranks
from oracle import make_inputs

HIDDEN, TOPK, EXPERTS_PER_RANK, MAX_TOKENS, SEED = 32, 3, 3, 9, 5


def _inputs(rank: int, world: int, dtype: torch.dtype = torch.float32):
    # uneven token counts (V2's test does the same); float32 on CPU so sums compare tightly, bf16 on GPUs
    n = MAX_TOKENS - rank % 3
    inp = make_inputs(rank, n, HIDDEN, TOPK, EXPERTS_PER_RANK * world, SEED, dtype=dtype)
    w = inp.topk_weights.masked_fill(inp.topk_idx < 0, 0)
    return inp.x, inp.topk_idx, w


def _expected_expanded(rank: int, world: int, align: int, dtype: torch.dtype):
    """For each local expert: the (source rank, token, slot) list in V2's deterministic order."""
    L = EXPERTS_PER_RANK
    per_expert = [[] for _ in range(L)]
    for s in range(world):
        x, idx, w = _inputs(s, world, dtype)
        for t in range(x.size(0)):
            for j in range(TOPK):
                e = int(idx[t, j])
                if e >= 0 and e // L == rank:
                    per_expert[e % L].append((s, t, j, x[t], float(w[t, j])))
    starts, rows = [], 0
    for e in range(L):
        starts.append(rows)
        rows += (len(per_expert[e]) + align - 1) // align * align
    return per_expert, starts, rows


def _round_trip(rank: int, world: int, device: str, align: int, sync: bool, dtype: torch.dtype = torch.float32,
                hidden: int = HIDDEN) -> dict:
    from uccl_ep_train.elastic import ElasticBuffer
    L = EXPERTS_PER_RANK
    x, idx, w = _inputs(rank, world, dtype)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    buf = ElasticBuffer(torch.distributed.group.WORLD, num_max_tokens_per_rank=MAX_TOKENS, hidden=hidden,
                        num_topk=TOPK, explicitly_destroy=True)
    stats = torch.zeros(L, dtype=torch.int32, device=dev)
    out = buf.dispatch(x.to(dev), topk_idx=idx.to(dev), topk_weights=w.to(dev), num_experts=L * world,
                       expert_alignment=align, do_expand=True, do_cpu_sync=sync,
                       cumulative_local_expert_recv_stats=stats)
    out[-1].current_stream_wait()
    recv_x, recv_idx, recv_w, h = out[0].cpu(), out[1], out[2].cpu(), out[3]
    stats = stats.cpu()
    per_expert, starts, rows = _expected_expanded(rank, world, align, dtype)
    counts = [len(p) for p in per_expert]
    assert recv_idx is None and h.do_expand and h.expert_alignment == align
    if sync:
        assert recv_x.size(0) == rows == h.num_expanded_tokens
        assert h.num_recv_tokens_per_expert_list == [(c + align - 1) // align * align for c in counts]
    else:  # V2's worst case, nothing read on the host
        worst = world * MAX_TOKENS * min(TOPK, L) + (align - 1) * L
        assert recv_x.size(0) == (worst + align - 1) // align * align == h.num_expanded_tokens
        assert h.num_recv_tokens_per_expert_list == [] and h.num_recv_tokens == world * MAX_TOKENS
    assert stats.tolist() == counts
    assert h.num_unaligned_recv_tokens_per_expert.cpu().tolist() == counts
    assert h.psum_num_recv_tokens_per_expert.tolist() == [starts[e] + counts[e] for e in range(L)]
    named = torch.zeros(recv_x.size(0), dtype=torch.bool)
    for e in range(L):
        for i, (s, t, j, row, weight) in enumerate(per_expert[e]):
            r = starts[e] + i
            assert torch.equal(recv_x[r], row), (e, i)
            assert recv_w[r].item() == weight
            named[r] = True
    assert not recv_x[~named].any() and not recv_w[~named].any(), "padding rows are zero"
    received = sum(1 for s in range(world) for t in range(_inputs(s, world)[0].size(0))
                   if any(int(e) >= 0 and int(e) // L == rank for e in _inputs(s, world)[1][t]))
    assert int(h.psum_num_recv_tokens_per_scaleup_rank[-1]) == received
    meta = h.recv_src_metadata[:received].cpu()
    assert (meta[:, 0] // MAX_TOKENS == meta[:, 1]).all() and meta[:, 1].diff().ge(0).all()

    # cached dispatch: the same rows, no top-k
    cached_x, cached_idx, cached_w, h2, _ = buf.dispatch(x.to(dev), handle=h, do_expand=True)
    assert h2 is h and cached_idx is None and cached_w is None and torch.equal(cached_x.cpu(), recv_x)

    # expanded combine: expert rows scaled by (local expert + 1), folded here, summed over ranks
    scale = torch.zeros(recv_x.size(0), 1)
    for e in range(L):
        scale[starts[e]:starts[e] + counts[e]] = e + 1
    y = (recv_x.float() * scale).to(dtype)
    combined, combined_w, _ = buf.combine(y.to(dev), h, topk_weights=recv_w.to(dev))
    expect = torch.zeros(x.shape)
    for t in range(x.size(0)):
        for j in range(TOPK):
            if idx[t, j] >= 0:
                expect[t] += x[t].float() * (int(idx[t, j]) % L + 1)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(combined.cpu().float(), expect, rtol=tol, atol=tol)
    assert torch.equal(combined_w.cpu(), w), "a round trip gives back the sender's top-k weights"
    # a bias takes the unfused fold (Buffer.combine adds it): the same sums plus the bias
    bias = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank)).to(dtype)
    with_bias, _, _ = buf.combine(y.to(dev), h, bias=bias.to(dev))
    torch.testing.assert_close(with_bias.cpu().float(), expect + bias.float(), rtol=tol, atol=tol)
    assert h.fused == (sync and align == 1)
    with pytest.raises(ValueError, match="expanded rows"):
        buf.combine(y[:-1].to(dev), h)
    buf.destroy()
    return {"rows": recv_x.size(0)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("align,sync", [(1, True), (4, True), (4, False)])
def test_expanding_dispatch_and_combine_match_the_oracle(world, align, sync):
    run_ranks(_round_trip, world, align, sync)


def _plain(rank: int, world: int, device: str) -> int:
    """Non-expand mode: V1's receive-order rows (our Buffer.dispatch), with and without a CPU sync."""
    from uccl_ep_train.elastic import ElasticBuffer
    L = EXPERTS_PER_RANK
    x, idx, w = _inputs(rank, world)
    buf = ElasticBuffer(torch.distributed.group.WORLD, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                        explicitly_destroy=True)
    rx, ridx, rw, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=L * world)
    n = rx.size(0)
    assert h.num_recv_tokens == n and int(h.psum_num_recv_tokens_per_scaleup_rank[-1]) == n
    assert h.psum_num_recv_tokens_per_expert.tolist()[-1] == int((ridx >= 0).sum())
    px, pidx, pw, ph, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=L * world, do_cpu_sync=False)
    assert px.size(0) == world * MAX_TOKENS and h.num_recv_tokens_per_expert_list
    assert torch.equal(px[:n], rx) and torch.equal(pidx[:n], ridx) and (pidx[n:] == -1).all()
    combined, cw, _ = buf.combine(rx, h, topk_weights=rw)
    # the sum over the ranks each token went to: x times the number of its destination ranks
    dests = torch.zeros(x.size(0))
    for t in range(x.size(0)):
        dests[t] = len({int(e) // L for e in idx[t] if e >= 0})
    torch.testing.assert_close(combined, x * dests.unsqueeze(1), rtol=1e-6, atol=1e-6)
    assert torch.equal(cw, w)
    pcombined, _, _ = buf.combine(px, ph)
    torch.testing.assert_close(pcombined, combined, rtol=0, atol=0)
    cached, cidx, _, _, _ = buf.dispatch(x, handle=h)
    assert torch.equal(cached, rx) and torch.equal(cidx, ridx)
    buf.destroy()
    return n


@pytest.mark.parametrize("world", [2, 4])
def test_plain_dispatch_and_combine(world):
    run_ranks(_plain, world)


def _refusals(rank: int, world: int, device: str) -> int:
    from uccl_ep_train.elastic import ElasticBuffer
    g = torch.distributed.group.WORLD
    with pytest.raises(NotImplementedError, match="num_cpu_bytes"):
        ElasticBuffer(g, num_bytes=1 << 20, num_cpu_bytes=1 << 21)
    with pytest.raises(ValueError, match="pass num_bytes, or hidden"):
        ElasticBuffer(g)
    buf = ElasticBuffer(g, num_max_tokens_per_rank=4, hidden=HIDDEN, explicitly_destroy=True)
    x, idx, w = _inputs(rank, world)
    with pytest.raises(ValueError, match="num_max_tokens_per_rank"):  # 9 tokens, a buffer made for 4
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=EXPERTS_PER_RANK * world)
    with pytest.raises(NotImplementedError, match="use_tma_aligned_col_major_sf"):
        buf.dispatch(x, topk_idx=idx, num_experts=EXPERTS_PER_RANK * world, num_max_tokens_per_rank=MAX_TOKENS,
                     use_tma_aligned_col_major_sf=True)
    with pytest.raises(ValueError, match="do_zero_padding needs do_expand"):
        buf.dispatch(x, topk_idx=idx, num_experts=EXPERTS_PER_RANK * world, num_max_tokens_per_rank=MAX_TOKENS,
                     do_zero_padding=True)
    buf.destroy()
    return 1


def test_unsupported_options_are_refused_by_name():
    run_ranks(_refusals, 2)


PROBE = textwrap.dedent('''
    import deep_ep, torch, uccl_ep_train.elastic as E
    from deep_ep import ElasticBuffer, EPHandle, Buffer
    assert ElasticBuffer is E.ElasticBuffer and EPHandle is E.EPHandle and deep_ep.topk_idx_t is torch.int64
    print("ok")
''')


def test_deep_ep_exports_elastic_buffer(tmp_path):
    from uccl_ep_train.compat import deep_ep_path
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([deep_ep_path(), repo, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("align,sync", [(1, True), (4, False)])
def test_elastic_calls_on_gpus(mps, backend, align, sync):
    """The same oracle on GPUs, bf16 rows of 256 values: on the native backend (our kernels and the native
    permutation kernels) and on the reference backend."""
    from dist_utils import gpu_ranks
    run_ranks(_round_trip, 2, align, sync, torch.bfloat16, 256, timeout=600, env={"UCCL_EP_BACKEND": backend},
              **gpu_ranks(2))
