"""Cross-rank agreement at Buffer creation, and the release of Buffers every rank dropped.

Peers write into each other's buffers at offsets each computes from its own settings: ranks that differ in a
buffer size, a mode or a wire-format setting would corrupt each other's memory silently. So `Buffer`
gathers every rank's settings once, at creation, and raises the same `ValueError` on every rank, naming the
argument or variable and each rank's value, before any data moves.

The same gather releases Buffers that were garbage-collected without `destroy()`. A destructor must not
run a collective (ranks collect garbage at different times), and must not free memory a peer may still
write into (a peer's next op writes into this rank's buffer once this rank said it finished the previous
one). So a dropped Buffer's resources are parked; the next Buffer creation on the same group, after every
rank finished its GPU work, frees the ones that every rank has dropped: no rank can start an op on them
any more. At interpreter exit, what is still parked is released locally.

Both tables hold their groups weakly: a Buffer's bookkeeping must not keep a process group alive after
`dist.destroy_process_group`. A gloo group joins its worker threads only in its C++ destructor; one kept
alive here would live into interpreter finalization, where a worker still dropping the tensors of the last
collective (which needs the GIL) is ended by Python mid-destructor: std::terminate, SIGABRT at exit. (A
parked release holds its Buffer's backends, which hold the group: that group lives until the release runs,
at the next Buffer creation or at exit, where the atexit handler below drops it while Python still runs.)
"""
from __future__ import annotations

import atexit
import os
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

# Environment settings that decide what a rank writes into its peers' memory (or how it cuts and signals
# it): they must be the same on every rank. (The kernels' tuning knobs are per-call Config fields: the one
# that changes what peers read, whether a fresh expert-major dispatch expands inside the kernel, travels in
# the call's shape header and is compared there: backends/native.py, shape_header.)
SHARED_SETTINGS = (
    "UCCL_EP_BACKEND",
    "UCCL_EP_TRANSPORT",
    "UCCL_EP_RDMA_CHUNK_BYTES",
    "UCCL_EP_PROXY_THREADS",
    "UCCL_EP_VERBS_NATIVE_ATOMICS",
)

# group -> Buffers created on it so far (the same on every rank)
_sequence: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
# group -> {sequence number: local release}
_parked: "weakref.WeakKeyDictionary[Any, dict[int, Callable[[], None]]]" = weakref.WeakKeyDictionary()


def next_sequence(group: Any) -> int:
    """The creation number of a new Buffer on `group` (ranks create Buffers on a group in the same order)."""
    _sequence[group] = _sequence.get(group, 0) + 1
    return _sequence[group]


def park(group: Any, sequence: int, release: Callable[[], None]) -> None:
    """A dropped Buffer's local release, run once every rank dropped it (see the module docstring)."""
    _parked.setdefault(group, {})[sequence] = release


def agree(group: Any, device: torch.device, sequence: int, arguments: dict) -> None:
    """Collective over `group`, at Buffer creation: raises the same ValueError on every rank unless the ranks
    agree on `arguments` (name -> value), on SHARED_SETTINGS and on the creation sequence; then releases the
    parked Buffers every rank dropped."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # before the gather: after it, no rank's kernel still uses a parked one
    parked = _parked.get(group, {})
    mine = {"arguments": arguments, "settings": {k: os.environ.get(k) for k in SHARED_SETTINGS},
            "sequence": sequence, "parked": sorted(parked)}
    ranks: list = [None] * group.size()
    dist.all_gather_object(ranks, mine, group=group)
    problems = _disagreements([{"Buffer creation number": r["sequence"], **r["arguments"], **r["settings"]}
                               for r in ranks])
    everywhere = set.intersection(*(set(r["parked"]) for r in ranks))
    for seq in sorted(everywhere):
        parked.pop(seq)()
    if problems:
        raise ValueError("Buffer: the ranks disagree on " + "; ".join(problems) + " (peers write into each other's "
                         "buffers at offsets computed from their own settings: use the same on every rank)")


def _disagreements(per_rank: list[dict]) -> list[str]:
    out = []
    for key in per_rank[0]:
        values = [r.get(key) for r in per_rank]
        if len({repr(v) for v in values}) > 1:
            out.append(f"{key} (" + ", ".join(f"rank {i}: {v!r}" for i, v in enumerate(values)) + ")")
    return out


@atexit.register
def _release_parked_at_exit() -> None:
    """Every rank is leaving: what is still parked is released locally (threads joined, agents stopped)."""
    for parked in list(_parked.values()):
        for release in list(parked.values()):
            try:
                release()
            except Exception:  # exiting: report nothing, release the rest
                pass
    _parked.clear()
