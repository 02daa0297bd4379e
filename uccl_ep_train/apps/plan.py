"""`uccl-ep-train plan`: check a recipe against a cluster shape, print the launch command and a memory estimate.

    uccl-ep-train plan --recipe deepseek-v3 --nodes 32 --gpus-per-node 8
    uccl-ep-train plan --recipe deepseek-v3 --nodes 16 --gpus-per-node 8 --ep 16 --json
    uccl-ep-train plan --recipe deepseek-v3 --nodes 16 --gpus-per-node 8 --gpu-mem-gib 141 --suggest
    uccl-ep-train plan --recipe tiny --nodes 1 --gpus-per-node 2 --emit torchrun --entry train -- --steps 5

Checks (all reported at once, exit status 2 if any fails): world size divisible by TP*PP*CP and by
ETP*EP*PP, experts divisible by EP, heads by TP, FFN widths by TP / ETP, layers per pipeline stage
(even split, or the recipe's first/last-stage counts with the rest even), global batch divisible by
micro batch * DP, router groups, sequence parallel with TP*EP, sequence length vs CP/TP, and the native
kernels' limits on one EP group (EP x ETP consecutive ranks): at most MAX_NODES nodes and MAX_RANKS_PER_NODE
of its ranks on a node (uccl_ep_train.topology, which the backends hold the built module to), as many of its
ranks on every node it spans.
`--check-megatron` adds Megatron-LM's own validate_args; `--suggest` lists layouts that fit, and a layout
that is refused or does not fit in memory gets the same list (when none fits: the valid layouts needing the
least memory and the fewest nodes that hold one), all from these checks and this estimate.

Memory estimate per GPU, for the heaviest pipeline stage (weights, gradients, optimizer state,
activations, EP buffers): see docs/recipes.md for the model behind each term. It is an estimate to catch
layouts that cannot fit, not an allocator trace. Runs on CPU and does not import megatron.

`--emit torchrun` prints only the shell-quoted torchrun command for one node (what slurm/launch.sh runs);
`--emit megatron-args` prints only the Megatron-LM arguments.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from uccl_ep_train import sizing
from uccl_ep_train.apps.recipes import NIC_PROFILES, Recipe, load_recipe, nic_env
from uccl_ep_train.buffer import Buffer
from uccl_ep_train.config import DEFAULT_NUM_SMS, default_nvl_bytes
from uccl_ep_train.topology import MAX_NODES, MAX_RANKS_PER_NODE

GiB = 1024 ** 3


# ---------------------------------------------------------------------------------------------------------
# parameter counts (analytic; the tests hold them equal to megatron-core's meta-device model)
# ---------------------------------------------------------------------------------------------------------
def padded_vocab_size(recipe: Recipe) -> int:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by * TP."""
    v = int(recipe.args["vocab_size"])
    mult = int(recipe.args.get("make_vocab_size_divisible_by") or 128) * recipe.tp
    return (v + mult - 1) // mult * mult


def _norm_params(recipe: Recipe, width: int) -> int:
    return width * (1 if recipe.args.get("normalization", "LayerNorm") == "RMSNorm" else 2)


