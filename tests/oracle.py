"""Dense single-process oracle: every rank's inputs are regenerated from seeds, so any rank can compute
what every call must return without communication."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RankInputs:
    x: torch.Tensor  # [T, H]
    topk_idx: torch.Tensor  # [T, K] int64 with -1
    topk_weights: torch.Tensor  # [T, K] float32


def make_inputs(rank: int, num_tokens: int, hidden: int, num_topk: int, num_experts: int, seed: int,
                dtype: torch.dtype = torch.bfloat16, mask_prob: float = 0.2) -> RankInputs:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn((num_tokens, hidden), generator=g).to(dtype)
    scores = torch.rand((num_tokens, num_experts), generator=g)
    topk_idx = torch.topk(scores, num_topk, dim=1).indices.to(torch.int64)
    mask = torch.rand((num_tokens, num_topk), generator=g) < mask_prob
    topk_idx = topk_idx.masked_fill(mask, -1)
    topk_weights = torch.rand((num_tokens, num_topk), generator=g)
    return RankInputs(x, topk_idx, topk_weights)


def dest_ranks(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """[T, R] bool: token t goes to rank r."""
    local = num_experts // num_ranks
    out = torch.zeros((topk_idx.size(0), num_ranks), dtype=torch.bool)
    for r in range(num_ranks):
        out[:, r] = ((topk_idx >= r * local) & (topk_idx < (r + 1) * local)).any(dim=1)
    return out


def expected_dispatch(all_inputs: list[RankInputs], me: int, num_experts: int):
    """Rows rank `me` receives: (x rows, local topk idx, masked weights, src token idx, counts per source)."""
    R = len(all_inputs)
    local = num_experts // R
    xs, idxs, ws, srcs, counts = [], [], [], [], []
    for src, inp in enumerate(all_inputs):
        sel = torch.nonzero(dest_ranks(inp.topk_idx, num_experts, R)[:, me], as_tuple=True)[0]
        idx = inp.topk_idx[sel]
        in_me = (idx >= me * local) & (idx < (me + 1) * local)
        xs.append(inp.x[sel])
        idxs.append(torch.where(in_me, idx - me * local, -1))
        ws.append(torch.where(in_me, inp.topk_weights[sel], 0.0))
        srcs.append(sel.to(torch.int32))
        counts.append(sel.numel())
    return torch.cat(xs), torch.cat(idxs), torch.cat(ws), torch.cat(srcs), counts


def expected_per_expert(all_inputs: list[RankInputs], me: int, num_experts: int, alignment: int = 1) -> list[int]:
    R = len(all_inputs)
    local = num_experts // R
    out = []
    for e in range(me * local, (me + 1) * local):
        c = sum(int((inp.topk_idx == e).sum()) for inp in all_inputs)
        out.append((c + alignment - 1) // alignment * alignment)
    return out


# ---- capacity layouts (Buffer.dispatch_expert_major with expert_capacity; Megatron's drop-and-pad) ---------
def drop_over_capacity(topk_idx: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """topk_idx with the selections past their expert's capacity set to -1: each expert keeps this rank's
    first `capacity` tokens in token order (what a router with a capacity factor, or megatron_patch's receive
    budget (RecvBudget.limit), sends), so no (local expert, source rank) block overflows."""
    valid = topk_idx >= 0
    hits = torch.zeros((topk_idx.size(0), num_experts), dtype=torch.int64)
    rows = torch.arange(topk_idx.size(0)).unsqueeze(1).expand_as(topk_idx)
    hits[rows[valid], topk_idx[valid]] = 1
    taken = hits.cumsum(0)  # this rank's tokens for each expert up to and including the row
    kept = taken.gather(1, topk_idx.clamp(min=0)) <= capacity
    return torch.where(valid & kept, topk_idx, -1)


def capacity_overflows(routes: list[torch.Tensor], num_experts: int, capacity: int) -> set[tuple[int, int, int, int]]:
    """Every (source rank, tokens, local expert, destination rank) where a source sends one expert more than
    `capacity` tokens: the blocks a capacity-layout dispatch of these routings must refuse (on every rank)."""
    local = num_experts // len(routes)
    out = set()
    for src, idx in enumerate(routes):
        counts = torch.bincount(idx[idx >= 0], minlength=num_experts).tolist()
        out |= {(src, c, e % local, e // local) for e, c in enumerate(counts) if c > capacity}
    return out


def expected_capacity_rows(xs: list[torch.Tensor], routes: list[torch.Tensor], me: int, num_experts: int,
                           capacity: int) -> torch.Tensor:
    """x_em of rank `me` in the capacity layout: block (e, s) at rows (e * R + s) * capacity holds source s's
    tokens for local expert e in token order, then zero rows (routings that overflow no block)."""
    R = len(routes)
    local = num_experts // R
    out = torch.zeros((local * R * capacity, xs[0].size(1)), dtype=xs[0].dtype)
    for e in range(local):
        for s, (x, idx) in enumerate(zip(xs, routes)):
            tokens = torch.nonzero((idx == me * local + e).any(dim=1), as_tuple=True)[0]
            assert tokens.numel() <= capacity, f"block ({e}, {s}) overflows: {tokens.numel()} > {capacity}"
            start = (e * R + s) * capacity
            out[start:start + tokens.numel()] = x[tokens]
    return out
