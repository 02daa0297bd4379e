"""Seeded generator of whole dispatch/combine cases for the fuzz suite (tests/fuzz_runner.py runs them).

A seed fixes one node layout (1..4 nodes x 1..4 ranks per node, UCCL_EP_RANKS_PER_NODE) and CASES_PER_SEED
cases on it, so one spawn of the ranks runs them all. Each case is a `FuzzCase`: every argument of the calls
it makes (token counts per rank, hidden, top-k, experts, routing, FP8, combine dtype, weights, biases,
num_worst_tokens, expert_alignment, expert_capacity (also below a source's tokens: OVERFLOWS), cached,
stream mode, LL hook / zero-copy / scale modes, proxy fault injection), drawn only where the API accepts the
combination (uccl_ep_train/validation.py, buffer.py and the kernels' row-size rules), and a one-line
reproduction (`repro`). The inputs of a rank (`rank_inputs`) are a pure function of (case, rank), so any
rank can recompute any other rank's routing for the dense checks.

Sizes are bounded (SIZE_BUDGET, LL_BYTES_BUDGET) so a case of 16 ranks sharing one GPU, with the reference
backend on their CPU copies, takes seconds: the extremes (4096 tokens, hidden 7168, 288 experts) are drawn,
just not all in one case.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch

from uccl_ep_train.backends.low_latency import low_latency_layout
from oracle import capacity_overflows, drop_over_capacity
from uccl_ep_train.fp8 import FP8_BLOCK

CASES_PER_SEED = 8
MAX_NODES, MAX_RANKS_PER_NODE = 4, 4
MAX_TOKENS = 4096
HIDDEN_RANGE = (128, 7168)
TOPK_RANGE = (1, 9)
EXPERTS_RANGE = (8, 288)
# BF16 rows of the internode kernels are whole 16-byte vectors (internode_buffer.cu: x_bytes % 16): hidden a
# multiple of 8; FP8 (scales per 128 channels) and every LL call (low_latency.py): a multiple of 128
HIDDEN_STEP, FP8_HIDDEN_STEP = 8, FP8_BLOCK
UE8M0_HIDDEN_STEP = 4 * FP8_BLOCK  # UE8M0 exponents pack 4 per int32 (Buffer.low_latency_dispatch)
SIZE_BUDGET = 1 << 24  # sum over ranks of tokens x hidden in one case (HT: the reference's CPU work)
LL_BYTES_BUDGET = 384 << 20  # the LL region of one rank (Buffer.get_low_latency_rdma_size_hint)
EXPERT_MAJOR_ROWS_BUDGET = 1 << 24  # capacity layouts: experts x capacity x hidden

KINDS = ("ht", "expert_major", "ll")
ROUTINGS = ("uniform", "skewed", "one_rank", "one_node", "idle_ranks", "idle_node")
COMBINE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
STREAM_MODES = ("sync", "async", "previous_event")
ALIGNMENTS = (1, 2, 4, 16, 128)
# expert capacities below a source's tokens (issues #42 / #47): "drop": each rank's router keeps, per expert,
# its first expert_capacity tokens and drops the rest (Megatron's capacity factor, megatron_patch's receive
# budget), so blocks fill up to exactly the capacity; "error": the routing goes as it is and the oracle says
# which blocks overflow: then every rank must raise the capacity error naming one of them (docs/api.md).
# "error" is drawn on one node only, as when seeds 0-144 ran on GPUs (drawing it across nodes changes every
# multi-node seed's cases); across nodes every rank raises it too, which tests/test_internode_gpu.py checks.
OVERFLOWS = ("drop", "error")


@dataclass(frozen=True)
class FuzzCase:
    """One case: what each rank passes to the calls it makes, in order (see fuzz_runner.run_case).

    kind "ht": get_dispatch_layout, dispatch (fresh), dispatch (cached, when `cached`), combine.
    kind "expert_major": dispatch_expert_major, its cached form (when `cached`), combine_expert_major.
    kind "ll": low_latency_dispatch then low_latency_combine on a Buffer of its own."""

    seed: int
    index: int
    nodes: int
    ranks_per_node: int
    kind: str
    tokens: tuple[int, ...]  # per rank (0 and 1 included)
    hidden: int
    topk: int
    experts: int
    routing: str
    dest_ranks: tuple[int, ...]  # ranks whose experts the tokens may pick (the others receive nothing)
    hot_ranks: tuple[int, ...]  # skewed: 4 tokens of 5 pick only these ranks' experts
    holes: float  # probability of a -1 slot
    repeated: bool  # LL: some tokens name one expert in two slots
    fp8: bool  # HT: (e4m3, scales) x; LL: use_fp8
    combine_dtype: str  # HT: the expert outputs' dtype (and the biases'); expert-major: x's too
    weights: bool  # HT/expert-major: topk_weights given to dispatch and combine
    bias: int  # HT: 0, 1 or 2 bias tensors
    num_worst_tokens: int
    expert_alignment: int
    expert_capacity: int  # expert-major: 0 exact counts, else a capacity layout
    cached: bool
    stream: str  # sync, async (async_finish) or previous_event (+ allocate_on_comm_stream; not LL)
    max_tokens: int  # LL: num_max_dispatch_tokens_per_rank
    hook: bool  # LL: return_recv_hook
    round_scale: bool
    ue8m0: bool
    zero_copy: bool
    fault: str  # UCCL_EP_FAULT for this case's native Buffer ("" none; several nodes only)
    overflow: str  # capacity layouts: "" fits, "drop" or "error" (OVERFLOWS)

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def layout(self) -> tuple[int, int]:
        return self.nodes, self.ranks_per_node

    @property
    def repro(self) -> str:
        return f"scripts/fuzz_gpu.sh --seed {self.seed} --case {self.index}"

    def describe(self) -> str:
        """Every field on one line (for failure messages)."""
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items() if k not in ("seed", "index"))


def layout_of(seed: int) -> tuple[int, int]:
    """(nodes, ranks per node) of every case of `seed`."""
    rng = random.Random(f"layout/{seed}")
    return rng.randint(1, MAX_NODES), rng.randint(1, MAX_RANKS_PER_NODE)


def generate(seed: int, count: int = CASES_PER_SEED) -> list[FuzzCase]:
    """The cases of `seed` (a pure function of its arguments: the same list in every process)."""
    nodes, per_node = layout_of(seed)
    return [_case(seed, i, nodes, per_node) for i in range(count)]


def case(seed: int, index: int) -> FuzzCase:
    """Case `index` of `seed` (the repro's)."""
    if index < 0:
        raise ValueError(f"--case: must be >= 0, got {index}")
    return _case(seed, index, *layout_of(seed))


def seeds_with(count: int, max_world: int, first: int = 0) -> list[int]:
    """The first `count` seeds from `first` whose layout has at most `max_world` ranks (a bounded sample)."""
    out, seed = [], first
    while len(out) < count:
        n, per_node = layout_of(seed)
        if n * per_node <= max_world:
            out.append(seed)
        seed += 1
    return out


def overflowing(c: FuzzCase) -> bool:
    """Whether case `c` overflows a capacity block (overflow "error" whose routing sends some expert more
    tokens from one source than its capacity): every rank must then raise the capacity error."""
    return c.overflow == "error" and bool(
        capacity_overflows([rank_routing(c, r) for r in range(c.world)], c.experts, c.expert_capacity))


def seeds_overflowing(count: int, max_world: int, first: int = 0) -> list[int]:
    """The first `count` seeds from `first` of at most `max_world` ranks with an overflowing case."""
    out, seed = [], first
    while len(out) < count:
        nodes, per_node = layout_of(seed)
        if nodes * per_node <= max_world and any(overflowing(c) for c in generate(seed)):
            out.append(seed)
        seed += 1
    return out


def _token_count(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.12:
        return 0
    if r < 0.24:
        return 1
    if r < 0.3:
        return MAX_TOKENS
    return int(round(2 ** rng.uniform(1, 12)))


def _hidden(rng: random.Random, step: int) -> int:
    lo, hi = -(-HIDDEN_RANGE[0] // step), HIDDEN_RANGE[1] // step
    r = rng.random()
    if r < 0.1:
        return lo * step
    if r < 0.2:
        return hi * step
    return rng.randint(lo, hi) * step


def _fit(tokens: list[int], limit: int) -> list[int]:
    """Halve the counts above 2 until their sum is at most `limit` (0, 1 and 2 stay as they are)."""
    while sum(tokens) > limit and any(t > 2 for t in tokens):
        tokens = [t if t <= 2 else max(2, t // 2) for t in tokens]
    return tokens


def _case(seed: int, index: int, nodes: int, per_node: int) -> FuzzCase:
    rng = random.Random(f"case/{seed}/{index}")
    world = nodes * per_node
    kind = rng.choices(KINDS, weights=(5, 2, 3))[0]
    fp8 = kind != "expert_major" and rng.random() < 0.35
    ue8m0 = kind == "ll" and fp8 and rng.random() < 0.4
    step = UE8M0_HIDDEN_STEP if ue8m0 else FP8_HIDDEN_STEP if (fp8 or kind == "ll") else HIDDEN_STEP
    hidden = _hidden(rng, step)
    lo = max(1, -(-EXPERTS_RANGE[0] // world))
    hi = EXPERTS_RANGE[1] // world
    r = rng.random()
    local = lo if r < 0.15 else hi if r < 0.3 else rng.randint(lo, hi)
    experts = local * world
    topk = rng.randint(*TOPK_RANGE)
    tokens = _fit([_token_count(rng) for _ in range(world)], SIZE_BUDGET // hidden)

    routing = rng.choice(ROUTINGS if nodes > 1 else tuple(r for r in ROUTINGS if r != "idle_node"))
    ranks = list(range(world))
    hot: tuple[int, ...] = ()
    if routing == "one_rank":
        dest = (rng.randrange(world),)
    elif routing == "one_node":
        n = rng.randrange(nodes)
        dest = tuple(range(n * per_node, (n + 1) * per_node))
    elif routing == "idle_ranks":  # some ranks receive nothing (at least one does, at least one does not)
        idle = set(rng.sample(ranks, rng.randint(1, max(1, world - 1)))) if world > 1 else set()
        dest = tuple(r for r in ranks if r not in idle)
    elif routing == "idle_node":
        n = rng.randrange(nodes)
        dest = tuple(r for r in ranks if r // per_node != n)
    else:
        dest = tuple(ranks)
        if routing == "skewed":
            hot = tuple(range(per_node)) if nodes > 1 and rng.random() < 0.5 else (rng.randrange(world),)
    holes = rng.choice((0.0, 0.0, 0.1, 0.5))

    max_tokens, hook, round_scale, zero_copy, repeated = 0, False, False, False, False
    worst, alignment, capacity, cached, stream, overflow = 0, 1, 0, False, "sync", ""
    weights, bias, combine_dtype = True, 0, "bf16"
    if kind == "ll":
        repeated = rng.random() < 0.3
        hook, zero_copy = rng.random() < 0.5, rng.random() < 0.3
        stream = rng.choice(STREAM_MODES[:2])  # LL calls take async_finish, not previous_event
        round_scale = fp8 and (ue8m0 or rng.random() < 0.5)
        while True:
            max_tokens = max(1, max(tokens) + rng.choice((0, 0, 1, 16)))
            need = low_latency_layout(max_tokens, hidden, world, experts).total_bytes
            if need <= LL_BYTES_BUDGET or max_tokens == 1:
                break
            tokens = [t if t <= 1 else max(1, t // 2) for t in tokens]
    else:
        combine_dtype = rng.choice(tuple(COMBINE_DTYPES))
        weights = rng.random() < 0.7
        cached = rng.random() < 0.6
        stream = rng.choice(STREAM_MODES)
        if kind == "ht":
            bias = rng.choice((0, 0, 1, 2))
            alignment = rng.choice(ALIGNMENTS)
            if rng.random() < 0.3:  # at least every token of every rank: never too few
                worst = max(1, sum(tokens)) + rng.choice((0, 0, 5))
        elif rng.random() < 0.35:
            overflow = rng.choice(("",) + (OVERFLOWS if nodes == 1 else OVERFLOWS[:1]))
            fits = EXPERT_MAJOR_ROWS_BUDGET // (experts * hidden)  # the largest capacity within the budget
            if overflow and max(tokens) > 1 and fits:
                # log-uniform up to twice a source's mean tokens per expert: blocks tight, full or overflowing
                top = min(max(tokens) - 1, 2 * (max(tokens) * topk // experts + 1), fits)
                capacity = max(1, min(top, int(2 ** rng.uniform(0, top.bit_length()))))
            else:
                overflow = ""
                if max(tokens) * experts * hidden <= EXPERT_MAJOR_ROWS_BUDGET:
                    capacity = max(1, max(tokens)) + rng.choice((0, 3))  # a source sends a token to an expert once
            if capacity:
                worst = max(1, sum(tokens)) + rng.choice((0, 5))
    fault = ""
    if nodes > 1 and rng.random() < 0.25:
        fault = f"reorder={rng.choice((0.1, 0.3, 0.6))},delay_us={rng.choice((0, 20, 50))},seed={rng.randrange(1000)}"
    return FuzzCase(seed, index, nodes, per_node, kind, tuple(tokens), hidden, topk, experts, routing, dest, hot,
                    holes, repeated, fp8, combine_dtype, weights, bias, worst, alignment, capacity, cached, stream,
                    max_tokens, hook, round_scale, ue8m0, zero_copy, fault, overflow)


def rank_routing(c: FuzzCase, rank: int) -> torch.Tensor:
    """topk_idx int64 [tokens[rank], topk] of `rank` (CPU): per token min(topk, choices) distinct experts of
    the ranks it may pick (`hot_ranks` for 4 tokens of 5 when skewed), -1 for the other slots and holes; with
    `repeated`, some slots repeat the slot before (no expert past max_tokens rows from the rank); with overflow
    "drop", the selections past their expert's capacity are dropped (-1), as the router does
    (oracle.drop_over_capacity)."""
    T, K, local = c.tokens[rank], c.topk, c.experts // c.world
    g = torch.Generator().manual_seed(_seed(c, rank, 1))
    idx = torch.full((T, K), -1, dtype=torch.int64)

    def pick(rows: torch.Tensor, ranks: tuple[int, ...]) -> None:
        pool = torch.tensor([r * local + e for r in ranks for e in range(local)], dtype=torch.int64)
        if not rows.numel() or not pool.numel():
            return
        k = min(K, pool.numel())
        order = torch.rand((rows.numel(), pool.numel()), generator=g).argsort(dim=1)[:, :k]
        idx[rows, :k] = pool[order]
        idx[rows] = idx[rows][:, torch.randperm(K, generator=g)]  # the -1 slots anywhere in the row

    rows = torch.arange(T)
    if c.hot_ranks:
        hot = torch.rand(T, generator=g) < 0.8
        pick(rows[hot], c.hot_ranks)
        pick(rows[~hot], c.dest_ranks)
    else:
        pick(rows, c.dest_ranks)
    if c.holes:
        idx[torch.rand((T, K), generator=g) < c.holes] = -1
    if c.repeated and K > 1 and T:
        again = torch.rand((T, K - 1), generator=g) < 0.3
        # An LL expert takes at most max_tokens rows from one rank, and a repeat is one row more (the native
        # kernels refuse the call past that, as they must): a repeat that would cross it is not made.
        rows_of = torch.bincount(idx[idx >= 0], minlength=c.experts)
        for j in range(1, K):
            for t in again[:, j - 1].nonzero().flatten().tolist():
                prev, cur = int(idx[t, j - 1]), int(idx[t, j])
                if prev < 0 or rows_of[prev] >= c.max_tokens:
                    continue
                if cur >= 0:
                    rows_of[cur] -= 1
                idx[t, j] = prev
                rows_of[prev] += 1
    if c.overflow == "drop":
        idx = drop_over_capacity(idx, c.experts, c.expert_capacity)
    return idx


def rank_inputs(c: FuzzCase, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x bf16 [T, hidden], topk_idx int64 [T, topk], topk_weights float32 [T, topk]) of `rank`, on CPU."""
    g = torch.Generator().manual_seed(_seed(c, rank, 2))
    T = c.tokens[rank]
    x = torch.randn((T, c.hidden), generator=g).to(torch.bfloat16)
    idx = rank_routing(c, rank)
    w = torch.rand((T, c.topk), generator=g)
    return x, idx, w


def _seed(c: FuzzCase, rank: int, stream: int) -> int:
    return ((c.seed * 1_000_003 + c.index) * 257 + rank) * 7 + stream


def check_case(c: FuzzCase) -> None:
    """Raise ValueError naming the field when `c` breaks a rule of the API or of the kernels (the generator
    must never produce one: tests/test_fuzz_cases.py checks it over many seeds)."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"{c.repro}: {what} ({c.describe()})")

    need(1 <= c.nodes <= MAX_NODES and 1 <= c.ranks_per_node <= MAX_RANKS_PER_NODE, "layout out of range")
    need(c.kind in KINDS and c.routing in ROUTINGS and c.stream in STREAM_MODES, "unknown kind/routing/stream")
    need(len(c.tokens) == c.world and all(0 <= t <= MAX_TOKENS for t in c.tokens), "tokens per rank")
    need(EXPERTS_RANGE[0] <= c.experts <= EXPERTS_RANGE[1] and c.experts % c.world == 0, "experts")
    need(TOPK_RANGE[0] <= c.topk <= TOPK_RANGE[1], "topk")
    need(HIDDEN_RANGE[0] <= c.hidden <= HIDDEN_RANGE[1] and c.hidden % HIDDEN_STEP == 0, "hidden")
    need(not (c.fp8 or c.kind == "ll") or c.hidden % FP8_HIDDEN_STEP == 0, "hidden of FP8 / LL calls")
    need(c.dest_ranks and all(0 <= r < c.world for r in c.dest_ranks + c.hot_ranks), "dest / hot ranks")
    need(c.combine_dtype in COMBINE_DTYPES and c.bias in (0, 1, 2), "combine dtype / bias")
    need(c.expert_alignment >= 1 and c.num_worst_tokens >= 0, "expert_alignment / num_worst_tokens")
    need(not c.num_worst_tokens or c.num_worst_tokens >= sum(c.tokens), "num_worst_tokens below a receive")
    need(not c.fault or c.nodes > 1, "fault injection without proxies")
    if c.kind == "ll":
        need(c.max_tokens >= max(1, max(c.tokens)), "LL max_tokens below a rank's tokens")
        need(c.stream != "previous_event", "LL calls take no previous_event")
        need(not c.round_scale or c.fp8, "round_scale without use_fp8")
        need(not c.ue8m0 or (c.round_scale and c.hidden % UE8M0_HIDDEN_STEP == 0), "ue8m0")
        need(low_latency_layout(c.max_tokens, c.hidden, c.world, c.experts).total_bytes <= LL_BYTES_BUDGET
             or c.max_tokens == 1, "LL region over budget")
    else:
        need(not (c.repeated or c.hook or c.zero_copy or c.round_scale or c.ue8m0), "LL options on an HT case")
    if c.kind == "expert_major":
        need(not c.fp8 and c.bias == 0 and c.expert_alignment == 1, "expert-major takes no FP8 / bias / alignment")
        need(bool(c.num_worst_tokens) == bool(c.expert_capacity), "expert-major num_worst_tokens without capacity")
        need(not c.expert_capacity or c.overflow or c.expert_capacity >= max(c.tokens),
             "expert_capacity below a source's rows without overflow drop / error")
    need(not c.overflow or (c.overflow in OVERFLOWS and c.kind == "expert_major" and 0 < c.expert_capacity),
         "overflow without a capacity layout")
    need(c.overflow != "error" or c.nodes == 1, "overflow error between nodes (raised on the receiver only)")
    need(sum(c.tokens) * c.hidden <= SIZE_BUDGET or c.kind == "ll", "over the size budget")

