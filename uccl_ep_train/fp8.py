"""FP8 formats: which e4m3 flavour the device uses, and the per-token, per-128-channel cast.

AMD MI300 (gfx942) uses e4m3fnuz (max 240), everything else e4m3fn (max 448); a mismatch silently
corrupted data in UCCL-EP (uccl#804), so the dtype follows the device and is checked at the API.
"""
from __future__ import annotations

from typing import Optional

import torch

FP8_BLOCK = 128  # channels per float32 scale


def fp8_dtype_for(device: Optional[torch.device] = None) -> torch.dtype:
    """The e4m3 dtype native to `device` (CPU and NVIDIA: float8_e4m3fn; AMD gfx942: float8_e4m3fnuz)."""
    if device is not None and device.type == "cuda" and torch.version.hip is not None:
        arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")
        if "gfx942" in arch:
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False,
                          dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (fp8 [N, H], scales). Scales are float32 [N, H/128] (the dequantisation multipliers),
    rounded up to powers of two with `round_scale`; with `use_ue8m0` (needs round_scale) they are the
    exponent bytes packed four per int32: [N, H/512] int32."""
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0 requires round_scale=True")
    dtype = dtype or fp8_dtype_for(x.device)
    n, h = x.shape
    blocks = x.float().view(n, h // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    scale = amax / fp8_max(dtype)
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale.unsqueeze(2)).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype).view(n, h)
    if not use_ue8m0:
        return q, scale.contiguous()
    if h % (4 * FP8_BLOCK):
        raise ValueError(f"use_ue8m0: hidden ({h}) must be a multiple of 512")
    exponent = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)  # biased exponent of a power of 2
    return q, exponent.contiguous().view(torch.int32).view(n, h // (4 * FP8_BLOCK))


def per_token_cast_back(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of `per_token_cast_to_fp8` (float32 or packed ue8m0 scales) -> bfloat16."""
    n, h = q.shape
    if scales.dtype == torch.int32:
        dense = torch.empty(scales.shape, dtype=scales.dtype, device=scales.device).copy_(scales)
        scales = (dense.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    blocks = h // FP8_BLOCK
    return (q.float().view(n, blocks, FP8_BLOCK) * scales.reshape(n, blocks, 1)).view(n, h).to(torch.bfloat16)
