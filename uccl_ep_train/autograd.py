"""Autograd pairing of dispatch and combine.

The gradient of a dispatch is a combine of the received gradients with the same handle; the gradient of
a combine is a dispatch of the output gradient with the cached handle. Neither recomputes the layout or
exchanges counts again: the handle carries everything.

DispatchExpertMajor/CombineExpertMajor are the same pairing for the expert-major calls (rows grouped per
local expert): the backward of the dispatch is an expert-major combine (fold + combine), the backward of
the combine an expert-major cached dispatch (dispatch + expand), both with the forward's handle and map.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from . import validation
from .buffer import Buffer
from .handles import HTHandle


class Dispatch(torch.autograd.Function):
    """(x, topk_weights) -> (recv_x, recv_topk_idx, recv_topk_weights, per_expert_counts, handle)."""

    @staticmethod
    def forward(ctx: Any, buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                num_experts: int, expert_alignment: int = 1, num_worst_tokens: int = 0):
        per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
            expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.save_for_backward(recv_idx)
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_w, counts, handle

    @staticmethod
    def backward(ctx: Any, grad_recv_x, _grad_idx, grad_recv_w, *_rest):
        (recv_idx,) = ctx.saved_tensors
        grad_w = None
        if grad_recv_w is not None:
            # weights of experts that live elsewhere are constant zeros here: no gradient flows from them
            grad_w = torch.where(recv_idx >= 0, grad_recv_w, 0.0).float().contiguous()
        grad_x, grad_topk_w, _ = ctx.buffer.combine(grad_recv_x.contiguous(), ctx.handle, topk_weights=grad_w)
        return None, grad_x, None, grad_topk_w, None, None, None


class Combine(torch.autograd.Function):
    """x (in dispatch's receive order) -> combined_x on the tokens' home ranks."""

    @staticmethod
    def forward(ctx: Any, buffer: Buffer, x: torch.Tensor, handle: HTHandle,
                bias: Optional[torch.Tensor] = None):
        combined, _, _ = buffer.combine(x, handle, bias=bias)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.rows, ctx.has_bias = x.size(0), bias is not None
        return combined

    @staticmethod
    def backward(ctx: Any, grad_combined: torch.Tensor):
        grad_x, *_ = ctx.buffer.dispatch(grad_combined.contiguous(), handle=ctx.handle)
        if grad_x.size(0) < ctx.rows:  # num_worst_tokens padding receives no gradient
            grad_x = torch.cat([grad_x, grad_x.new_zeros((ctx.rows - grad_x.size(0), grad_x.size(1)))])
        return None, grad_x, None, (grad_combined if ctx.has_bias else None)


def dispatch(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             num_experts: int, expert_alignment: int = 1, num_worst_tokens: int = 0):
    """Differentiable dispatch: returns (recv_x, recv_topk_idx, recv_topk_weights, counts, handle)."""
    return Dispatch.apply(buffer, x, topk_idx, topk_weights, num_experts, expert_alignment, num_worst_tokens)


def combine(buffer: Buffer, x: torch.Tensor, handle: HTHandle, bias: Optional[torch.Tensor] = None):
    """Differentiable combine: returns combined_x `[num_tokens, hidden]`."""
    return Combine.apply(buffer, x, handle, bias)


class DispatchExpertMajor(torch.autograd.Function):
    """(x, topk_weights) -> (x_em, recv_topk_idx, recv_topk_weights, tokens_per_expert, em_map, handle)."""

    @staticmethod
    def forward(ctx: Any, buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: Optional[torch.Tensor], num_experts: int, num_worst_tokens: int = 0,
                expert_capacity: int = 0):
        x_em, recv_idx, recv_w, counts, em_map, handle, _ = buffer.dispatch_expert_major(
            x, topk_idx, topk_weights, num_experts, num_worst_tokens=num_worst_tokens,
            expert_capacity=expert_capacity)
        ctx.buffer, ctx.handle, ctx.has_w, ctx.capacity = buffer, handle, topk_weights is not None, expert_capacity
        ctx.save_for_backward(recv_idx, em_map)
        ctx.mark_non_differentiable(recv_idx, em_map)
        return x_em, recv_idx, recv_w, counts, em_map, handle

    @staticmethod
    def backward(ctx: Any, grad_x_em, _grad_idx, grad_recv_w, *_rest):
        recv_idx, em_map = ctx.saved_tensors
        grad_w = None
        if ctx.has_w and grad_recv_w is not None:
            # weights of experts that live elsewhere are constant zeros here: no gradient flows from them
            grad_w = torch.where(recv_idx >= 0, grad_recv_w, 0.0).float().contiguous()
        with validation.trusted_values():  # em_map and handle come from the forward: no value-reading syncs
            grad_x, grad_topk_w, _ = ctx.buffer.combine_expert_major(grad_x_em.contiguous(), ctx.handle, em_map,
                                                                     topk_weights=grad_w,
                                                                     expert_capacity=ctx.capacity)
        return None, grad_x, None, grad_topk_w, None, None, None


class CombineExpertMajor(torch.autograd.Function):
    """y_em (expert-major rows) -> combined_x on the tokens' home ranks."""

    @staticmethod
    def forward(ctx: Any, buffer: Buffer, y_em: torch.Tensor, handle: HTHandle, em_map: torch.Tensor,
                expert_capacity: int = 0):
        combined, _, _ = buffer.combine_expert_major(y_em, handle, em_map, expert_capacity=expert_capacity)
        ctx.buffer, ctx.handle, ctx.rows, ctx.capacity = buffer, handle, y_em.size(0), expert_capacity
        ctx.save_for_backward(em_map)
        return combined

    @staticmethod
    def backward(ctx: Any, grad_combined: torch.Tensor):
        (em_map,) = ctx.saved_tensors
        with validation.trusted_values():  # em_map was checked (or trusted) by the forward
            grad_em, _ = ctx.buffer.dispatch_expert_major_cached(grad_combined.contiguous(), ctx.handle, em_map,
                                                                 num_rows=ctx.rows, expert_capacity=ctx.capacity)
        return None, grad_em, None, None, None


def dispatch_expert_major(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor,
                          topk_weights: Optional[torch.Tensor], num_experts: int, num_worst_tokens: int = 0,
                          expert_capacity: int = 0):
    """Differentiable expert-major dispatch: returns (x_em, recv_topk_idx, recv_topk_weights,
    tokens_per_expert_list, em_map, handle); see Buffer.dispatch_expert_major (num_worst_tokens and
    expert_capacity: the sync-free capacity layout)."""
    return DispatchExpertMajor.apply(buffer, x, topk_idx, topk_weights, num_experts, num_worst_tokens,
                                     expert_capacity)


def combine_expert_major(buffer: Buffer, y_em: torch.Tensor, handle: HTHandle, em_map: torch.Tensor,
                         expert_capacity: int = 0):
    """Differentiable expert-major combine: returns combined_x `[num_tokens, hidden]` (expert_capacity: the
    dispatch's, for a capacity layout)."""
    return CombineExpertMajor.apply(buffer, y_em, handle, em_map, expert_capacity)