def attention_params(recipe: Recipe) -> int:
    a = recipe.args
    h, heads = int(a["hidden_size"]), int(a["num_attention_heads"])
    bias = bool(a.get("add_bias_linear", True))
    if a.get("multi_latent_attention"):
        qk, pos, v, kvr = int(a["qk_head_dim"]), int(a["qk_pos_emb_head_dim"]), int(a["v_head_dim"]), int(a["kv_lora_rank"])
        qr = a.get("q_lora_rank")
        n = 0
        if qr:
            n += h * qr + qr * heads * (qk + pos)
            n += _norm_params(recipe, qr) if a.get("qk_layernorm") else 0
        else:
            n += h * heads * (qk + pos)
        n += h * (kvr + pos) + kvr * heads * (qk + v)
        n += _norm_params(recipe, kvr) if a.get("qk_layernorm") else 0
        n += heads * v * h
        return n
    kv = int(a.get("kv_channels") or h // heads)
    groups = int(a.get("num_query_groups") or heads) if a.get("group_query_attention") else heads
    qkv_out = heads * kv + 2 * groups * kv
    n = h * qkv_out + heads * kv * h
    if bias:
        n += qkv_out + h
    if a.get("qk_layernorm"):
        n += 2 * _norm_params(recipe, kv)
    return n


def _mlp_params(recipe: Recipe, width: int) -> int:
    h = int(recipe.args["hidden_size"])
    fc1 = 2 * width if recipe.args.get("swiglu") else width
    n = h * fc1 + width * h
    if recipe.args.get("add_bias_linear", True):
        n += fc1 + h
    return n


@dataclass
class ParamBreakdown:
    attention: int          # per layer
    dense_mlp: int          # per dense layer
    router: int             # per MoE layer
    routed_expert: int      # one routed expert
    shared_experts: int     # per MoE layer
    layer_norms: int        # per layer (input + pre-MLP)
    embedding: int
    output_layer: int
    final_norm: int
    dense_layers: int
    moe_layers: int
    mtp: int                # multi-token prediction layers (embedding / output shared with the model)
    mtp_routed: int         # of which routed experts
    total: int              # everything, MTP included
    active: int             # main model, DeepSeek's convention: no input embedding, top-k routed experts, no MTP


def count_params(recipe: Recipe) -> ParamBreakdown:
    a = recipe.args
    h = int(a["hidden_size"])
    pattern = recipe.moe_layers()
    n_moe, n_dense = sum(pattern), len(pattern) - sum(pattern)
    experts = int(a.get("num_experts") or 0)
    attn = attention_params(recipe)
    norms = 2 * _norm_params(recipe, h)
    dense = _mlp_params(recipe, int(a["ffn_hidden_size"]))
    router = h * experts if experts else 0
    expert = _mlp_params(recipe, int(a["moe_ffn_hidden_size"])) if experts else 0
    shared_w = int(a.get("moe_shared_expert_intermediate_size") or 0)
    shared = _mlp_params(recipe, shared_w) if shared_w else 0
    vocab = padded_vocab_size(recipe)
    emb = vocab * h
    if a.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        emb += int(a.get("max_position_embeddings") or a["seq_length"]) * h
    out = vocab * h if a.get("untie_embeddings_and_output_weights") else 0
    final = _norm_params(recipe, h)
    per_moe = attn + norms + router + experts * expert + shared
    per_dense = attn + norms + dense
    n_mtp = int(a.get("mtp_num_layers") or 0)
    mtp_layer_is_moe = bool(pattern and pattern[-1])        # MTP layers repeat the last decoder layer's kind
    mtp = n_mtp * (3 * _norm_params(recipe, h) + 2 * h * h + (per_moe if mtp_layer_is_moe else per_dense))
    mtp_routed = n_mtp * experts * expert if mtp_layer_is_moe else 0
    main = n_dense * per_dense + n_moe * per_moe + emb + out + final
    topk = int(a.get("moe_router_topk") or 0)
    active = main - emb - n_moe * (experts - topk) * expert
    return ParamBreakdown(attn, dense, router, expert, shared, norms, emb, out, final, n_dense, n_moe,
                          mtp, mtp_routed, main + mtp, active)


# ---------------------------------------------------------------------------------------------------------
# layout checks
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Layout:
    nodes: int
    gpus_per_node: int
    world: int
    tp: int
    pp: int
    ep: int
    etp: int
    cp: int
    dp: int = 0
    expert_dp: int = 0
    ep_nodes: float = 0.0           # nodes one EP group spans
    stage_layers: list[int] = field(default_factory=list)
    num_microbatches: int = 0
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def stage_layer_counts(recipe: Recipe, errors: Optional[list[str]] = None) -> list[int]:
    """Decoder layers per pipeline stage (Megatron's split: first/last counts if given, the rest even)."""
    errors = errors if errors is not None else []
    L, pp = int(recipe.args["num_layers"]), recipe.pp
    first = recipe.args.get("decoder_first_pipeline_num_layers")
    last = recipe.args.get("decoder_last_pipeline_num_layers")
    if pp == 1:
        if first is not None or last is not None:
            errors.append("decoder_first/last_pipeline_num_layers need pipeline_model_parallel_size > 1")
        return [L]
    middle_stages = pp - (first is not None) - (last is not None)
    rest = L - (first or 0) - (last or 0)
    if rest < 0 or (middle_stages == 0 and rest != 0):
        errors.append(f"num_layers {L} cannot be split as first={first}, last={last} over PP={pp}")
        return []
    if middle_stages and rest % middle_stages:
        what = "num_layers" if first is None and last is None else f"num_layers - first - last = {rest}"
        errors.append(f"{what} is not divisible by the {middle_stages} remaining pipeline stages (PP={pp}); "
                      "set decoder_first/last_pipeline_num_layers")
        return []
    per = rest // middle_stages if middle_stages else 0
    counts = [per] * pp
    if first is not None:
        counts[0] = int(first)
    if last is not None:
        counts[-1] = int(last)
    if any(c <= 0 for c in counts):
        errors.append(f"pipeline stage with no layers: {counts}")
    return counts


def balanced_stage_split(num_layers: int, pp: int) -> tuple[Optional[int], Optional[int]]:
    """First/last pipeline stage layer counts that let Megatron split `num_layers` over `pp` stages:
    (None, None) when they divide evenly; otherwise the split with the smallest largest stage, the
    first and last stages (which also hold the embedding / output layer) no larger than the rest."""
    if pp <= 1 or num_layers % pp == 0:
        return None, None
    best = None
    for first in range(1, num_layers):
        for last in range(1, num_layers - first + 1):
            rest, middle = num_layers - first - last, pp - 2
            if middle == 0:
                if rest != 0:
                    continue
                per = max(first, last)
            elif rest <= 0 or rest % middle:
                continue
            else:
                per = rest // middle
            key = (max(first, last, per), -min(first, last), last)
            if best is None or key < best[0]:
                best = (key, first, last)
    if best is None:
        return None, None
    return best[1], best[2]


def check_layout(recipe: Recipe, nodes: int, gpus_per_node: int) -> Layout:
    a = recipe.args
    lay = Layout(nodes, gpus_per_node, nodes * gpus_per_node, recipe.tp, recipe.pp, recipe.ep, recipe.etp, recipe.cp)
    err = lay.errors
    if nodes < 1 or gpus_per_node < 1:
        err.append(f"nodes ({nodes}) and gpus-per-node ({gpus_per_node}) must be >= 1")
        return lay
    W = lay.world
    if W % (lay.tp * lay.pp * lay.cp):
        err.append(f"world size {W} is not divisible by TP*PP*CP = {lay.tp}*{lay.pp}*{lay.cp}")
    else:
        lay.dp = W // (lay.tp * lay.pp * lay.cp)
    if W % (lay.etp * lay.ep * lay.pp):
        err.append(f"world size {W} is not divisible by ETP*EP*PP = {lay.etp}*{lay.ep}*{lay.pp}")
    else:
        lay.expert_dp = W // (lay.etp * lay.ep * lay.pp)
    experts = int(a.get("num_experts") or 0)
    if experts:
        if experts % lay.ep:
            err.append(f"num_experts {experts} is not divisible by EP {lay.ep}")
        topk = int(a.get("moe_router_topk") or 0)
        if not 1 <= topk <= experts:
            err.append(f"moe_router_topk {topk} must be in [1, num_experts={experts}]")
        groups, gtopk = a.get("moe_router_num_groups"), a.get("moe_router_group_topk")
        if groups:
            if experts % groups:
                err.append(f"num_experts {experts} is not divisible by moe_router_num_groups {groups}")
            if not gtopk or gtopk > groups:
                err.append(f"moe_router_group_topk {gtopk} must be in [1, moe_router_num_groups={groups}]")
            elif topk > gtopk * (experts // groups):
                err.append(f"moe_router_topk {topk} exceeds the experts in {gtopk} groups of {experts // groups}")
        if int(a.get("moe_ffn_hidden_size") or 0) % lay.etp:
            err.append(f"moe_ffn_hidden_size {a.get('moe_ffn_hidden_size')} is not divisible by ETP {lay.etp}")
        if lay.tp > 1 and lay.ep > 1 and not a.get("sequence_parallel"):
            err.append("TP > 1 with EP > 1 needs sequence_parallel (Megatron requires it for MoE)")
    elif lay.ep > 1:
        err.append(f"EP {lay.ep} > 1 but the recipe has no experts")
    heads = int(a["num_attention_heads"])
    if heads % lay.tp:
        err.append(f"num_attention_heads {heads} is not divisible by TP {lay.tp}")
    if a.get("group_query_attention") and int(a.get("num_query_groups") or 1) % lay.tp:
        err.append(f"num_query_groups {a.get('num_query_groups')} is not divisible by TP {lay.tp}")
    if int(a["ffn_hidden_size"]) % lay.tp:
        err.append(f"ffn_hidden_size {a['ffn_hidden_size']} is not divisible by TP {lay.tp}")
    if a.get("sequence_parallel") and lay.tp == 1:
        lay.notes.append("sequence_parallel has no effect with TP=1")
    seq = int(a["seq_length"])
    if lay.cp > 1 and seq % (2 * lay.cp):
        err.append(f"seq_length {seq} is not divisible by 2*CP = {2 * lay.cp}")
    if a.get("sequence_parallel") and seq % lay.tp:
        err.append(f"seq_length {seq} is not divisible by TP {lay.tp} (sequence parallel)")
    lay.stage_layers = stage_layer_counts(recipe, err)
    mbs, gbs = int(a["micro_batch_size"]), int(a["global_batch_size"])
    if lay.dp:
        if gbs % (mbs * lay.dp):
            err.append(f"global_batch_size {gbs} is not divisible by micro_batch_size*DP = {mbs}*{lay.dp}")
        else:
            lay.num_microbatches = gbs // (mbs * lay.dp)
            if lay.pp > 1 and lay.num_microbatches < lay.pp:
                lay.notes.append(f"{lay.num_microbatches} micro-batches per step for PP={lay.pp}: "
                                 "the pipeline bubble dominates; raise global_batch_size")
    if a.get("moe_token_dispatcher_type") != "uccl":
        lay.notes.append(f"moe_token_dispatcher_type is {a.get('moe_token_dispatcher_type')!r}, not 'uccl'")
    # Megatron's expert grid is ETP x EP x expert-DP x PP (TP does not enter it): an EP group is EP ranks
    # ETP apart, EP x ETP consecutive ranks
    lay.ep_nodes = lay.ep * lay.etp / gpus_per_node if experts else 0.0
    if experts and lay.ep > 1:
        # the native kernels' limits on one EP group (uccl_ep_train.topology, which the backends check too)
        per_node = max(1, min(lay.ep * lay.etp, gpus_per_node) // lay.etp)
        if per_node > MAX_RANKS_PER_NODE:
            err.append(f"each EP group puts {per_node} of its ranks on one node (EP {lay.ep} x ETP {lay.etp} over "
                       f"{gpus_per_node} GPUs per node); UCCL-EP's kernels take at most {MAX_RANKS_PER_NODE} ranks "
                       f"of a group per node (MAX_RANKS_PER_NODE: one NVLink/xGMI domain; on larger nodes, plan with "
                       f"--gpus-per-node {MAX_RANKS_PER_NODE} and set UCCL_EP_RANKS_PER_NODE={MAX_RANKS_PER_NODE})")
        span = lay.ep * lay.etp  # consecutive ranks of one EP group
        if not (gpus_per_node % span == 0 or (span % gpus_per_node == 0 and gpus_per_node % lay.etp == 0)):
            err.append(f"each EP group (EP {lay.ep} x ETP {lay.etp} = {span} consecutive ranks) holds different "
                       f"numbers of its ranks on the nodes it spans ({gpus_per_node} GPUs per node); UCCL-EP needs "
                       f"as many on every node (ranks per node of a group): make EP x ETP a divisor or a multiple "
                       f"of {gpus_per_node}")
        if math.ceil(lay.ep_nodes) > MAX_NODES:
            err.append(f"each EP group spans {math.ceil(lay.ep_nodes)} nodes (EP {lay.ep} x ETP {lay.etp} / "
                       f"{gpus_per_node} GPUs per node); UCCL-EP's internode kernels take at most {MAX_NODES} "
                       f"nodes per EP group (MAX_NODES): EP x ETP <= {MAX_NODES * gpus_per_node}")
    if experts and lay.ep * lay.etp > gpus_per_node:
        lay.notes.append(f"each EP group spans {math.ceil(lay.ep_nodes)} nodes: dispatch/combine move tokens inside "
                         "a node over NVLink/xGMI and between nodes through the CPU proxies (RDMA writes: verbs "
                         "on RC NICs, libfabric's efa provider on EFA, each GPU on the NICs of its PCIe switch; "
                         "UCCL_EP_TRANSPORT / UCCL_EP_NICS override; RoCE: UCCL_IB_GID_INDEX); "
                         "docs/internode.md")
    return lay


# ---------------------------------------------------------------------------------------------------------
# memory estimate
# ---------------------------------------------------------------------------------------------------------
@dataclass
class MemoryEstimate:
    stage: int               # the pipeline stage estimated (the heaviest)
    params_dense: int        # non-expert parameters on one GPU
    params_expert: int       # routed-expert parameters on one GPU
    weights: int             # bytes
    gradients: int
    optimizer: int
    activations: int
    ep_buffers: int
    total: int


# ---------------------------------------------------------------------------------------------------------
# EP buffers per mode (uccl_ep_train.sizing: the rules the native backends size and grow their buffers by)
# ---------------------------------------------------------------------------------------------------------
# The receive budget plan reports when the recipe sets none (Megatron-LM's moe_expert_rank_capacity_factor)
DEFAULT_CAPACITY_FACTOR = 1.0


@dataclass
class EpShape:
    """What sizes one rank's EP buffers: the tokens one MoE layer dispatches per rank and the EP group."""
    hidden: int
    topk: int
    experts: int
    tokens: int             # tokens per rank and dispatch (one micro-batch, split over CP and sequence-parallel TP)
    ranks: int              # EP group size
    ranks_per_node: int     # of the EP group, on one node
    element_bytes: int      # bytes per activation value (2: BF16)

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.element_bytes


@dataclass
class BufferMode:
    """One mode's memory on one rank: the communication buffers (NVLink / xGMI, RDMA) and the dispatch's
    output rows of `hidden` values (eager and static: the experts' expert-major rows, expected / fixed; worst
    case: num_worst_tokens receive rows; low-latency: [local experts, ranks x tokens] rows)."""
    mode: str
    nvl_bytes: int
    rdma_bytes: int
    out_rows: int
    out_bytes: int
    note: str

    @property
    def buffer_bytes(self) -> int:
        return self.nvl_bytes + self.rdma_bytes


def ep_shape(recipe: Recipe, lay: Layout, tokens: Optional[int] = None) -> Optional[EpShape]:
    """The EP shape of `recipe` on `lay` (None without experts or with EP 1). tokens: tokens per rank and
    dispatch, default one micro-batch's share (seq_length x micro_batch_size over CP, and over TP with sequence
    parallelism)."""
    a = recipe.args
    experts = int(a.get("num_experts") or 0)
    group = lay.ep * lay.etp
    if not experts or group <= 1:
        return None
    sp = lay.tp if a.get("sequence_parallel") else 1
    if tokens is None:
        tokens = max(1, int(a["seq_length"]) * int(a["micro_batch_size"]) // (lay.cp * sp))
    return EpShape(int(a["hidden_size"]), int(a["moe_router_topk"]), experts, tokens, group,
                   min(group, lay.gpus_per_node), 2 if (a.get("bf16") or a.get("fp16")) else 4)


def ep_buffer_modes(shape: EpShape, capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
                    num_sms: int = DEFAULT_NUM_SMS) -> list[BufferMode]:
    """Per-rank memory of each mode for `shape`, from the sizing functions the native backends use:
    eager (the uccl dispatcher's Buffer as it opens, and after a step of uniformly routed tokens), the static
    receive budget (`capacity_factor`), the worst case (every token of every rank to one rank) and
    low-latency. Needs the native module (any build: the layouts are host arithmetic)."""
    R, L, T, k, E = shape.ranks, shape.ranks_per_node, shape.tokens, shape.topk, shape.experts
    hb, epr = shape.row_bytes, E // R
    start_nvl = default_nvl_bytes(hb, R, num_sms)
    rows = sizing.typical_rows(T, k, E, R)
    cap = sizing.budget_capacity(T, k, capacity_factor, epr, R)
    static_recv = sizing.capacity_recv_tokens(T, epr, R, cap)
    static_rows = epr * R * cap
    worst_recv = R * T

    def rows_mode(name: str, nvl: int, rdma: int, out_rows: int, note: str) -> BufferMode:
        return BufferMode(name, nvl, rdma, out_rows, out_rows * hb, note)

    if R <= L:  # one node: the intranode buffer
        nvl0 = max(start_nvl, sizing.MIN_BYTES)
        step = sizing.intranode_bytes_after(nvl0, sizing.intranode_dispatch_needs(rows, rows, hb, 0, k, hb))
        static = sizing.intranode_bytes_after(nvl0, sizing.intranode_dispatch_needs(
            static_recv, sizing.worst_send_rows(static_recv, R, epr, cap), hb, 0, k, hb))
        worst = sizing.intranode_bytes_after(nvl0, sizing.intranode_dispatch_needs(
            worst_recv, sizing.worst_send_rows(worst_recv, R, epr, 0, T), hb, 0, k, hb))
        modes = [rows_mode("eager start", nvl0, 0, 0, "what the uccl dispatcher's Buffer opens with"),
                 rows_mode("eager step", step, 0, T * k, f"grown for ~{rows} rows received per rank"),
                 rows_mode("static budget", static, 0, static_rows,
                           f"factor {capacity_factor:g}: capacity {cap} per (expert, rank), {static_recv} rows "
                           "received at most"),
                 rows_mode("worst case", worst, 0, worst_recv, f"num_worst_tokens={worst_recv}, "
                           f"num_max_tokens_per_rank={T}: every token to one rank")]
    else:  # several nodes: NVL buffer + RDMA region, sized from the per-node counts
        N = R // L
        nvl0, rdma0 = sizing.internode_start(start_nvl, 0)
        rd = [sizing.typical_node_tokens(T, k, E, N)] * (R * N)
        need_rdma, need_nvl = sizing.internode_need(rd, R, L, hb, 0, k, hb, rows, ranks=[0])
        step = (sizing.internode_grow(nvl0, need_nvl), sizing.internode_grow(rdma0, need_rdma))
        w_rdma, w_nvl = sizing.internode_worst_need(T, hb, R, L, k)
        modes = [rows_mode("eager start", nvl0, rdma0, 0, "what the uccl dispatcher's Buffer opens with"),
                 rows_mode("eager step", *step, T * k, f"grown for ~{rd[0]} tokens per node, ~{rows} rows received"),
                 rows_mode("static budget", *step, static_rows,
                           f"factor {capacity_factor:g}: capacity {cap}; buffers sized from the counts as eager "
                           "(only the outputs are fixed)"),
                 rows_mode("worst case", w_nvl, w_rdma, worst_recv,
                           f"get_rdma_buffer_size_hint(num_tokens={T}): any routing without growing")]
    ll = Buffer.get_low_latency_rdma_size_hint(T, shape.hidden, R, E)
    modes.append(rows_mode("low-latency", 0, ll, epr * R * T,
                           f"get_low_latency_rdma_size_hint({T}, {shape.hidden}, {R}, {E})"))
    return modes


def ep_buffer_lines(shape: Optional[EpShape], modes: list[BufferMode]) -> list[str]:
    """The report's EP buffer table (nothing without an EP group)."""
    if shape is None:
        return []
    head = (f"EP buffers per rank by mode ({shape.tokens} tokens x hidden {shape.hidden} x {shape.element_bytes} "
            f"bytes, top-{shape.topk} of {shape.experts} experts, EP {shape.ranks}, {shape.ranks_per_node} per node):")
    if not modes:
        return [head, "  (needs the native module uccl_ep_train._native, any build: python setup.py build_ext "
                      "--inplace)"]
    lines = [head, f"  {'mode':<14}{'NVLink':>12}{'RDMA':>12}{'total':>12}{'outputs':>12}  rows out"]
    for m in modes:
        lines.append(f"  {m.mode:<14}{_fmt_gib(m.nvl_bytes):>12}{_fmt_gib(m.rdma_bytes):>12}"
                     f"{_fmt_gib(m.buffer_bytes):>12}{_fmt_gib(m.out_bytes):>12}  {m.out_rows}: {m.note}")
    return lines


def _ep_buffer_bytes(recipe: Recipe, lay: Layout) -> int:
    """EP buffer bytes the memory estimate counts: the eager mode's buffers after a typical step (the uccl
    dispatcher's default), or, without the native module's layouts, what its Buffer opens with."""
    shape = ep_shape(recipe, lay)
    if shape is None:
        return 0
    if not sizing.layouts_available():
        return default_nvl_bytes(shape.row_bytes, shape.ranks)
    return next(m.buffer_bytes for m in ep_buffer_modes(shape) if m.mode == "eager step")


def estimate_memory(recipe: Recipe, lay: Layout) -> MemoryEstimate:
    a = recipe.args
    pb = count_params(recipe)
    pattern = recipe.moe_layers()
    h, seq, mbs = int(a["hidden_size"]), int(a["seq_length"]), int(a["micro_batch_size"])
    bf16 = bool(a.get("bf16") or a.get("fp16"))
    act_bytes = 2 if bf16 else 4
    experts = int(a.get("num_experts") or 0)
    topk = int(a.get("moe_router_topk") or 0)
    tp, ep, etp, cp = lay.tp, lay.ep, lay.etp, lay.cp
    stages = lay.stage_layers or [len(pattern)]
    tokens = seq * mbs // cp                          # tokens of one micro-batch on this GPU
    sp = tp if a.get("sequence_parallel") else 1      # h-sized tensors are split over TP with SP
    vocab = padded_vocab_size(recipe)

    def layer_activation(moe: bool) -> int:
        t = tokens
        n = 2 * t * h // sp                                           # layer input + pre-MLP residual
        n += t * h // sp                                              # input norm output
        if a.get("multi_latent_attention"):
            heads = int(a["num_attention_heads"])
            qk, pos, v = int(a["qk_head_dim"]), int(a["qk_pos_emb_head_dim"]), int(a["v_head_dim"])
            n += t * (int(a.get("q_lora_rank") or 0) + int(a["kv_lora_rank"]) + pos)   # latents
            n += t * heads * (2 * (qk + pos) + 2 * v) // tp                              # q, k, v, context
        else:
            heads = int(a["num_attention_heads"])
            kv = int(a.get("kv_channels") or h // heads)
            n += t * heads * kv * 4 // tp
        n += t * h // sp                                              # pre-MLP norm output
        if moe:
            fm = int(a["moe_ffn_hidden_size"])
            rows = t * topk                                           # balanced routing: t*topk rows per GPU
            n += rows * (2 * h + 3 * fm // etp)                       # dispatched in, fc1, act, expert out
            fs = int(a.get("moe_shared_expert_intermediate_size") or 0)
            n += t * 3 * fs // tp
            n = n * act_bytes + t * experts * 4 * 2                   # + fp32 router logits and probs
            return n
        f = int(a["ffn_hidden_size"])
        n += t * 3 * f // tp
        return n * act_bytes

    best: Optional[MemoryEstimate] = None
    start = 0
    in_flight_base = lay.num_microbatches or 1
    for s, n_layers in enumerate(stages):
        layers = pattern[start:start + n_layers]
        start += n_layers
        # TP splits attention, MLPs, shared experts and embeddings; norms and routers are replicated
        dense = sum(pb.attention + (pb.shared_experts if m else pb.dense_mlp) for m in layers)
        replicated = sum(pb.layer_norms + (pb.router if m else 0) for m in layers)
        expert = sum(experts * pb.routed_expert for m in layers if m)
        if s == 0:
            dense += pb.embedding
        if s == len(stages) - 1:
            dense += pb.output_layer + pb.mtp - pb.mtp_routed
            replicated += pb.final_norm
            expert += pb.mtp_routed
        p_dense = dense // tp + replicated
        p_expert = expert // (ep * etp) if experts else 0
        params = p_dense + p_expert
        weights = params * act_bytes
        grads = params * 4                                            # fp32 main gradients
        opt_per_param = 12 if bf16 else 8                             # fp32 master (bf16 only) + Adam m, v
        if a.get("use_distributed_optimizer"):
            optimizer = p_dense * opt_per_param // max(lay.dp * cp, 1) + p_expert * opt_per_param // max(lay.expert_dp, 1)
        else:
            optimizer = params * opt_per_param
        # 1F1B: stage s holds activations of up to (PP - s) micro-batches
        in_flight = min(lay.pp - s, in_flight_base) if lay.pp > 1 else 1
        per_layer = [layer_activation(bool(m)) for m in layers] or [0]
        if a.get("recompute_granularity") == "full":
            stored = len(layers) * tokens * h // sp * act_bytes
            acts = stored * in_flight + max(per_layer)
        else:
            acts = sum(per_layer) * in_flight
        if s == len(stages) - 1:
            acts += tokens * vocab // tp * 4 * 2                      # fp32 logits and their gradient
        epb = _ep_buffer_bytes(recipe, lay)
        total = weights + grads + optimizer + acts + epb
        est = MemoryEstimate(s, p_dense, p_expert, weights, grads, optimizer, acts, epb, total)
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


# ---------------------------------------------------------------------------------------------------------
# launch command
# ---------------------------------------------------------------------------------------------------------
def torchrun_command(recipe: Recipe, nnodes: int, nproc_per_node: int, node_rank: Any = "$NODE_RANK",
                     master_addr: Any = "$MASTER_ADDR", master_port: Any = "$MASTER_PORT",
                     entry: str = "pretrain-gpt", extra: Optional[list[str]] = None,
                     torchrun: str = "torchrun") -> list[str]:
    """The per-node torchrun command: `uccl-ep-train <entry>` (pretrain-gpt: Megatron-LM's pretrain_gpt
    through megatron_patch; train: our own training job) with the recipe's Megatron-LM arguments."""
    cmd = shlex.split(torchrun) + ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
           "--node-rank", str(node_rank), "--master-addr", str(master_addr), "--master-port", str(master_port),
           "-m", "uccl_ep_train.apps.cli", entry]
    if entry == "pretrain-gpt":
        extra_flags = {a.split("=", 1)[0] for a in (extra or [])}
        if extra_flags & {"--data-path", "--train-data-path", "--per-split-data-args-path", "--data-args-path"}:
            recipe = recipe.with_args(mock_data=False)   # real data given: the recipe's --mock-data must go
        cmd += recipe.megatron_args()
    else:
        cmd += ["--recipe", recipe.name]
    return cmd + list(extra or [])


def _quote(cmd: list[str]) -> str:
    # keep $VARS expandable in the printed command
    return " ".join(c if c.startswith("$") and c[1:].replace("_", "").isalnum() else shlex.quote(c) for c in cmd)


def _fmt_gib(n: int) -> str:
    return f"{n / GiB:8.2f} GiB" if n >= GiB // 10 else f"{n / 2**20:8.2f} MiB"


def _fmt_count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 10**8 else f"{n / 1e6:.3f} M"


def _apply_overrides(recipe: Recipe, ns: argparse.Namespace) -> Recipe:
    upd: dict[str, Any] = {}
    for opt, dest in (("tp", "tensor_model_parallel_size"), ("pp", "pipeline_model_parallel_size"),
                      ("ep", "expert_model_parallel_size"), ("etp", "expert_tensor_parallel_size"),
                      ("cp", "context_parallel_size"), ("mbs", "micro_batch_size"), ("gbs", "global_batch_size"),
                      ("seq_length", "seq_length"), ("mtp_num_layers", "mtp_num_layers")):
        v = getattr(ns, opt)
        if v is not None:
            upd[dest] = v
    if ns.tp is not None:
        upd["sequence_parallel"] = ns.tp > 1      # Megatron needs it for MoE with TP > 1
    if ns.seq_length is not None and int(recipe.args.get("max_position_embeddings") or 0) < ns.seq_length:
        upd["max_position_embeddings"] = ns.seq_length
    if ns.pp is not None and ns.pp != recipe.pp and not ns.keep_stage_layers:
        # the recipe's first/last stage sizes were chosen for its own PP: split the layers anew
        first, last = balanced_stage_split(int(recipe.args["num_layers"]), ns.pp)
        upd["decoder_first_pipeline_num_layers"] = first
        upd["decoder_last_pipeline_num_layers"] = last
    return recipe.with_args(**upd) if upd else recipe


def with_layout(recipe: Recipe, tp: int, pp: int, ep: int) -> Recipe:
    """`recipe` with another TP x PP x EP layout (ETP 1, sequence parallel with TP > 1, stages re-split)."""
    first, last = balanced_stage_split(int(recipe.args["num_layers"]), pp)
    return recipe.with_args(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                            sequence_parallel=tp > 1, decoder_first_pipeline_num_layers=first,
                            decoder_last_pipeline_num_layers=last)


def valid_layouts(recipe: Recipe, nodes: int, gpus_per_node: int) -> list[tuple[Recipe, Layout, MemoryEstimate]]:
    """Every TP x PP x EP layout of `recipe` (with_layout: TP 1, 2, 4, 8 inside a node) that check_layout
    accepts on this cluster, with estimate_memory's estimate: the plan's own rules, so each one is a layout
    `plan --tp --pp --ep` accepts and estimates alike."""
    world = nodes * gpus_per_node
    experts = int(recipe.args.get("num_experts") or 0)
    heads = int(recipe.args["num_attention_heads"])
    L = int(recipe.args["num_layers"])
    found = []
    for tp in (t for t in (1, 2, 4, 8) if gpus_per_node % t == 0 and heads % t == 0):
        for pp in (p for p in range(1, min(L, 64) + 1) if world % (tp * p) == 0):
            eps = [e for e in range(1, experts + 1) if experts % e == 0] if experts else [1]
            for ep in eps:
                if world % (ep * pp):
                    continue
                r = with_layout(recipe, tp, pp, ep)
                lay = check_layout(r, nodes, gpus_per_node)
                if not lay.errors:
                    found.append((r, lay, estimate_memory(r, lay)))
    return found


def suggest_layouts(recipe: Recipe, nodes: int, gpus_per_node: int, gpu_mem_gib: float,
                    limit: int = 5) -> list[tuple[Recipe, Layout, MemoryEstimate]]:
    """Valid TP x PP x EP layouts for the cluster that fit in `gpu_mem_gib` (with 10 % headroom), best
    first: fewest pipeline stages, then smallest TP (TP stays inside a node), then least memory."""
    found = [x for x in valid_layouts(recipe, nodes, gpus_per_node) if x[2].total <= 0.9 * gpu_mem_gib * GiB]
    found.sort(key=lambda x: (x[1].pp, x[1].tp, x[2].total))
    return found[:limit]


def fewest_nodes_that_fit(recipe: Recipe, nodes: int, gpus_per_node: int, gpu_mem_gib: float,
                          max_factor: int = 4) -> Optional[int]:
    """When no layout fits `nodes`: the fewest nodes of `gpus_per_node` GPUs (tried in steps of a quarter of
    `nodes`, up to `max_factor` times as many) on which suggest_layouts finds one; None if none does."""
    step = max(1, nodes // 4)
    for n in range(nodes + step, max_factor * nodes + 1, step):
        if suggest_layouts(recipe, n, gpus_per_node, gpu_mem_gib, 1):
            return n
    return None


def _layout_line(recipe_arg: str, nodes: int, gpus_per_node: int, r: Recipe, lay: Layout,
                 mem: MemoryEstimate) -> str:
    stages = "" if r.args.get("decoder_first_pipeline_num_layers") is None else \
        f" (stages {r.args['decoder_first_pipeline_num_layers']}|...|{r.args['decoder_last_pipeline_num_layers']})"
    return (f"  TP {lay.tp} PP {lay.pp} EP {lay.ep}{stages}: DP {lay.dp}, expert-DP {lay.expert_dp}, "
            f"{_fmt_gib(mem.total).strip()} per GPU  ->  uccl-ep-train plan --recipe {recipe_arg} "
            f"--nodes {nodes} --gpus-per-node {gpus_per_node} --tp {lay.tp} --pp {lay.pp} --ep {lay.ep}")


def layout_advice(recipe: Recipe, recipe_arg: str, nodes: int, gpus_per_node: int, gpu_mem_gib: float,
                  limit: int = 5) -> tuple[list[tuple[Recipe, Layout, MemoryEstimate]], list[str]]:
    """What to run instead, for --suggest and for a layout that is refused or does not fit: (the layouts
    that fit, best first; the lines that say so). When none fits, the lines give the layouts needing the
    least memory here and the fewest nodes on which one fits."""
    found = suggest_layouts(recipe, nodes, gpus_per_node, gpu_mem_gib, limit)
    where = f"{nodes} node(s) x {gpus_per_node} GPU(s)"
    if found:
        return found, [f"layouts of {recipe.name} that fit {where}, {gpu_mem_gib:g} GiB each (best first):",
                       *(_layout_line(recipe_arg, nodes, gpus_per_node, *x) for x in found)]
    lines = [f"no TP x PP x EP layout of {recipe.name} fits {where} of {gpu_mem_gib:g} GiB (with 10 % headroom)"]
    least = sorted(valid_layouts(recipe, nodes, gpus_per_node), key=lambda x: x[2].total)[:limit]
    if least:
        lines += ["the valid layouts needing the least memory:",
                  *(_layout_line(recipe_arg, nodes, gpus_per_node, *x) for x in least)]
    more = fewest_nodes_that_fit(recipe, nodes, gpus_per_node, gpu_mem_gib)
    lines.append(f"it fits from {more} nodes of {gpus_per_node} GPU(s): uccl-ep-train plan --recipe {recipe_arg} "
                 f"--nodes {more} --gpus-per-node {gpus_per_node} --gpu-mem-gib {gpu_mem_gib:g} --suggest"
                 if more else f"no layout fits up to {4 * nodes} nodes of {gpus_per_node} GPU(s) either")
    return [], lines


def build_parser() -> argparse.ArgumentParser:
    head, _, rest = (__doc__ or "").partition("\n\n")
    p = argparse.ArgumentParser(prog="uccl-ep-train plan", description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, help="deepseek-v3, deepseek-v2-lite, tiny, or a recipe file")
    p.add_argument("--nodes", type=int, help="number of nodes (default: the recipe's reference cluster)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs (ranks) per node (default: the recipe's)")
    for opt in ("tp", "pp", "ep", "etp", "cp", "mbs", "gbs"):
        p.add_argument(f"--{opt}", type=int, help=f"override the recipe's {opt.upper()}")
    p.add_argument("--seq-length", type=int)
    p.add_argument("--mtp-num-layers", type=int, help="multi-token prediction layers (DeepSeek-V3 publishes 1)")
    p.add_argument("--keep-stage-layers", action="store_true",
                   help="with --pp, keep the recipe's first/last pipeline stage layer counts")
    p.add_argument("--gpu-mem-gib", type=float, default=80.0, help="GPU memory to compare against (GiB)")
    p.add_argument("--tokens-per-rank", type=int, default=None,
                   help="tokens per rank and dispatch for the EP buffer table (default: one micro-batch's share)")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="receive budget for the table's static mode (default: the recipe's "
                        f"moe_expert_rank_capacity_factor, else {DEFAULT_CAPACITY_FACTOR:g})")
    p.add_argument("--entry", choices=("pretrain-gpt", "train"), default="pretrain-gpt",
                   help="what torchrun runs: Megatron-LM's pretrain_gpt through our patch, or our train job")
    p.add_argument("--node-rank", default="$NODE_RANK")
    p.add_argument("--master-addr", default="$MASTER_ADDR")
    p.add_argument("--master-port", default="$MASTER_PORT")
    p.add_argument("--torchrun", default="torchrun", help="torchrun command (split like a shell would)")
    p.add_argument("--nic", default=None, help="NIC family for flow-control settings: " + ", ".join(NIC_PROFILES))
    p.add_argument("--emit", choices=("report", "torchrun", "megatron-args", "env", "shell"), default="report",
                   help="report (default); or only the torchrun command, the Megatron-LM args, the "
                        "environment as `export NAME=\"${NAME:-value}\"` lines (values already set win), or "
                        "shell: the env lines then UCCL_LAUNCH_CMD=<torchrun command> (what slurm/launch.sh evals)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the report as JSON to PATH, as every command's --json does (no PATH or '-': stdout)")
    p.add_argument("--suggest", type=int, nargs="?", const=5, default=None, metavar="N",
                   help="list up to N (default 5) TP x PP x EP layouts that fit this cluster, best first")
    p.add_argument("--check-megatron", action="store_true",
                   help="also run Megatron-LM's own validate_args on the recipe at this world size "
                        "(imports megatron.training; a few seconds)")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: extra arguments for the entry point")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    extra = list(ns.extra)
    if extra and extra[0] == "--":
        extra = extra[1:]
    try:
        recipe = _apply_overrides(load_recipe(ns.recipe), ns)
        env = {**recipe.env, **nic_env(ns.nic)}
    except ValueError as exc:
        print(f"uccl-ep-train plan: {exc}", file=sys.stderr)
        return 2
    nodes = ns.nodes if ns.nodes is not None else int(recipe.cluster.get("nodes", 1))
    gpn = ns.gpus_per_node if ns.gpus_per_node is not None else int(recipe.cluster.get("gpus_per_node", 1))
    limit = ns.suggest if ns.suggest is not None else 5
    if ns.suggest is not None:
        found, lines = layout_advice(recipe, ns.recipe, nodes, gpn, ns.gpu_mem_gib, limit)
        print("\n".join(lines), file=sys.stdout if found else sys.stderr)
        return 0 if found else 2
    if ns.entry == "train":
        # `uccl-ep-train train` runs EP over all ranks, one micro-batch per rank per step
        world = nodes * gpn
        recipe = recipe.with_args(expert_model_parallel_size=ns.ep or world,
                                  global_batch_size=ns.gbs or int(recipe.args["micro_batch_size"]) * world)
    lay = check_layout(recipe, nodes, gpn)
    if ns.check_megatron and not lay.errors:
        try:
            recipe.validate_megatron(lay.world)
        except (AssertionError, ValueError, SystemExit) as exc:
            lay.errors.append(f"Megatron-LM's validate_args refuses it: {exc}")
    if lay.errors:
        print(f"uccl-ep-train plan: recipe {recipe.name!r} does not fit {nodes} node(s) x {gpn} GPU(s):",
              file=sys.stderr)
        for e in lay.errors:
            print(f"  - {e}", file=sys.stderr)
        print("\n".join(layout_advice(recipe, ns.recipe, nodes, gpn, ns.gpu_mem_gib, limit)[1]), file=sys.stderr)
        return 2
    cmd = torchrun_command(recipe, nodes, gpn, ns.node_rank, ns.master_addr, ns.master_port, ns.entry, extra,
                           ns.torchrun)
    if ns.emit == "torchrun":
        print(" ".join(shlex.quote(c) for c in cmd))
        return 0
    if ns.emit in ("env", "shell"):
        for k, v in env.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) or not re.fullmatch(r"[A-Za-z0-9_.,:/+=-]*", v):
                print(f"uccl-ep-train plan: env {k}={v!r} is not a plain NAME=value", file=sys.stderr)
                return 2
            print(f"export {k}=\"${{{k}:-{v}}}\"")
        if ns.emit == "shell":
            print("UCCL_LAUNCH_CMD=" + shlex.quote(" ".join(shlex.quote(c) for c in cmd)))
        return 0
    if ns.emit == "megatron-args":
        print(" ".join(shlex.quote(c) for c in recipe.megatron_args() + extra))
        return 0
    for name in ("tokens_per_rank", "capacity_factor"):
        v = getattr(ns, name)
        if v is not None and not v > 0:
            print(f"uccl-ep-train plan: --{name.replace('_', '-')} must be > 0, got {v}", file=sys.stderr)
            return 2
    pb = count_params(recipe)
    mem = estimate_memory(recipe, lay)
    factor = ns.capacity_factor or recipe.args.get("moe_expert_rank_capacity_factor") or DEFAULT_CAPACITY_FACTOR
    shape = ep_shape(recipe, lay, ns.tokens_per_rank)
    modes = ep_buffer_modes(shape, factor) if shape is not None and sizing.layouts_available() else []
    sbatch = ["sbatch", f"--nodes={nodes}", f"--gpus-per-node={gpn}", "slurm/train.sbatch", recipe.name]
    fits = mem.total <= ns.gpu_mem_gib * GiB
    found, advice = ([], []) if fits else layout_advice(recipe, ns.recipe, nodes, gpn, ns.gpu_mem_gib, limit)
    if ns.json:
        suggestions = [{"tp": x.tp, "pp": x.pp, "ep": x.ep, "dp": x.dp, "expert_dp": x.expert_dp,
                        "stage_layers": x.stage_layers, "memory_total": m.total} for _, x, m in found]
        report = json.dumps({"recipe": recipe.name, "layout": asdict(lay), "params": asdict(pb),
                             "memory": asdict(mem), "gpu_mem_gib": ns.gpu_mem_gib, "fits": fits,
                             "ep_shape": None if shape is None else asdict(shape),
                             "ep_buffer_modes": [asdict(m) for m in modes],
                             "suggestions": suggestions, "sbatch": sbatch, "torchrun": cmd, "env": env}, indent=1)
        if ns.json == "-":
            print(report)
        else:
            with open(ns.json, "w") as f:
                f.write(report + "\n")
        return 0
    out = [f"recipe {recipe.name}: {recipe.description}",
           f"cluster   {nodes} node(s) x {gpn} GPU(s) = {lay.world} ranks",
           f"layout    TP {lay.tp} x PP {lay.pp} x CP {lay.cp} x DP {lay.dp}; experts: EP {lay.ep} x ETP {lay.etp} "
           f"x expert-DP {lay.expert_dp}; dispatcher {recipe.args.get('moe_token_dispatcher_type')}",
           f"stages    layers per pipeline stage {lay.stage_layers}; {lay.num_microbatches} micro-batch(es) "
           f"of {recipe.args['micro_batch_size']} x {recipe.args['seq_length']} tokens per step",
           f"params    total {_fmt_count(pb.total)}, active {_fmt_count(pb.active)} per token "
           f"({pb.dense_layers} dense + {pb.moe_layers} MoE layers"
           + (f"; MTP {_fmt_count(pb.mtp)} included in total)" if pb.mtp else ")"),
           f"memory per GPU (stage {mem.stage}, the heaviest; {_fmt_count(mem.params_dense)} dense + "
           f"{_fmt_count(mem.params_expert)} expert params):",
           f"  weights      {_fmt_gib(mem.weights)}",
           f"  gradients    {_fmt_gib(mem.gradients)}",
           f"  optimizer    {_fmt_gib(mem.optimizer)}",
           f"  activations  {_fmt_gib(mem.activations)}",
           f"  EP buffers   {_fmt_gib(mem.ep_buffers)}",
           f"  total        {_fmt_gib(mem.total)}  " + ("fits" if fits else "DOES NOT FIT")
           + f" in {ns.gpu_mem_gib:g} GiB"]
    out += ep_buffer_lines(shape, modes)
    out += [f"note      {n}" for n in lay.notes]
    out += ["launch    " + " ".join(sbatch),
            "per node  " + " ".join(f"{k}={v}" for k, v in env.items()),
            "          " + _quote(cmd)]
    out += advice
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
