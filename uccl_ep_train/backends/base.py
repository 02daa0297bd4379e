"""The contract between `Buffer` and a backend.

`Buffer` validates every argument (before any communication), picks the stream, waits on
`previous_event` and records the completion event; a backend only moves data, enqueuing its work on the
current stream (CUDA) or running it (CPU). Every backend must give the same results as `reference`:
bit-exact for dispatch (same rows, same order), within reduction tolerance for combine.
"""
from __future__ import annotations

import abc
from typing import Callable, Optional

import torch

from ..config import Config
from ..handles import IntranodeHandle, LowLatencyHandle


class Backend(abc.ABC):
    name: str = "abstract"
    supports_low_latency: bool = True  # False: Buffer serves low-latency calls with the reference backend

    def __init__(self, group, rank: int, num_ranks: int, owner: int, num_nvl_bytes: int, num_rdma_bytes: int):
        self.group, self.rank, self.num_ranks, self.owner = group, rank, num_ranks, owner
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes

    # ---- high throughput -------------------------------------------------------------------------------
    @abc.abstractmethod
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool)."""

    @abc.abstractmethod
    def dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], num_tokens_per_rank: torch.Tensor,
                 is_token_in_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor, expert_alignment: int,
                 num_worst_tokens: int, config: Config
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor],
                            list[int], IntranodeHandle]:
        """Fresh dispatch -> (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle). Receive order: source rank, then source token index."""

    @abc.abstractmethod
    def cached_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: IntranodeHandle,
                        config: Config) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Dispatch with the layout of `handle` (no counts exchange) -> (recv_x, recv_x_scales)."""

    @abc.abstractmethod
    def combine(self, x: torch.Tensor, handle: IntranodeHandle, topk_weights: Optional[torch.Tensor],
                bias_0: Optional[torch.Tensor], bias_1: Optional[torch.Tensor], config: Config
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Sum, per original token, the rows it was sent as (+ biases) -> (combined_x, combined_topk_weights)."""

    # ---- low latency -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor]
                             ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, LowLatencyHandle,
                                        Callable[[], None]]:
        """-> (packed_recv_x, packed_recv_x_scales, packed_recv_count, handle, receive). Sends are issued at
        once; `receive()` completes the arrival into the returned tensors (it is the recv hook)."""

    @abc.abstractmethod
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, out: torch.Tensor) -> Callable[[], None]:
        """Weighted reduce of expert outputs back to their tokens into `out`; returns `receive()`."""

    def low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The buffer a zero-copy combine reads: `[num_local_experts, num_ranks * max_tokens, hidden]` bf16."""
        raise NotImplementedError(f"{self.name} backend: zero_copy low-latency combine")

    def local_buffer(self, use_rdma_buffer: bool) -> torch.Tensor:
        """This rank's communication buffer as a uint8 tensor (a view, for get_local_buffer_tensor)."""
        raise NotImplementedError(f"get_local_buffer_tensor: the {self.name} backend has no "
                                  f"{'RDMA' if use_rdma_buffer else 'NVLink'} communication buffer to expose")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: every rank must call it; returns once all ranks have cleaned."""

    def destroy(self) -> None:
        """Release every resource; the Buffer can be rebuilt afterwards in the same process."""
