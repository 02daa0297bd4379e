"""The Python side's one home of the sentences a failed call raises (the native side's is csrc/common/errors.h,
which turns the kernels' error records into sentences in the same words): a bad expert id, an exchange that
timed out, ranks that disagree on a call. Each says what was expected or waited for, from whom, why that
usually happens and what to do; raw numbers go last, in parentheses. docs/api.md ("Errors") lists them all.
"""
from __future__ import annotations

from typing import Sequence

class RankLocalError(ValueError):
    """A value check that failed on data only this rank holds (its expert ids, its received sizes): its peers
    passed theirs, so unlike the other ValueErrors (raised alike on every rank) it aborts the call on every rank
    (Buffer._abort_on_error) instead of leaving the peers to UCCL_EP_TIMEOUT_S. Still a ValueError for callers."""


# What every rank must agree on for a call (the shape header's fields), said where they disagree.
SAME_CALL = "every rank must make the same call (hidden size, dtype, top-k, experts, weights given or not)"


def bad_expert_id(arg: str, row: int, col: int, value: int, num_experts: int, rank: int) -> str:
    """`arg[row, col] = value` outside [-1, num_experts) on `rank`: the host's check; the GPU's (the native
    kernels) says the same and adds where it was found."""
    return (f"{arg}[{row}, {col}] = {value} is outside [-1, {num_experts}) on rank {rank}: expert ids are -1 "
            f"(no expert) or in [0, num_experts)")


def ranks_disagree(op: str, name: str, values: Sequence[int]) -> str:
    """The ranks passed different `name`s to `op` (values in rank order): raised alike on every rank."""
    return (f"{op}: ranks disagree on {name}: " + ", ".join(f"rank {r}={v}" for r, v in enumerate(values))
            + f"; {SAME_CALL}")


def exchange_timed_out(rank: int, phase: str, channel: str, limit_s: float) -> str:
    """A host-side wait for the peers' part of an exchange passed UCCL_EP_TIMEOUT_S."""
    return (f"uccl_ep_train: rank {rank} timed out after {limit_s:.0f}s in phase '{phase}' (channel {channel}): a "
            f"peer rank never arrived. Is every rank making the same Buffer calls in the same order? A rank that "
            f"raised earlier, or exited, leaves its peers waiting here; raise UCCL_EP_TIMEOUT_S if the peers are "
            f"only slow")


def exchange_failed(rank: int, phase: str, channel: str, cause: BaseException) -> str:
    """The process group reported a failure of an exchange (a peer's connection closed, ...)."""
    return (f"uccl_ep_train: rank {rank} failed in phase '{phase}' (channel {channel}): {cause} (a peer that "
            f"exited or raised closes its connections: look for its own error first)")
