"""Expert-major permutation (uccl_ep_train.permute) against a dense oracle, on CPU and (native kernels) GPU.

The oracle builds the alltoall dispatcher's order directly: for each local expert, the received rows that
selected it, in row order. expand/reduce must reproduce it, be each other's adjoint (autograd), and the
native kernels must match the torch path bit for bit (fp32 sums in the same slot order).
"""
from __future__ import annotations

import pytest
import torch

from uccl_ep_train import permute


def _routing(n, k, experts, seed, mask_p=0.3):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(2 * experts, generator=g)[:k] for _ in range(n)]) if n else \
        torch.empty((0, k), dtype=torch.int64)
    idx = torch.where(idx < experts, idx, -1)  # about half the slots name another rank's experts
    idx = idx.masked_fill(torch.rand(idx.shape, generator=g) < mask_p, -1)
    counts = [int((idx == e).sum()) for e in range(experts)]
    return idx, counts


def _oracle_rows(idx, experts):
    rows, slots = [], []
    for e in range(experts):
        for i in range(idx.size(0)):
            for j in range(idx.size(1)):
                if int(idx[i, j]) == e:
                    rows.append(i)
                    slots.append(j)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(slots, dtype=torch.long)


@pytest.mark.parametrize("n,k,experts", [(0, 2, 3), (1, 1, 1), (17, 4, 3), (64, 8, 16), (50, 6, 5)])
def test_map_expand_reduce_match_oracle(n, k, experts):
    idx, counts = _routing(n, k, experts, seed=n * 31 + k)
    dst = permute.expert_major_map(idx, counts)
    rows, slots = _oracle_rows(idx, experts)
    m = sum(counts)
    assert dst.dtype == torch.int32 and dst.shape == idx.shape
    assert torch.equal(dst[rows, slots].long(), torch.arange(m)), "expert-major rows in alltoall order"
    assert int((dst >= 0).sum()) == m and torch.all(dst[idx < 0] == -1)

    x = torch.randn(n, 12, dtype=torch.float64, requires_grad=True)
    w = torch.rand(n, k, dtype=torch.float64, requires_grad=True)
    out = permute.expand_rows(x, dst, m)
    probs = permute.expand_probs(w, dst, m)
    assert torch.equal(out, x[rows]) and torch.equal(probs, w[rows, slots])
    folded = permute.reduce_rows(out * probs[:, None], dst, n)
    dense = torch.zeros(n, 12, dtype=torch.float64).index_add(0, rows, x[rows] * w[rows, slots][:, None])
    torch.testing.assert_close(folded, dense)
    if n:
        torch.autograd.gradcheck(lambda a, b: permute.reduce_rows(permute.expand_rows(a, dst, m) *
                                                                  permute.expand_probs(b, dst, m)[:, None], dst, n),
                                 (x, w))


def test_bad_arguments_are_named():
    idx, counts = _routing(8, 2, 4, seed=1)
    dst = permute.expert_major_map(idx, counts)
    with pytest.raises(ValueError, match="dst"):
        permute.expand_rows(torch.randn(8, 4), dst.long(), sum(counts))
    with pytest.raises(ValueError, match="x: expected 8 rows"):
        permute.expand_rows(torch.randn(7, 4), dst, sum(counts))
    with pytest.raises(ValueError, match="weights"):
        permute.expand_probs(torch.rand(8, 3), dst, sum(counts))
    with pytest.raises(ValueError, match="topk_idx"):
        permute.expert_major_map(idx.reshape(-1), counts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k,experts,hidden", [(1, 1, 1, 8), (300, 8, 128, 7168), (77, 6, 9, 100), (5, 3, 2, 3),
                                                 (700, 5, 7, 1)])  # one element per row: one thread per row
