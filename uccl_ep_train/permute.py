"""Expert-major permutation of received tokens, and its inverse, for the experts of one rank.

A dispatch delivers each token once per destination rank, in (source rank, token) order, with its top-k
expert ids (local ids; -1 for other ranks' experts). Megatron's experts want one row per (token, local
expert), grouped by expert, and within an expert by source rank then token — the order the alltoall
dispatcher produces. `expert_major_map` gives every (row, slot) its expert-major row; then

    expand_rows(x, dst, m)   -> [m, H]  out[dst[i, j]] = x[i]           (backward: reduce_rows)
    reduce_rows(y, dst, n)   -> [n, H]  out[i] = sum_j y[dst[i, j]]     (backward: expand_rows)
    expand_probs(w, dst, m)  -> [m]     out[dst[i, j]] = w[i, j]
    tokens_per_expert(topk_idx, num_local_experts): per-local-expert slot counts as a device tensor (no sync)
    expert_major_map_capacity: the map of a capacity layout (every (expert, source rank) block the same
        size, as Megatron's drop-and-pad gives it); rows no slot names are padding, zeros (`padded=True`)
    topk_from_routing_map(routing_map, probs, k): Megatron's routing map + probs -> top-k ids and weights

expand_rows / reduce_rows are autograd-aware (each is the other's backward); expand_rows_raw /
reduce_rows_raw are the same operations outside autograd, for code that does its own differentiation
(the backends' expert-major dispatch/combine, whose autograd pair lives in uccl_ep_train.autograd).

On CUDA/HIP tensors the map, expand and reduce are single native kernels (one read of each source row, float32 sums in
slot order, no atomics, no sort, no host sync); elsewhere the same maps drive torch index ops. Both give
the same values, so CPU tests check the semantics the GPU kernels implement.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import torch

from .events import current_raw_stream

_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


@functools.lru_cache(maxsize=None)
def _native():
    """The native module when it carries the permutation kernels, else None (looked up once)."""
    try:
        from . import _native as m  # noqa: PLC0415 (optional extension)
    except ImportError:
        return None
    return m if hasattr(m, "expand_rows") else None


def _use_native(t: torch.Tensor) -> bool:
    return t.is_cuda and _native() is not None


def _launch(t: torch.Tensor, kernel, *args) -> None:
    """kernel(*args, stream) on the current stream of t's device; the device guard only when another
    device is current (entering it costs host time on every call)."""
    index = t.device.index
    if torch.cuda.current_device() == index:
        kernel(*args, current_raw_stream(index))
    else:
        with torch.cuda.device(index):
            kernel(*args, current_raw_stream(index))


def expert_major_map(topk_idx: torch.Tensor, tokens_per_expert: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """int32 [n, k]: the expert-major row of each (received row, top-k slot), -1 for slots of no local expert.

    `topk_idx` holds local expert ids (>= num_local_experts or < 0 mean "not here"; the ids of one row are
    distinct, as a router's top-k are); `tokens_per_expert` the exact number of slots per local expert (as
    the dispatch returns it with expert_alignment=1: the expert-major rows are then all named, and
    expand_rows / its gradients write every row). Rows of one expert keep their order."""
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx: expected [tokens, k], got shape {tuple(topk_idx.shape)}")
    if not topk_idx.is_cuda:  # free on CPU; on GPUs it would cost a host sync
        got = [int((topk_idx == e).sum()) for e in range(len(tokens_per_expert))]
        if got != [int(c) for c in tokens_per_expert]:
            raise ValueError(f"tokens_per_expert: {list(map(int, tokens_per_expert))} disagrees with topk_idx, "
                             f"which selects {got} (pass exact counts, no alignment padding)")
    if _use_native(topk_idx):
        counts = torch.as_tensor(tokens_per_expert, dtype=torch.int32)
        counts = (counts.pin_memory() if not counts.is_cuda else counts).to(topk_idx.device, non_blocking=True)
        idx = topk_idx.to(torch.int64).contiguous()
        dst = torch.empty(idx.shape, dtype=torch.int32, device=idx.device)  # the kernel writes every slot
        if idx.numel() == 0:
            return dst
        _launch(idx, _native().expert_major_map, idx.data_ptr(), idx.size(0), idx.size(1), counts.numel(),
                counts.data_ptr(), dst.data_ptr())
        return dst
    counts = torch.as_tensor(tokens_per_expert, dtype=torch.int64).to(topk_idx.device, non_blocking=True)
    num_experts = counts.numel()
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    key = torch.where(valid, topk_idx, num_experts)  # the spare column num_experts collects non-local slots
    onehot = torch.zeros((topk_idx.size(0), num_experts + 1), dtype=torch.int32, device=topk_idx.device)
    onehot.scatter_(1, key, 1)
    rank_in_expert = onehot.cumsum(0, dtype=torch.int32).gather(1, key) - 1
    start = torch.cumsum(counts, 0) - counts
    base = torch.cat([start, start.new_zeros(1)])[key]
    return torch.where(valid, base + rank_in_expert, -1).to(torch.int32).contiguous()


def tokens_per_expert(topk_idx: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """int32 [num_local_experts]: how many slots of `topk_idx` (local ids in receive order; -1 or >= the
    count: not here) select each local expert. On topk_idx's device with no host sync (capturable): the
    per-expert receive counts of a dispatch with num_worst_tokens, whose count list is empty (DeepEP's API)."""
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx: expected [tokens, k], got shape {tuple(topk_idx.shape)}")
    L = int(num_local_experts)
    if L <= 0:
        raise ValueError(f"num_local_experts: must be > 0, got {num_local_experts}")
    key = torch.where((topk_idx >= 0) & (topk_idx < L), topk_idx, L).reshape(-1).long()
    counts = torch.zeros(L + 1, dtype=torch.int32, device=topk_idx.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    return counts[:L]


def expert_major_map_capacity(topk_idx: torch.Tensor, rows_per_source: torch.Tensor, num_local_experts: int,
                              capacity: int) -> torch.Tensor:
    """int32 [n, k]: the map of a capacity layout, -1 for slots of no local expert.

    The expert-major rows are blocks of `capacity` rows, one per (local expert e, source rank s), at
    (e * num_ranks + s) * capacity: a source's rows for e fill its block from the start in receive order, the
    rest of the block is padding (named by no slot). `topk_idx` holds local ids in receive order (source rank,
    then token); `rows_per_source` ([num_ranks], on topk_idx's device) how many of its rows came from each
    source (rows after them, e.g. num_worst_tokens padding, map to -1). A slot past its block's capacity maps
    to -1 too (the dispatches that use this map report that case before). Torch ops on the device: no host
    sync, so it serves GPU backends without a fused expert-major dispatch as well."""
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx: expected [tokens, k], got shape {tuple(topk_idx.shape)}")
    n, dev, L = topk_idx.size(0), topk_idx.device, int(num_local_experts)
    R = rows_per_source.numel()
    valid = (topk_idx >= 0) & (topk_idx < L)
    key = torch.where(valid, topk_idx, L)  # the spare column L collects non-local slots
    onehot = torch.zeros((n, L + 1), dtype=torch.int32, device=dev)
    onehot.scatter_(1, key, 1)
    seen = onehot.cumsum(0, dtype=torch.int32)  # slots of each expert in rows 0..i
    ends = rows_per_source.to(device=dev, dtype=torch.int64).cumsum(0)
    src = torch.bucketize(torch.arange(n, device=dev), ends, right=True)  # source rank of each row (R: none)
    before = torch.cat([seen.new_zeros(1, L + 1), seen])[ends - rows_per_source.to(ends)]  # [R, L+1] at starts
    pos = (seen - torch.cat([before, before.new_zeros(1, L + 1)])[src]).gather(1, key) - 1
    valid &= (src < R).unsqueeze(1) & (pos < capacity)
    row = (key * R + src.unsqueeze(1)) * capacity + pos
    return torch.where(valid, row, -1).to(torch.int32).contiguous()


def topk_from_routing_map(routing_map: torch.Tensor, probs: torch.Tensor,
                          num_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's routing (bool [tokens, experts] map, probabilities of the same shape) in top-k form:
    (topk_idx int64 [tokens, num_topk], topk_weights float32 [tokens, num_topk]) — each token's first num_topk
    selected experts in expert order, -1 and weight 0 in the slots of a token with fewer (dropped by a
    capacity factor). Differentiable in probs (the weights' gradient lands at the selected entries). On
    GPUs the forward is one kernel, so the dispatcher's preprocess costs one launch."""
    if routing_map.dtype != torch.bool or routing_map.dim() != 2:
        raise ValueError(f"routing_map: expected a 2-D bool tensor [tokens, experts], got {routing_map.dtype} "
                         f"{tuple(routing_map.shape)}")
    if probs.shape != routing_map.shape or probs.device != routing_map.device:
        raise ValueError(f"probs: expected shape {tuple(routing_map.shape)} on {routing_map.device}, got "
                         f"{tuple(probs.shape)} on {probs.device}")
    if not 1 <= num_topk <= routing_map.size(1):
        raise ValueError(f"num_topk: {num_topk} outside [1, {routing_map.size(1)}]")
    return _RoutingTopk.apply(routing_map, probs, int(num_topk))


class _RoutingTopk(torch.autograd.Function):
    """topk_from_routing_map's autograd: the ids are a selection (not differentiable), the weights a gather of
    probs, so their gradient scatters back to the selected entries."""

    @staticmethod
    def forward(ctx, routing_map: torch.Tensor, probs: torch.Tensor, num_topk: int):
        n, num_experts = routing_map.shape
        if _use_native(routing_map) and hasattr(_native(), "routing_topk"):
            rmap = routing_map.contiguous()
            p = probs.to(torch.float32).contiguous()
            idx = torch.empty((n, num_topk), dtype=torch.int64, device=rmap.device)
            w = torch.empty((n, num_topk), dtype=torch.float32, device=rmap.device)
            _launch(rmap, _native().routing_topk, rmap.data_ptr(), p.data_ptr(), n, num_experts, num_topk,
                    idx.data_ptr(), w.data_ptr())
        else:
            order = torch.sort(routing_map.to(torch.int8), dim=1, descending=True, stable=True).indices
            order = order[:, :num_topk]
            selected = routing_map.gather(1, order)
            idx = torch.where(selected, order, -1).to(torch.int64).contiguous()
            w = torch.where(selected, probs.gather(1, order), 0).float().contiguous()
        ctx.save_for_backward(idx)
        ctx.probs_shape, ctx.probs_dtype = probs.shape, probs.dtype
        ctx.mark_non_differentiable(idx)
        return idx, w

    @staticmethod
    def backward(ctx, _grad_idx, grad_w):
        (idx,) = ctx.saved_tensors
        grad = torch.zeros(ctx.probs_shape, dtype=torch.float32, device=idx.device)
        # padded slots add 0 (scatter_add: a clamped -1 may share column 0 with a real selection)
        grad.scatter_add_(1, idx.clamp(min=0), torch.where(idx >= 0, grad_w.float(), 0.0))
        return None, grad.to(ctx.probs_dtype), None


def _expand(x: torch.Tensor, dst: torch.Tensor, num_out: int, padded: bool) -> torch.Tensor:
    # exact counts name every row (see the map); a capacity layout leaves padding rows, zeros
    shape = (num_out,) + tuple(x.shape[1:])
    out = x.new_zeros(shape) if padded else x.new_empty(shape)
    if _use_native(x):
        x = x.contiguous()
        _launch(x, _native().expand_rows, x.data_ptr(), dst.data_ptr(), out.data_ptr(), x.size(0), dst.size(1),
                _row_elems(x) * x.element_size(), num_out)
        return out
    flat = dst.reshape(-1).long()
    keep = flat >= 0
    rows = torch.arange(x.size(0), device=x.device).repeat_interleave(dst.size(1))
    out[flat[keep]] = x[rows[keep]]
    return out


def _row_elems(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:])


def _reduce(y: torch.Tensor, dst: torch.Tensor, num_rows: int) -> torch.Tensor:
    if _use_native(y) and y.dtype in _DTYPES:
        y = y.contiguous()
        out = y.new_empty((num_rows,) + tuple(y.shape[1:]))
        _launch(y, _native().reduce_rows, y.data_ptr(), dst.data_ptr(), out.data_ptr(), num_rows, dst.size(1),
                _row_elems(y), y.size(0), _DTYPES[y.dtype])
        return out
    acc = torch.promote_types(y.dtype, torch.float32) if y.is_floating_point() else y.dtype
    out = torch.zeros((num_rows,) + tuple(y.shape[1:]), dtype=acc, device=y.device)
    for j in range(dst.size(1)):  # slot by slot: the kernel's summation order
        col = dst[:, j].long()
        keep = col >= 0
        out[keep] += y[col[keep]].to(out.dtype)
    return out.to(y.dtype)


class _Permute(torch.autograd.Function):
    """expand (rows -> expert-major rows) or reduce (the reverse); each is the other's backward."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, dst: torch.Tensor, num_out: int, expand: bool, padded: bool) -> torch.Tensor:
        ctx.save_for_backward(dst)
        ctx.num_in, ctx.expand, ctx.padded = t.size(0), expand, padded
        return _expand(t, dst, num_out, padded) if expand else _reduce(t, dst, num_out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (dst,) = ctx.saved_tensors
        grad = grad.contiguous()
        back = _reduce(grad, dst, ctx.num_in) if ctx.expand else _expand(grad, dst, ctx.num_in, ctx.padded)
        return back, None, None, None, None


def expand_rows(x: torch.Tensor, dst: torch.Tensor, num_out: int, padded: bool = False) -> torch.Tensor:
    """[n, ...] -> [num_out, ...]: row i copied to every expert-major row dst[i, :] names (autograd-aware).
    padded: rows no slot names (a capacity layout's padding) are zeros; else dst names every row."""
    _check(x, dst, "x")
    return _Permute.apply(x, dst, int(num_out), True, padded)


def reduce_rows(y: torch.Tensor, dst: torch.Tensor, num_rows: Optional[int] = None,
                padded: bool = False) -> torch.Tensor:
    """[m, ...] -> [n, ...]: row i is the sum of the expert-major rows dst[i, :] names (autograd-aware).
    padded: as in expand_rows (the rows named by none get zero gradient)."""
    return _Permute.apply(y, dst, _check_reduce(y, dst, num_rows), False, padded)


def expand_rows_raw(x: torch.Tensor, dst: torch.Tensor, num_out: int, padded: bool = False) -> torch.Tensor:
    """expand_rows outside autograd: the same values, no graph."""
    _check(x, dst, "x")
    return _expand(x, dst, int(num_out), padded)


def reduce_rows_raw(y: torch.Tensor, dst: torch.Tensor, num_rows: Optional[int] = None) -> torch.Tensor:
    """reduce_rows outside autograd: the same values (float32 sums in slot order), no graph."""
    return _reduce(y, dst, _check_reduce(y, dst, num_rows))


def expand_probs(weights: torch.Tensor, dst: torch.Tensor, num_out: int, padded: bool = False) -> torch.Tensor:
    """[n, k] -> [num_out]: the top-k weight of each expert-major row (autograd-aware).

    Each (row, slot) is a one-element row with at most one destination, so this is expand_rows over the
    flattened slots (one kernel on GPUs), and its backward, reduce_rows, gathers each slot's gradient (0 for
    slots without a row). As with expand_rows, every one of the num_out rows must be named unless `padded`
    (then the rows named by none are 0)."""
    _check_map(dst)
    if weights.shape != dst.shape:
        raise ValueError(f"weights: shape {tuple(weights.shape)} != dst shape {tuple(dst.shape)}")
    return _Permute.apply(weights.reshape(-1, 1), dst.reshape(-1, 1), int(num_out), True, padded).reshape(-1)


def _check_map(dst: torch.Tensor) -> None:
    if dst.dtype != torch.int32 or dst.dim() != 2 or not dst.is_contiguous():
        raise ValueError(f"dst: expected a contiguous int32 [rows, k] map, got {dst.dtype} {tuple(dst.shape)}")


def _check_reduce(y: torch.Tensor, dst: torch.Tensor, num_rows: Optional[int]) -> int:
    _check_map(dst)
    n = dst.size(0) if num_rows is None else int(num_rows)
    if n != dst.size(0):
        raise ValueError(f"num_rows: {n} != dst rows {dst.size(0)}")
    if y.dim() < 1 or y.device != dst.device:
        raise ValueError(f"y: expected [rows, ...] on {dst.device}, got shape {tuple(y.shape)} on {y.device}")
    return n


def _check(x: torch.Tensor, dst: torch.Tensor, name: str) -> None:
    _check_map(dst)
    if x.dim() < 1 or x.size(0) != dst.size(0) or x.device != dst.device:
        raise ValueError(f"{name}: expected {dst.size(0)} rows on {dst.device}, got shape {tuple(x.shape)} "
                         f"on {x.device}")
