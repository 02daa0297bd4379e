"""Pack several per-token tensors into one byte row per token, so one exchange moves them all."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

Spec = tuple[torch.dtype, tuple[int, ...]]  # per-row dtype and shape


def _row_width(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [N, bytes_per_row] uint8 (a view when t is densely laid out, else a copy)."""
    width = _row_width(t.dtype, tuple(t.shape[1:]))
    if t.numel() == 0:
        return torch.empty((t.size(0), width), dtype=torch.uint8, device=t.device)
    if t.dim() == 1:
        t = t.unsqueeze(1)
    if not t.is_contiguous() or t.stride(-1) != 1:  # size-1 dims may carry any stride
        t = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return t.view(torch.uint8).reshape(t.size(0), width)


def pack_rows(cols: Sequence[Optional[torch.Tensor]]) -> tuple[torch.Tensor, list[Spec]]:
    present = [c for c in cols if c is not None]
    specs = [(c.dtype, tuple(c.shape[1:])) for c in present]
    return torch.cat([as_bytes(c) for c in present], dim=1), specs


def unpack_rows(rows: torch.Tensor, specs: Sequence[Spec]) -> list[torch.Tensor]:
    out, off = [], 0
    n = rows.size(0)
    for dtype, shape in specs:
        width = _row_width(dtype, shape)
        col = torch.empty((n, width), dtype=torch.uint8, device=rows.device).copy_(rows[:, off:off + width])
        out.append(col.view(dtype).view((n,) + shape))
        off += width
    return out
