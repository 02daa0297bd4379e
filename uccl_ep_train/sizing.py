"""How large one rank's communication buffers are, and when they grow: the one home of the sizing rules.

The native backends open their buffers small and grow them collectively when a call needs more (every rank
derives the same size from the globally known counts); `uccl-ep-train plan` reports what each mode takes
from these same functions. The byte layouts themselves are the kernels' own: the native module's host
arithmetic (csrc/kernels/layouts.cpp: the intranode row layout and header, the internode layout), which
every build of the module has, GPU kernels or not.

Growth: a buffer that must grow is rebuilt at the bytes needed plus 1/8, rounded up to GROW_STEP, so that a
slightly larger next batch does not rebuild it again.
"""
from __future__ import annotations

import math
from typing import Optional

MIN_BYTES = 32 << 20  # the first buffer of a native backend (intranode NVL buffer; internode NVL and RDMA)
GROW_STEP = 64 << 20  # grown buffers are rounded up to this


def _module():
    from . import _native  # noqa: PLC0415 (optional extension)

    return _native


def layouts_available() -> bool:
    """True when the native module (any build) is importable and carries the layout functions."""
    try:
        m = _module()
    except ImportError:
        return False
    return hasattr(m, "intranode_row_capacity") and hasattr(m, "internode_layout")


