"""Which ranks form a node: the NVLink/xGMI domain the internode path aggregates over.

A node is a group of `ranks_per_node` consecutive ranks of the group (rank = node * ranks_per_node + local
index), taken from `UCCL_EP_RANKS_PER_NODE` if set (ranks of the group per node), else from torchrun's
`LOCAL_WORLD_SIZE` (global rank // LOCAL_WORLD_SIZE names a rank's node, so a group that is a strided subset
of the world, e.g. an expert-parallel group beside tensor parallelism, gets its own count), else the number
of ranks sharing this rank's host name. It is decided at run time (no compile-time 8), which is also what
lets one host play several nodes: 4 ranks with `UCCL_EP_RANKS_PER_NODE=2` are 2 nodes x 2, and the bytes
between them go through the CPU proxies exactly as they would between hosts.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

# The native kernels' limits on a group's shape, in one place: the backends check a built module's values
# against these (native_limit), and `uccl-ep-train plan` checks layouts against them without the module.
MAX_RANKS_PER_NODE = 8  # one NVLink / xGMI domain (the native kernels' per-node peer table): native
#                         INTRANODE_MAX_RANKS, INTERNODE_MAX_LOCAL, LL_MAX_LOCAL
MAX_NODES = 32  # nodes of one group on the internode path (its per-node tables travel as kernel arguments):
#                 native INTERNODE_MAX_NODES


def native_limit(native: Any, name: str, shared: int) -> int:
    """The native module's limit `name`, which must be the shared constant the Python side plans with (a
    module built from other sources would otherwise pass layouts its kernels cannot take, or refuse good ones)."""
    value = int(getattr(native, name))
    if value != shared:
        raise RuntimeError(f"the native module has {name} = {value} but uccl_ep_train.topology says {shared}: "
                           f"{getattr(native, '__file__', 'it')} was built from other sources; rebuild it from this "
                           "version's csrc")
    return value


@dataclass(frozen=True)
class Topology:
    num_ranks: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"Topology: num_ranks must be >= 1, got {self.num_ranks}")
        if not 1 <= self.ranks_per_node <= self.num_ranks or self.num_ranks % self.ranks_per_node:
            raise ValueError(f"ranks_per_node ({self.ranks_per_node}) must divide the number of ranks "
                             f"({self.num_ranks}) (UCCL_EP_RANKS_PER_NODE / LOCAL_WORLD_SIZE)")
        if self.ranks_per_node > MAX_RANKS_PER_NODE:
            raise ValueError(f"ranks_per_node ({self.ranks_per_node}): a node holds at most {MAX_RANKS_PER_NODE} "
                             "ranks (one NVLink / xGMI domain); set UCCL_EP_RANKS_PER_NODE")

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    @property
    def internode(self) -> bool:
        return self.num_nodes > 1

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def rank_of(self, node: int, local: int) -> int:
        return node * self.ranks_per_node + local


def _env_int(var: str) -> Optional[int]:
    raw = os.environ.get(var)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{var}={raw!r} is not an int") from None
    if value < 1:
        raise ValueError(f"{var} must be >= 1, got {value}")
    return value


def ranks_per_node_from_env() -> Optional[int]:
    """Ranks per node as far as the environment says (UCCL_EP_RANKS_PER_NODE, else torchrun's
    LOCAL_WORLD_SIZE), for sizing before any group exists; None when neither is set."""
    return _env_int("UCCL_EP_RANKS_PER_NODE") or _env_int("LOCAL_WORLD_SIZE")


def _this_rank(global_rank: int) -> tuple[Optional[int], str]:
    """(UCCL_EP_RANKS_PER_NODE, the name of this rank's node): torchrun's node index when LOCAL_WORLD_SIZE
    is set (it counts ranks of the world, not of the group), else the host name."""
    local_world = _env_int("LOCAL_WORLD_SIZE")
    node = f"torchrun node {global_rank // local_world}" if local_world else socket.gethostname()
    return _env_int("UCCL_EP_RANKS_PER_NODE"), node


def topology_from(per_rank: list[tuple[Optional[int], str]]) -> Topology:
    """The topology every rank agrees on, from each rank's (UCCL_EP_RANKS_PER_NODE, node name: host name or
    torchrun node). Raises the same ValueError on every rank when they disagree."""
    num_ranks = len(per_rank)
    settings = {v for v, _ in per_rank}
    if len(settings) > 1:
        raise ValueError("ranks disagree on ranks per node (UCCL_EP_RANKS_PER_NODE): " +
                         ", ".join(f"rank {r}={v}" for r, (v, _) in enumerate(per_rank)))
    value = settings.pop()
    if value is None:
        hosts = [h for _, h in per_rank]
        value = hosts.count(hosts[0])
        expected = [hosts[(r // value) * value] for r in range(num_ranks)] if num_ranks % value == 0 else None
        if expected != hosts or len(set(hosts)) != num_ranks // value:
            raise ValueError("ranks of one node must be consecutive and every node must hold as many ranks "
                             f"(node names by rank: {hosts}); set UCCL_EP_RANKS_PER_NODE")
    return Topology(num_ranks, min(value, num_ranks))


def detect_topology(group: Any) -> Topology:
    """Collective over `group`: every rank gets the same Topology (see the module docstring)."""
    import torch.distributed as dist

    try:
        mine: Any = _this_rank(dist.get_rank())
    except ValueError as exc:  # sent to every rank, so that none waits in a collective the others left
        mine = str(exc)
    per_rank: list = [None] * group.size()
    dist.all_gather_object(per_rank, mine, group=group)
    errors = [f"rank {r}: {v}" for r, v in enumerate(per_rank) if isinstance(v, str)]
    if errors:
        raise ValueError("; ".join(errors))
    return topology_from(per_rank)