def test_native_kernels_match_torch_path(dtype, n, k, experts, hidden):
    if permute._native() is None:
        pytest.skip("native module built without the permutation kernels")
    idx, counts = _routing(n, k, experts, seed=hidden + n)
    m = sum(counts)
    dst_cpu = permute.expert_major_map(idx, counts)
    dst = permute.expert_major_map(idx.cuda(), counts)
    assert torch.equal(dst.cpu(), dst_cpu)
    x = torch.randn(n, hidden).to(dtype)
    y = torch.randn(m, hidden).to(dtype)
    assert torch.equal(permute.expand_rows(x.cuda(), dst, m).cpu(), permute.expand_rows(x, dst_cpu, m))
    ref = permute.reduce_rows(y, dst_cpu, n)
    got = permute.reduce_rows(y.cuda(), dst, n).cpu()
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), "fp32 sums in slot order, bit-exact"
    # odd offsets: the kernels fall back from 16-byte vectors
    xs = torch.randn(n, hidden + 1).to(dtype).cuda()[:, 1:]
    assert torch.equal(permute.expand_rows(xs.contiguous(), dst, m).cpu(), permute.expand_rows(xs.cpu(), dst_cpu, m))
    # no local rows at all (the backward of an expand whose rows all went elsewhere): zeros, not garbage
    none = torch.full((3, k), -1, dtype=torch.int32, device="cuda")
    assert torch.all(permute.reduce_rows(torch.empty(0, hidden, dtype=dtype, device="cuda"), none, 3) == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("experts", [0, 1, 5])
def test_native_map_writes_every_slot(experts):
    """The map kernel's output needs no fill: ids of other ranks' experts (>= experts, < 0) and repeated ids
    come out -1 over memory full of stale values."""
    if permute._native() is None:
        pytest.skip("native module built without the permutation kernels")
    g = torch.Generator().manual_seed(experts)
    idx = torch.randint(-1, 2 * experts + 2, (200, 6), generator=g)
    if experts:
        idx[0, :] = torch.tensor([0, 0, -1, 2 * experts + 1, 0, 0])  # a repeated id
    first = [sorted({int(v) for v in row if 0 <= v < experts}) for row in idx]
    counts = [sum(e in row for row in first) for e in range(experts)]
    dedup = idx.clone()
    for i in range(idx.size(0)):  # the CPU oracle's input: a repeated id keeps its first slot only
        seen = set()
        for j in range(idx.size(1)):
            v = int(idx[i, j])
            if v in seen:
                dedup[i, j] = -1
            seen.add(v)
    want = permute.expert_major_map(dedup, counts)
    idx_gpu = idx.cuda()
    counts_gpu = torch.tensor(counts or [0], dtype=torch.int32, device="cuda")
    got = torch.full(idx.shape, 12345, dtype=torch.int32, device="cuda")  # stale values to be overwritten
    permute._native().expert_major_map(idx_gpu.data_ptr(), idx.size(0), idx.size(1), experts, counts_gpu.data_ptr(),
                                       got.data_ptr(), torch.cuda.current_stream().cuda_stream)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(permute.expert_major_map(idx_gpu, counts).cpu(), want)  # the public entry point


def test_counts_must_be_exact_and_zero_row_inputs_reduce_to_zeros():
    idx, counts = _routing(16, 3, 4, seed=3)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        permute.expert_major_map(idx, [c + (e == 1) for e, c in enumerate(counts)])  # padded: rejected
    dst = permute.expert_major_map(idx, counts)
    with pytest.raises(ValueError, match="dst"):
        permute.reduce_rows(torch.zeros(sum(counts), 4), dst.long())
    none = torch.full((5, 2), -1, dtype=torch.int32)  # rows that selected no local expert
    out = permute.reduce_rows(torch.zeros(0, 4), none, 5)
    assert out.shape == (5, 4) and torch.all(out == 0)


def _routing_map(n, experts, k, seed, drop_p=0.2):
    """Megatron-style routing: k experts per token (some dropped, as by a capacity factor), softmax probs."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, experts, generator=g)
    top = scores.topk(k, dim=1).indices
    rmap = torch.zeros(n, experts, dtype=torch.bool).scatter_(1, top, True)
    rmap &= torch.rand(n, experts, generator=g) >= drop_p
    probs = torch.zeros(n, experts).scatter_(1, top, torch.rand(n, k, generator=g))
    return rmap, probs


@pytest.mark.parametrize("n,experts,k", [(0, 4, 2), (1, 1, 1), (33, 64, 8), (20, 40, 40), (9, 70, 3)])
def test_topk_from_routing_map_matches_oracle_and_gradient(n, experts, k):
    rmap, probs = _routing_map(n, experts, k, seed=n + experts)
    probs = probs.double().requires_grad_(True)
    idx, w = permute.topk_from_routing_map(rmap, probs, k)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == w.shape == (n, k)
    for t in range(n):
        chosen = [e for e in range(experts) if rmap[t, e]][:k]
        want = chosen + [-1] * (k - len(chosen))
        assert idx[t].tolist() == want, "the first k selected experts in expert order, -1 after"
        assert w[t].tolist() == [float(probs[t, e].float()) if e >= 0 else 0.0 for e in want]
    g = torch.randn(n, k)
    w.backward(g)
    dense = torch.zeros(n, experts, dtype=torch.float64)
    for t in range(n):
        for j in range(k):
            if idx[t, j] >= 0:
                dense[t, idx[t, j]] += float(g[t, j])
    assert torch.equal(probs.grad, dense), "the weights' gradient lands on the selected entries only"


def test_topk_from_routing_map_names_bad_arguments():
    rmap, probs = _routing_map(4, 8, 2, seed=0)
    with pytest.raises(ValueError, match="routing_map"):
        permute.topk_from_routing_map(rmap.int(), probs, 2)
    with pytest.raises(ValueError, match="probs"):
        permute.topk_from_routing_map(rmap, probs[:, :7], 2)
    with pytest.raises(ValueError, match="num_topk"):
        permute.topk_from_routing_map(rmap, probs, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,experts,k", [(4096, 256, 8), (77, 33, 5), (5, 300, 40), (3, 2, 2)])
def test_native_topk_from_routing_map_matches_torch_path(n, experts, k):
    if permute._native() is None or not hasattr(permute._native(), "routing_topk"):
        pytest.skip("native module built without the routing kernel")
    rmap, probs = _routing_map(n, experts, k, seed=k)
    ref_idx, ref_w = permute.topk_from_routing_map(rmap, probs, k)
    p = probs.cuda().requires_grad_(True)
    idx, w = permute.topk_from_routing_map(rmap.cuda(), p, k)
    assert torch.equal(idx.cpu(), ref_idx) and torch.equal(w.detach().cpu(), ref_w)
    g = torch.randn(n, k)
    w.backward(g.cuda())
    ref_p = probs.clone().requires_grad_(True)
    permute.topk_from_routing_map(rmap, ref_p, k)[1].backward(g)
    assert torch.equal(p.grad.cpu(), ref_p.grad)


def test_tokens_per_expert_and_capacity_map():
    """tokens_per_expert counts the local slots (ids outside [0, L) ignored); the capacity map places each
    source's rows of expert e in block (e, s) in receive order, and a slot past its block's capacity maps
    to -1."""
    idx = torch.tensor([[0, 1], [1, -1], [0, 2], [2, 0], [1, 2], [-1, -1]])
    assert permute.tokens_per_expert(idx, 2).tolist() == [3, 3]
    assert permute.tokens_per_expert(idx, 3).dtype == torch.int32
    rows = torch.tensor([3, 2, 0])  # rows 0-2 from source 0, 3-4 from source 1; row 5 is padding
    em = permute.expert_major_map_capacity(idx, rows, 2, 2)
    assert em.tolist() == [[0, 6], [7, -1], [1, -1], [-1, 2], [8, -1], [-1, -1]]
    # capacity 1: source 0's second row of expert 0 and of expert 1 have no room
    assert permute.expert_major_map_capacity(idx, rows, 2, 1).tolist() == \
        [[0, 3], [-1, -1], [-1, -1], [-1, 1], [4, -1], [-1, -1]]
    x = torch.arange(6.0).view(6, 1)
    out = permute.expand_rows_raw(x, em, 12, padded=True)
    assert out.view(-1).tolist() == [0, 2, 3, 0, 0, 0, 0, 1, 4, 0, 0, 0]
    # the fold of a capacity layout: padding rows get zero gradient (its backward expands into zeros)
    y = torch.randn(12, 1, requires_grad=True)
    permute.reduce_rows(y, em, 6, padded=True).sum().backward()
    assert y.grad.view(-1).tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="num_local_experts"):
        permute.tokens_per_expert(idx, 0)
