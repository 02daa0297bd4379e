"""Communication handles returned by dispatch and consumed by combine / cached dispatch.

Handles are tuples laid out like DeepEP v1.2.1's where callers read them (DESIGN.md "Drop-in"):
- `IntranodeHandle[0]` is the rank prefix matrix `[num_ranks, num_ranks]` int32: entry [i][r] = tokens that
  ranks 0..i send to rank r, i.e. where rank i's rows end in rank r's receive buffer.
- `LowLatencyHandle[0]` is src_info `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank]`
  int32 (each received row's source token index); `[1]` is layout_range `[num_local_experts, num_ranks]`
  int64 (`(begin << 32) | count` per source rank).
The fields after DeepEP's are ours: the number of rows dispatch returned (cached dispatch returns as many;
the valid ones are counted by the rank prefix matrix), the sender's token count, the owning Buffer's id (a
handle from another Buffer is rejected), and backend-private state.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch


class IntranodeHandle(NamedTuple):
    rank_prefix_matrix: torch.Tensor  # [num_ranks, num_ranks] int32, prefix over source ranks
    channel_prefix_matrix: torch.Tensor  # [num_ranks, num_channels] int32: send side, prefix per channel
    recv_channel_prefix_matrix: torch.Tensor  # [num_ranks, num_channels] int32: receive side
    recv_src_idx: torch.Tensor  # [num_recv_tokens] int32: source token index of each received row
    is_token_in_rank: torch.Tensor  # [num_tokens, num_ranks] bool: send side
    send_head: torch.Tensor  # [num_tokens, num_ranks] int32: row of token t among rows sent to r, or -1
    num_recv_tokens: int  # rows of dispatch's outputs: received tokens, or num_worst_tokens when padded
    num_tokens: int  # tokens on the sending side (rows of combine's output)
    owner: int  # id of the Buffer that made it
    private: Any = None  # backend-private state (native: device-side layout)

    @classmethod
    def with_one_channel(cls, rank_prefix_matrix: torch.Tensor, num_tokens_per_rank: torch.Tensor, rank: int,
                         recv_src_idx: torch.Tensor, is_token_in_rank: torch.Tensor, send_head: torch.Tensor,
                         num_recv_tokens: int, num_tokens: int, owner: int, private: Any = None,
                         channels: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> "IntranodeHandle":
        """A handle whose rows move as one channel per rank pair (both backends): DeepEP's channel matrices
        are then the rows sent to each rank, and where each source rank's rows start on this rank.
        `channels`: those two matrices when the backend already has them (the native notify writes them)."""
        if channels is None:
            R = rank_prefix_matrix.size(0)
            starts = torch.cat([rank_prefix_matrix.new_zeros(1, R), rank_prefix_matrix[:-1]])
            channels = num_tokens_per_rank.reshape(R, 1).clone(), starts[:, rank].reshape(R, 1).contiguous()
        return cls(rank_prefix_matrix, *channels, recv_src_idx, is_token_in_rank, send_head,
                   num_recv_tokens, num_tokens, owner, private)


class LowLatencyHandle(NamedTuple):
    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    owner: int = -1
    private: Any = None


def check_intranode_handle(handle: Any, owner: int, arg: str = "handle") -> IntranodeHandle:
    """Reject anything but an IntranodeHandle made by Buffer `owner`."""
    if not isinstance(handle, IntranodeHandle):
        raise TypeError(f"{arg}: expected the handle returned by this Buffer's dispatch(), got {type(handle).__name__}")
    if handle.owner != owner:
        raise ValueError(f"{arg}: this handle was made by another Buffer (id {handle.owner}, this one is {owner})")
    return handle


def check_low_latency_handle(handle: Any, owner: int, arg: str = "handle") -> LowLatencyHandle:
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError(f"{arg}: expected the handle returned by this Buffer's low_latency_dispatch(), "
                        f"got {type(handle).__name__}")
    if handle.owner != owner:
        raise ValueError(f"{arg}: this handle was made by another Buffer (id {handle.owner}, this one is {owner})")
    return handle


def prefix_matrix_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """counts[i][r] = tokens rank i sends to rank r  ->  DeepEP's rank prefix matrix (cumsum over i)."""
    return torch.cumsum(counts.to(torch.int64), dim=0).to(torch.int32)

