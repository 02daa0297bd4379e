"""The uccl dispatcher's per-rank receive budget (Megatron-LM main's `moe_expert_rank_capacity_factor`).

Megatron-LM main (commit d98e8a6) gives its flex backends a receive budget: with the factor set, each rank
receives into a fixed number of rows (static shapes, CUDA-graph capturable) and tokens beyond it are dropped
and reported; with it None the receive is sized per step (eager). Its paged-stash runner
(megatron/core/transformer/moe/paged_stash.py) then replays an overflowed step without dropping. It reads
the dispatcher's hooks (`check_over_budget`, `check_required_capacity`, `reset_over_budget`,
`grow_ep_recv_capacity`, `invalidate_ep_bootstrap`) and writes `token_dispatcher._comm_manager.
moe_expert_rank_capacity_factor` (None for the replay, the config's value after it); it reads
`_comm_manager._max_tokens_per_rank` and `.router_topk` to tell the user the factor that would have fitted.
`RecvBudget` is that `_comm_manager` for UCCLTokenDispatcher.

How the budget maps onto our Buffer: the static mode is the capacity layout of
`Buffer.dispatch_expert_major` (docs/api.md), the one drop-and-pad uses, so it needs no new kernel and is
sync-free and capturable on the native backends (one node and across nodes). The budget of R rows per rank becomes
`capacity = ceil(R / (num_local_experts * ep_size))` rows per (local expert, source rank) block, and the
receive is exactly `num_local_experts * ep_size * capacity` rows (uccl_ep_train.sizing.budget_capacity);
the receive-order rows before the expansion, the dispatch's num_worst_tokens, are at most
`ep_size * min(tokens, num_local_experts * capacity)` (sizing.capacity_recv_tokens), which is what the
native backend's buffer is sized for: not every token of every rank. The sender keeps, for each expert, its
first `capacity` tokens in token order (local work on the routing map, no communication) and drops the
rest; the overflow flag and the capacity needed are device tensors, accumulated per dispatch, never read on
the host. A block budget is stricter than a whole-rank one (ncclep's): a rank whose total fits can still
overflow one expert's block; the capacity `required_recv` reports is in the same rows, so growing the budget
to it always fits the routing that overflowed.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from uccl_ep_train import sizing
from uccl_ep_train.events import host_values, to_device


def capacity_factor_of(config) -> Optional[float]:
    """The config's moe_expert_rank_capacity_factor (None where megatron-core has no such field)."""
    return getattr(config, "moe_expert_rank_capacity_factor", None)