def grown_bytes(need: int) -> int:
    """The size a buffer that must hold `need` bytes is rebuilt at."""
    need = int(need)
    return -(-(need + need // 8) // GROW_STEP) * GROW_STEP


# ---- intranode (one node, NVLink / xGMI): one buffer, a header then rows in receive order ------------------
def intranode_bytes_for(rows: int, x_bytes: int, scale_bytes: int, num_topk: int, with_src: bool) -> int:
    """Buffer bytes (header included) that hold `rows` rows of the intranode layout: x, FP8 scales, top-k ids
    and weights, and (a fresh dispatch) the source index."""
    per_row = x_bytes + scale_bytes + num_topk * 12 + (4 if with_src else 0)
    return int(_module().INTRANODE_HEADER_BYTES) + rows * per_row + 5 * 256 + 4096


def intranode_row_capacity(nbytes: int, x_bytes: int, scale_bytes: int, num_topk: int, with_src: bool) -> int:
    """Rows of that layout a buffer of `nbytes` (header included) holds (the kernels' make_row_layout)."""
    m = _module()
    return int(m.intranode_row_capacity(int(nbytes) - int(m.INTRANODE_HEADER_BYTES), x_bytes, scale_bytes,
                                        num_topk, with_src))


def intranode_grow_to(nbytes: int, rows: int, x_bytes: int, scale_bytes: int, num_topk: int,
                      with_src: bool) -> Optional[int]:
    """The size a buffer of `nbytes` must grow to for `rows` rows of that layout; None when they fit."""
    if rows <= intranode_row_capacity(nbytes, x_bytes, scale_bytes, num_topk, with_src):
        return None
    return grown_bytes(intranode_bytes_for(rows, x_bytes, scale_bytes, num_topk, with_src))


def intranode_dispatch_needs(recv_rows: int, send_rows: int, x_bytes: int, scale_bytes: int, num_topk: int,
                             y_bytes: int) -> list[tuple[int, int, int, int, bool]]:
    """The (rows, x_bytes, scale_bytes, num_topk, with_src) a fresh dispatch makes the buffer hold, in the
    order the backend checks them: its receive rows, then the rows its combine sends back (`y_bytes` each)."""
    return [(recv_rows, x_bytes, scale_bytes, num_topk, True), (send_rows, y_bytes, 0, num_topk, False)]


def intranode_bytes_after(nbytes: int, needs: list[tuple[int, int, int, int, bool]]) -> int:
    """The buffer's size after calls that need `needs` (intranode_dispatch_needs), starting at `nbytes`."""
    for need in needs:
        nbytes = intranode_grow_to(nbytes, *need) or nbytes
    return nbytes


# ---- internode (several nodes): NVL buffer (IPC in the node) + RDMA region (the proxies' writes) -----------
def internode_need(rd: list[int], num_ranks: int, ranks_per_node: int, x_bytes: int, scale_bytes: int,
                   num_topk: int, y_bytes: int, max_recv: int, ranks: Optional[list[int]] = None) -> tuple[int, int]:
    """(RDMA bytes, NVL bytes) every rank needs for a dispatch (rows of x_bytes) and a combine (rows of y_bytes)
    of the global per-node counts `rd` (rd[s * N + n]: tokens rank s sends to node n), `max_recv` the most
    rows any rank receives: the largest of the layouts of `ranks` (default: every rank, so that all grow
    alike; counts the same for every rank need only one)."""
    m = _module()
    rdma = nvl = 0
    for r in range(num_ranks) if ranks is None else ranks:
        for xb, yb in ((x_bytes, 0), (0, y_bytes)):
            lay = m.internode_layout(rd, num_ranks, ranks_per_node, r, xb, scale_bytes if xb else 0, num_topk, yb,
                                     max_recv)
            rdma, nvl = max(rdma, lay["rdma_bytes"]), max(nvl, lay["nvl_bytes"])
    return rdma, nvl


def internode_worst_counts(num_ranks: int, ranks_per_node: int, num_worst_tokens: int, num_local_experts: int,
                           capacity: int = 0, max_tokens_per_rank: int = 0) -> tuple[list[int], int]:
    """(rd, max_recv) a sync-free internode dispatch sizes its buffers for (internode_need): per-node counts
    rd[s * N + n] no call can exceed, and num_worst_tokens. Only from what every rank passes alike, as
    worst_send_rows. A rank sends a node at most what that node's L ranks receive from it: at most
    num_worst_tokens each (the counts kernel checks every rank's receive), at most num_local_experts x capacity
    each in a capacity layout (checked there too), and at most max_tokens_per_rank in all when given (the
    Buffer checks x). Without the last two the bound is ranks_per_node x num_worst_tokens per node: large with
    many ranks per node (the backend counts on the host when it passes the largest RDMA region)."""
    per_node = ranks_per_node * num_worst_tokens
    if capacity:
        per_node = min(per_node, ranks_per_node * num_local_experts * capacity)
    if max_tokens_per_rank:
        per_node = min(per_node, max_tokens_per_rank)
    return [per_node] * (num_ranks * (num_ranks // ranks_per_node)), num_worst_tokens


def internode_max_rdma_bytes() -> int:
    """The largest RDMA region (commands carry 32-bit offsets into it)."""
    return int(_module().INTERNODE_MAX_RDMA_BYTES)


def internode_start(nvl_bytes: int, rdma_bytes: int) -> tuple[int, int]:
    """(NVL, RDMA) bytes the internode backend opens with, given the largest sizes any rank asked for."""
    return max(int(nvl_bytes), MIN_BYTES), max(int(rdma_bytes), MIN_BYTES)


def internode_grow(have: int, need: int, most: Optional[int] = None) -> int:
    """A buffer of `have` bytes after a call that needs `need` bytes of it (at most `most`, the need allowing)."""
    if need <= have:
        return have
    grown = grown_bytes(need)
    return grown if most is None else max(min(grown, most), need)


def internode_worst_need(num_tokens: int, hidden_bytes: int, num_ranks: int, ranks_per_node: int,
                         num_topk: int) -> tuple[int, int]:
    """(RDMA bytes, NVL bytes) for a dispatch and a combine of `num_tokens` tokens per rank under any routing:
    the layout of the worst case, every token to every node and every rank's tokens to one rank (the layout
    grows with each count)."""
    rd = [int(num_tokens)] * (num_ranks * (num_ranks // ranks_per_node))
    return internode_need(rd, num_ranks, ranks_per_node, hidden_bytes, 0, num_topk, hidden_bytes,
                          num_tokens * num_ranks, ranks=[0])


# ---- routing: what a typical step sends -------------------------------------------------------------------
def p_token_reaches(num_topk: int, num_experts: int, experts_there: int) -> float:
    """Chance that a token's top-k (k distinct experts, uniformly at random) has one of `experts_there` given
    experts (those of one rank, or of one node): 1 - C(E - e, k) / C(E, k)."""
    k = min(num_topk, num_experts)
    p_none = 1.0
    for i in range(k):  # C(E - e, k) / C(E, k) as a product
        p_none *= max(num_experts - experts_there - i, 0) / (num_experts - i)
    return 1.0 - p_none


def typical_rows(num_tokens: int, num_topk: int, num_experts: int, num_ranks: int) -> int:
    """Receive-order rows one rank receives (= sends) in a step of `num_tokens` tokens per rank, routed
    uniformly: every token goes once to each rank holding one of its experts."""
    return math.ceil(num_ranks * num_tokens * p_token_reaches(num_topk, num_experts, num_experts // num_ranks))


def typical_node_tokens(num_tokens: int, num_topk: int, num_experts: int, num_nodes: int) -> int:
    """Tokens one rank sends to one node in such a step (each once, whatever its experts there)."""
    return math.ceil(num_tokens * p_token_reaches(num_topk, num_experts, num_experts // num_nodes))


# ---- capacity layouts (receive budget, drop-and-pad): sizes known before the dispatch --------------------
def budget_capacity(max_tokens_per_rank: int, num_topk: int, factor: float, num_local_experts: int,
                    num_ranks: int, at_least: int = 0) -> int:
    """Rows per (local expert, source rank) block of a receive budget of `factor` x top-k x tokens rows per
    rank (Megatron-LM's moe_expert_rank_capacity_factor), at least `at_least` rows per rank (a grown budget)."""
    budget = max(math.ceil(max_tokens_per_rank * num_topk * factor), at_least, 1)
    return math.ceil(budget / (num_local_experts * num_ranks))


def capacity_recv_tokens(max_tokens_per_rank: int, num_local_experts: int, num_ranks: int, capacity: int) -> int:
    """Receive-order rows (each token once per rank) of a capacity layout, the dispatch's num_worst_tokens: a
    source sends a rank at most its tokens, and at most `capacity` per local expert there."""
    return num_ranks * min(max_tokens_per_rank, num_local_experts * capacity)


def worst_send_rows(num_worst_tokens: int, num_ranks: int, num_local_experts: int, capacity: int,
                    max_tokens_per_rank: int = 0) -> int:
    """Rows a rank may get back in the combine of a dispatch bounded by num_worst_tokens (rows any rank
    receives): per destination at most those, at most `capacity` per expert there in a capacity layout
    (capacity > 0), and at most `max_tokens_per_rank` when the caller gives that bound (0: none). Only from
    what every rank passes alike, never from the rank's own token count: a sync-free dispatch does not learn
    its peers' counts, and ranks that sized from their own would grow their buffers apart (one in the
    collective grow, its peers already in their next call)."""
    per_rank = num_worst_tokens
    if capacity:
        per_rank = min(per_rank, num_local_experts * capacity)
    if max_tokens_per_rank:
        per_rank = min(per_rank, max_tokens_per_rank)
    return num_ranks * per_rank
