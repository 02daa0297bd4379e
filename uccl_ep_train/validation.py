"""Argument checks run before any communication: each failure names the argument and what was expected.

A wrong dtype, shape, layout or expert id caught here costs one exception on one rank; caught inside a
collective it costs a hang of every rank.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Optional, Sequence, Union

import torch

from .errors import RankLocalError, bad_expert_id
from .events import capturing, host_values
from .fp8 import FP8_BLOCK, fp8_dtype_for

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
INDEX_DTYPES = (torch.int64, torch.int32)


_trusted = threading.local()


@contextlib.contextmanager
def trusted_values():
    """Within this block, GPU tensors' values are not read for checks (shapes, dtypes and devices still
    are): for callers that built the routing themselves, e.g. the Megatron dispatcher, whose top-k ids come
    from its own router. Each skipped check would otherwise be a host sync in the training step."""
    old = getattr(_trusted, "on", False)
    _trusted.on = True
    try:
        yield
    finally:
        _trusted.on = old


def host_value_checks(checked_on_device: bool) -> bool:
    """Whether a call runs the checks that read tensor values on the host (expert id range, count
    consistency): each syncs a GPU with the host. UCCL_EP_CHECK_VALUES=1: always, 0: never; unset: unless the
    backend's kernels check the same values (`checked_on_device`, reported as errors on the call's host sync
    or the next call). Never inside CUDA-graph capture, where a sync is an error."""
    if capturing():
        return False
    setting = os.environ.get("UCCL_EP_CHECK_VALUES", "")
    if setting not in ("", "0", "1"):
        raise ValueError(f"UCCL_EP_CHECK_VALUES must be 0 or 1, got {setting!r}")
    return setting == "1" or (setting == "" and not checked_on_device)


def value_checks(t: torch.Tensor) -> bool:
    """Within the checks a call runs (host_value_checks): always for CPU tensors; for GPU tensors unless
    UCCL_EP_CHECK_VALUES=0 or inside `trusted_values()`."""
    if t.device.type == "cpu":
        return True
    return os.environ.get("UCCL_EP_CHECK_VALUES", "") != "0" and not getattr(_trusted, "on", False)


def check_tensor(t: Any, arg: str, dtypes: Sequence[torch.dtype], ndim: int, contiguous: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{arg}: dtype must be {names}, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != ndim:
        raise ValueError(f"{arg}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{arg}: must be contiguous (call .contiguous()), got strides {t.stride()}")
    return t


def check_device(t: Optional[torch.Tensor], arg: str, device: torch.device) -> None:
    if t is None:
        return
    # is_cuda / get_device(): no torch.device object per check (on every call's host path)
    if not (t.get_device() == device.index and t.is_cuda if device.type == "cuda" else t.is_cpu):
        raise ValueError(f"{arg}: is on {t.device}, expected {device} like the Buffer")


def split_x(x: Union[torch.Tensor, tuple, list], arg: str = "x") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x or (fp8 x, float32 scales [N, H/128]) -> (x, scales). Scales may be column-major (DeepEP allows it)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"{arg}: an FP8 input is a pair (e4m3 tensor, scales), got {len(x)} elements")
        data, scales = x
        check_tensor(data, f"{arg}[0]", FP8_DTYPES, 2)
        want = fp8_dtype_for(data.device)
        if data.dtype != want:
            raise TypeError(f"{arg}[0]: this device uses {str(want).replace('torch.', '')}, "
                            f"got {str(data.dtype).replace('torch.', '')}")
        check_tensor(scales, f"{arg}[1]", (torch.float32,), 2, contiguous=False)
        n, h = data.shape
        if h % FP8_BLOCK:
            raise ValueError(f"{arg}[0]: hidden ({h}) must be divisible by {FP8_BLOCK} for FP8")
        if tuple(scales.shape) != (n, h // FP8_BLOCK):
            raise ValueError(f"{arg}[1]: scales must be [num_tokens, hidden/128] = [{n}, {h // FP8_BLOCK}], "
                             f"got {list(scales.shape)}")
        return data, scales
    check_tensor(x, arg, FLOAT_DTYPES, 2)
    return x, None


def check_topk(topk_idx: Any, topk_weights: Any, num_tokens: int,
               idx_arg: str = "topk_idx", weights_arg: str = "topk_weights") -> None:
    """Dtype, rank, layout and shape of the top-k tensors (no values read)."""
    check_tensor(topk_idx, idx_arg, INDEX_DTYPES, 2)
    if topk_idx.size(0) != num_tokens:
        raise RankLocalError(f"{idx_arg}: has {topk_idx.size(0)} rows but x has {num_tokens} tokens")
    if topk_weights is not None:
        check_tensor(topk_weights, weights_arg, (torch.float32,), 2)
        if topk_weights.shape != topk_idx.shape:
            raise RankLocalError(f"{weights_arg}: shape {list(topk_weights.shape)} differs from "
                                 f"{idx_arg} shape {list(topk_idx.shape)}")


def expert_id_bounds(topk_idx: torch.Tensor) -> Optional[torch.Tensor]:
    """The ids' [min, max] (int64, on their device) that check_expert_range reads, for a caller that reads them
    with other values in one host sync; None when there is nothing to read (no ids, or value checks off)."""
    if not topk_idx.numel() or not value_checks(topk_idx):
        return None
    return torch.stack(torch.aminmax(topk_idx)).to(torch.int64)


def check_expert_range(topk_idx: torch.Tensor, num_experts: int, rank: int, idx_arg: str = "topk_idx",
                       bounds: Optional[Sequence[int]] = None) -> None:
    """Every id in [-1, num_experts), else a ValueError naming the first bad one (row-major) with its position,
    in the words the native kernels use for the ids they check (errors.bad_expert_id). Reads values, so it
    syncs a GPU (see value_checks): once when the ids are good, and only a bad call pays for the position.
    `bounds`: expert_id_bounds's values, already read by the caller (then it syncs only for a bad id)."""
    if bounds is None:
        t = expert_id_bounds(topk_idx)
        bounds = None if t is None else host_values(t)  # one host sync for both
    if bounds is not None:
        lo, hi = bounds
        if lo < -1 or hi >= num_experts:
            row, col = ((topk_idx < -1) | (topk_idx >= num_experts)).nonzero()[0].tolist()
            raise RankLocalError(bad_expert_id(idx_arg, row, col, int(topk_idx[row, col]), num_experts, rank))