class RecvBudget:
    """Receive budget and overflow accounting of one uccl dispatcher (Megatron-LM main's `_comm_manager`).

    `moe_expert_rank_capacity_factor` selects the mode at each bootstrap: a float -> static (`capacity` rows
    per block), None -> eager (exact counts, never over budget). Megatron's paged-stash runner sets it to
    None for a replay and back afterwards, calling `invalidate_ep_bootstrap` each time; the next dispatch
    re-derives the mode (`bootstrap`)."""

    def __init__(self, config, num_local_experts: int, ep_size: int, router_topk: int,
                 group: dist.ProcessGroup) -> None:
        self.config = config
        self.moe_expert_rank_capacity_factor = capacity_factor_of(config)
        self.num_local_experts = num_local_experts
        self.ep_size = ep_size
        self.router_topk = router_topk
        self.group = group
        # Device tensors, accumulated per dispatch (no host sync); made at the first bootstrap, on the
        # tokens' device. over_budget: bool [1]; required_recv: int64 [1], rows per rank that would have fit.
        self.over_budget: Optional[torch.Tensor] = None
        self.required_recv: Optional[torch.Tensor] = None
        self._bootstrapped = False
        self._max_tokens_per_rank: Optional[int] = None  # the EP group's largest token count at bootstrap
        self._recv_capacity: Optional[int] = None  # rows per rank (static), None (eager)
        self._recv_capacity_override: Optional[int] = None  # grow_recv_capacity's, monotonic
        self.capacity: Optional[int] = None  # rows per (local expert, source rank) block (static), None (eager)

    @property
    def static(self) -> bool:
        return self.capacity is not None

    @property
    def worst_recv_tokens(self) -> int:
        """Static mode: the receive-order rows of the capacity layout (each source's tokens at most once, and
        at most `capacity` per local expert: sizing.capacity_recv_tokens, not every token of every rank);
        eager: 0 (sized by the counts)."""
        if not self.static:
            return 0
        return sizing.capacity_recv_tokens(self._max_tokens_per_rank, self.num_local_experts, self.ep_size,
                                           self.capacity)

    def bootstrap(self, num_tokens: int, device: torch.device) -> None:
        """Derive the mode and, when static, the capacity, on the first dispatch and after
        `invalidate_ep_bootstrap`. Static: one all-reduce (MAX of the token counts and of the grown budgets over
        the EP group, a host sync) so that every rank lays out the same capacity; every rank bootstraps at the same dispatch
        (the hooks are called on every rank), so the collective matches. Not during CUDA-graph capture."""
        if self.over_budget is None or self.over_budget.device != device:
            self.over_budget = torch.zeros(1, dtype=torch.bool, device=device)
            self.required_recv = torch.zeros(1, dtype=torch.int64, device=device)
        if self._bootstrapped:
            if self.static and num_tokens > self._max_tokens_per_rank:
                raise ValueError(
                    f"moe_expert_rank_capacity_factor: this rank has {num_tokens} tokens, more than the "
                    f"{self._max_tokens_per_rank} its static receive budget was sized for; call "
                    "invalidate_ep_bootstrap() on every rank before the step, or leave the factor unset (eager); "
                    "only this rank raises here, so its peers wait in the dispatch until UCCL_EP_TIMEOUT_S")
            return
        factor = self.moe_expert_rank_capacity_factor
        if factor is None:
            self._max_tokens_per_rank = num_tokens
            self._recv_capacity = self.capacity = None
        else:
            # the grown budget rides along: a caller that grew ranks by their own needs still lays out one capacity
            most = to_device(np.array([num_tokens, self._recv_capacity_override or 0], dtype=np.int64), device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
            self._max_tokens_per_rank, override = host_values(most)
            self._recv_capacity_override = override or None
            self.capacity = sizing.budget_capacity(self._max_tokens_per_rank, self.router_topk, factor,
                                                   self.num_local_experts, self.ep_size, override)
            self._recv_capacity = self.capacity * self.num_local_experts * self.ep_size
        self._bootstrapped = True

    def limit(self, routing_map: torch.Tensor) -> torch.Tensor:
        """Static mode: the routing map without the selections past their expert's capacity (each expert
        keeps this rank's first `capacity` tokens), accumulating the overflow flag and the rows needed.
        Eager: the map as it is. Device ops only."""
        if not self.static:
            return routing_map
        taken = routing_map.to(torch.int32).cumsum(0)  # this rank's tokens for each expert so far
        need = taken[-1].max() if taken.numel() else taken.new_zeros(())
        self.over_budget.logical_or_(need > self.capacity)
        torch.maximum(self.required_recv, need.to(torch.int64) * (self.num_local_experts * self.ep_size),
                      out=self.required_recv)
        return routing_map & (taken <= self.capacity)

    def reset(self) -> None:
        """Clear the overflow flag and the capacity needed (Megatron's reset_over_budget)."""
        if self.over_budget is not None:
            self.over_budget.fill_(False)
            self.required_recv.fill_(0)

    def grow_recv_capacity(self, new_capacity: int) -> None:
        """Raise the static budget to `new_capacity` rows per rank (the capacity an overflowed step needed),
        so the restored static mode fits that routing; takes effect at the next bootstrap. A no-op where the
        config sets no factor (eager: nothing to grow), as in Megatron's ncclep manager."""
        if capacity_factor_of(self.config) is None:
            return
        if isinstance(new_capacity, bool) or not isinstance(new_capacity, int) or new_capacity <= 0:
            raise ValueError(f"grow_ep_recv_capacity: new_capacity must be a positive int (rows per rank), "
                             f"got {new_capacity!r}")
        if new_capacity <= (self._recv_capacity_override or 0):
            raise ValueError(f"grow_ep_recv_capacity: the receive capacity only grows: {new_capacity} rows is not "
                             f"above the current {self._recv_capacity_override}")
        self._recv_capacity_override = new_capacity
        self._bootstrapped = False
