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