def check_expert_major_map(em_map: Any, num_recv: int, num_rows: int, rows_arg: str, arg: str = "em_map",
                           values: bool = True, padded: bool = False) -> None:
    """An expert-major map: contiguous int32 `[num_recv, k]` naming each of `num_rows` rows exactly once (-1
    elsewhere), or at most once when `padded` (a capacity layout: the rest is padding). The shape is always
    checked; with `values`, the entries too (a GPU host sync: only where `value_checks` allows)."""
    check_tensor(em_map, arg, (torch.int32,), 2)
    if em_map.size(0) != num_recv:
        raise RankLocalError(f"{arg}: has {em_map.size(0)} rows, the handle's dispatch received {num_recv}")
    if not em_map.numel():
        if num_rows and not padded:
            raise RankLocalError(f"{rows_arg}: {num_rows} rows, but {arg} (shape {tuple(em_map.shape)}) names none")
        return
    if not values or not value_checks(em_map):
        return
    valid = em_map >= 0
    hits = torch.bincount(torch.where(valid, em_map, num_rows).reshape(-1).long().clamp(max=num_rows),
                          minlength=num_rows + 1)[:num_rows]
    lo, hi, named, distinct = host_values(torch.stack([em_map.min().long(), em_map.max().long(), valid.sum(),
                                           (hits == 1).sum()]))  # one host sync
    if lo < -1:
        raise RankLocalError(f"{arg}: entries must be expert-major rows or -1, got {lo}")
    if named != num_rows and not padded:
        raise RankLocalError(f"{rows_arg}: {num_rows} expert-major rows, but {arg} names {named} (one per slot of a "
                             f"local expert)")
    if hi >= num_rows or distinct != named:
        raise RankLocalError(f"{arg}: must name each of the {num_rows} expert-major rows "
                             f"{'at most' if padded else 'exactly'} once, got entries up to {hi} covering {distinct} "
                             f"rows once")


def check_expert_capacity(sent: torch.Tensor, capacity: Union[int, torch.Tensor]) -> None:
    """Raises a ValueError naming the first (source, expert) block over its capacity: `sent` [R sources, E
    experts] tokens each source sends each expert, `capacity` expert_capacity (one int, or [R] per destination
    rank). Given every rank's counts, every rank raises the same sentence, before any row moves (the native
    notify's report says the same: csrc/common/errors.cpp)."""
    num_local = sent.size(1) // sent.size(0)
    limit = torch.as_tensor(capacity).reshape(-1).expand(sent.size(0)).repeat_interleave(num_local)
    over = torch.nonzero(sent > limit.unsqueeze(0))
    if len(over):
        src, expert = (int(v) for v in over[0])
        raise ValueError(f"dispatch_expert_major: rank {src} sends {int(sent[src, expert])} tokens to local expert "
                         f"{expert % num_local} of rank {expert // num_local}, more than expert_capacity="
                         f"{int(limit[expert])}: pass a larger expert_capacity, or drop the excess tokens in the "
                         "router (a capacity factor)")


def check_num_experts(num_experts: Any, num_ranks: int, arg: str = "num_experts") -> None:
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
        raise ValueError(f"{arg}: must be a positive int, got {num_experts!r}")
    if num_experts % num_ranks:
        raise ValueError(f"{arg}: {num_experts} experts cannot be split evenly over {num_ranks} ranks")


def check_layout(num_tokens_per_rank: Any, is_token_in_rank: Any, num_tokens_per_expert: Any,
                 num_tokens: int, num_ranks: int) -> None:
    check_tensor(num_tokens_per_rank, "num_tokens_per_rank", (torch.int32,), 1)
    if num_tokens_per_rank.size(0) != num_ranks:
        raise ValueError(f"num_tokens_per_rank: expected [{num_ranks}], got {list(num_tokens_per_rank.shape)}")
    check_tensor(is_token_in_rank, "is_token_in_rank", (torch.bool,), 2)
    if tuple(is_token_in_rank.shape) != (num_tokens, num_ranks):
        raise ValueError(f"is_token_in_rank: expected [{num_tokens}, {num_ranks}], got {list(is_token_in_rank.shape)}")
    check_tensor(num_tokens_per_expert, "num_tokens_per_expert", (torch.int32,), 1)
    if num_tokens_per_expert.size(0) % num_ranks:
        raise ValueError(f"num_tokens_per_expert: length {num_tokens_per_expert.size(0)} not divisible by "
                         f"{num_ranks} ranks")


def check_non_negative_int(v: Any, arg: str, minimum: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"{arg}: must be an int >= {minimum}, got {v!r}")
    return v
