"""Communication handles returned by dispatch and consumed by combine / cached dispatch.

Handles are tuples laid out like DeepEP v1.2.1's where callers read them (docs/deep_ep.md):
- `IntranodeHandle[0]` is the rank prefix matrix `[num_ranks, num_ranks]` int32: entry [i][r] = tokens that
  ranks 0..i send to rank r, i.e. where rank i's rows end in rank r's receive buffer.
- `LowLatencyHandle[0]` is src_info `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank]`
  int32 (each received row's source token index); `[1]` is layout_range `[num_local_experts, num_ranks]`
  int64 (`(begin << 32) | count` per source rank).
- `InternodeHandle` (a Buffer whose ranks span several nodes, see topology.py) has DeepEP's 10 internode
  items, `[0]` is_token_in_rank; its receive order is the intranode one, only the handle differs.
The fields after DeepEP's are ours: the number of rows dispatch returned (cached dispatch returns as many;
the valid ones are counted by the rank prefix matrix / rank prefix sum), the sender's token count, the
owning Buffer's id (a handle from another Buffer is rejected), and backend-private state.
`rows_per_source` and `send_head_of` read what cached dispatch and combine need from either kind.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple, Union

import torch

from .topology import Topology


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


class InternodeHandle(NamedTuple):
    """The handle of a dispatch across nodes: DeepEP v1.2.1's 10 internode items first (one channel per
    rank pair: every `*_channel_prefix_matrix` has one column), then ours. N = nodes, L = ranks per node,
    R = N * L; "forwarded rows" are the rows this rank received from the rank with its local index on each
    node (its own node included: its own tokens bound for its node), source node by source node, token
    order within each: the rows it moves over NVLink/xGMI to their final ranks."""

    is_token_in_rank: torch.Tensor  # [num_tokens, R] bool: send side
    rdma_channel_prefix_matrix: torch.Tensor  # [N, 1] int32: tokens this rank sends to each node
    gbl_channel_prefix_matrix: torch.Tensor  # [R, 1] int32: tokens this rank sends to each rank
    recv_rdma_channel_prefix_matrix: torch.Tensor  # [N, 1] int32: rows this rank forwards per source node
    recv_rdma_rank_prefix_sum: torch.Tensor  # [N] int32: inclusive prefix of the above
    recv_gbl_channel_prefix_matrix: torch.Tensor  # [R, 1] int32: first receive row of each source rank
    recv_gbl_rank_prefix_sum: torch.Tensor  # [R] int32: inclusive prefix of rows received per source rank
    recv_src_meta: torch.Tensor  # [num_recv_tokens, 8] uint8: int32 source token index, int32 source rank
    send_rdma_head: torch.Tensor  # [num_tokens, N] int32: row of token t among the tokens sent to node n, -1
    send_nvl_head: torch.Tensor  # [forwarded rows, L] int32: receive row of each forwarded row on local rank j, -1
    num_recv_tokens: int  # rows of dispatch's outputs: received tokens, or num_worst_tokens when padded
    num_tokens: int  # tokens on the sending side (rows of combine's output)
    ranks_per_node: int
    owner: int
    private: Any = None

    @classmethod
    def with_one_channel(cls, counts: torch.Tensor, num_tokens_per_rdma_rank: torch.Tensor,
                         is_token_in_rank: torch.Tensor, forwarded_per_node: torch.Tensor,
                         send_nvl_head: torch.Tensor, topology: Topology, rank: int, recv_src_idx: torch.Tensor,
                         num_tokens: int, owner: int, private: Any = None,
                         send_rdma_head: Optional[torch.Tensor] = None) -> "InternodeHandle":
        """The handle of a dispatch whose rows move as one channel per rank pair: what each item means (the
        reference backend builds it here; the native internode backend takes the same items from its kernels'
        call info, checked against this in tests/test_internode_gpu.py).

        counts: [R, R] counts[s][r] = tokens rank s sends to rank r (every rank's num_tokens_per_rank).
        num_tokens_per_rdma_rank: [N] this rank's tokens per node (get_dispatch_layout's).
        is_token_in_rank: [T, R] bool, this rank's routing.
        forwarded_per_node, send_nvl_head: [N] rows this rank forwards from each node and [those rows, L]
            where each lands (the native kernels write the latter; `forwarded_rows` computes both from the
            same-index ranks' routing).
        recv_src_idx: [num_recv_tokens] int32 source token index per received row, -1 for padding rows
            (num_recv_tokens = rows dispatch returned).
        send_rdma_head: [T, N] int32 when the caller has it already (else derived from is_token_in_rank)."""
        N, L = topology.num_nodes, topology.ranks_per_node
        dev = is_token_in_rank.device
        counts = counts.to(device=dev, dtype=torch.int64)
        received = counts[:, rank]
        recv_prefix = torch.cumsum(received, 0)
        rows = torch.arange(recv_src_idx.size(0), device=dev)
        # received rows are grouped by source rank: row i comes from the first source whose prefix passes i
        src_rank = torch.where(rows < recv_prefix[-1], torch.searchsorted(recv_prefix, rows, right=True), -1)
        src_rank = src_rank.to(torch.int32)
        recv_src_meta = torch.stack([recv_src_idx.to(torch.int32), src_rank], dim=1).contiguous().view(torch.uint8)
        recv_rdma = forwarded_per_node.to(device=dev, dtype=torch.int32)
        if send_rdma_head is None:
            send_rdma_head = send_positions(nodes_of_tokens(is_token_in_rank, N))
        return cls(is_token_in_rank,
                   num_tokens_per_rdma_rank.to(torch.int32).reshape(N, 1).clone(),
                   counts[rank].to(torch.int32).reshape(-1, 1),
                   recv_rdma.reshape(N, 1),
                   torch.cumsum(recv_rdma, 0, dtype=torch.int32),
                   (recv_prefix - received).to(torch.int32).reshape(-1, 1),
                   recv_prefix.to(torch.int32),
                   recv_src_meta,
                   send_rdma_head,
                   send_nvl_head,
                   recv_src_idx.size(0), num_tokens, L, owner, private)

    @property
    def recv_src_idx(self) -> torch.Tensor:
        """[num_recv_tokens] int32: source token index of each received row (-1 for padding)."""
        return self.recv_src_meta.view(torch.int32)[:, 0]

    @property
    def recv_src_rank(self) -> torch.Tensor:
        """[num_recv_tokens] int32: source rank of each received row (-1 for padding)."""
        return self.recv_src_meta.view(torch.int32)[:, 1]


HTHandle = Union[IntranodeHandle, InternodeHandle]


class LowLatencyHandle(NamedTuple):
    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    owner: int = -1
    private: Any = None


def check_ht_handle(handle: Any, owner: int, arg: str = "handle") -> HTHandle:
    """Reject anything but an intranode or internode handle made by Buffer `owner`."""
    if not isinstance(handle, (IntranodeHandle, InternodeHandle)):
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



def send_positions(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """[..., T, D] bool -> int32 position of token t among the tokens sent to destination d (token order),
    or -1: DeepEP's send_head (destinations: ranks) and send_rdma_head (destinations: nodes)."""
    mask = is_token_in_rank.to(torch.int32)
    return torch.where(is_token_in_rank, torch.cumsum(mask, dim=-2, dtype=torch.int32) - 1, -1).to(torch.int32)


def nodes_of_tokens(is_token_in_rank: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """[T, R] bool -> [T, num_nodes] bool: token t has at least one destination rank on node n (nodes are
    consecutive blocks of ranks, topology.py)."""
    T, R = is_token_in_rank.shape
    return is_token_in_rank.view(T, num_nodes, R // num_nodes).any(dim=-1)


def forwarded_rows(counts: torch.Tensor, same_index_in_rank: torch.Tensor, topology: Topology,
                   rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows forwarded from each node [N] int32, send_nvl_head [those rows, L] int32) of `rank`, from the
    routing of the ranks with its local index: same_index_in_rank [N, T', R] bool, node n's rank at [n], rows
    past a rank's token count False. A forwarded row is a token of rank (n, local) with a destination on this
    node; on local rank j it lands at the first row of its source there plus its position among the tokens
    that source sends to j."""
    N, L = topology.num_nodes, topology.ranks_per_node
    node, local = topology.node_of(rank), topology.local_of(rank)
    counts = counts.to(device=same_index_in_rank.device, dtype=torch.int64)
    to_my_node = same_index_in_rank[:, :, node * L:(node + 1) * L]
    starts = (torch.cumsum(counts, 0) - counts)[[topology.rank_of(n, local) for n in range(N)], node * L:(node + 1) * L]
    nvl_head = torch.where(to_my_node, starts.unsqueeze(1) + send_positions(to_my_node), -1).to(torch.int32)
    forwarded = to_my_node.any(dim=-1)
    return forwarded.sum(dim=1, dtype=torch.int32), nvl_head[forwarded]


def rows_per_source(handle: HTHandle, rank: int) -> torch.Tensor:
    """[R] int64: rows `rank` received from each source rank with this handle (num_worst_tokens padding
    not included), from either handle kind."""
    if isinstance(handle, InternodeHandle):
        prefix = handle.recv_gbl_rank_prefix_sum
    else:
        prefix = handle.rank_prefix_matrix[:, rank]
    prefix = prefix.to(torch.int64)
    return torch.diff(prefix, prepend=prefix.new_zeros(1))


def send_head_of(handle: HTHandle) -> torch.Tensor:
    """[T, R] int32: position of token t among the rows sent to rank r, or -1, from either handle kind (the
    internode handle's send heads are per node and per forwarded row, so it is derived here)."""
    if isinstance(handle, InternodeHandle):
        return send_positions(handle.is_token_in_rank)
    return handle.send_head
