"""`uccl-ep-train bench internode`: high-throughput dispatch/combine across nodes (CPU proxies + NVLink).

Ranks form nodes of `--ranks-per-node` consecutive ranks (UCCL_EP_RANKS_PER_NODE in every rank; under
torchrun LOCAL_WORLD_SIZE unless the flag is given), so one host can play several nodes: the bytes between
them then go through the CPU proxies (the `ipc` transport) as they would through RDMA between hosts. More
ranks than GPUs share the GPUs (rank r on GPU r % count) over a gloo group with CUDA tensors
(UCCL_EP_DEVICE=cuda); run NVIDIA MPS for that (a warning says when it is not running).

`--transport` picks the proxies' transport (`fabric` with FI_PROVIDER=shm carries GPU memory on one host
given a libfabric built with CUDA, docs/proxy.md); every call is issued from a stream of the rank's own
(`on_own_stream`), which that transport requires.

Per rank, DeepEP's conventions as `bench intranode` has them: cached-handle BF16 dispatch, FP8 dispatch
(e4m3 + per-128-channel float32 scales) and BF16 combine with top-k weights, plus the fresh BF16 dispatch
as Megatron's drop-and-pad calls it (`dispatch_fresh_bf16`: get_dispatch_layout, then dispatch with
num_worst_tokens and num_max_tokens_per_rank (every rank has the shape's tokens): no host sync, the counts stay
on the GPU; inside `validation.trusted_values()`, as the Megatron dispatcher makes it, so that the host's value
checks do not read the ids back). µs per call = median over
`--iters` (after `--warmup`) of CUDA events around each call (timing "api": host work included; `host_us`:
the host's time until the call returned); with the native backend on GPUs also the mean device time of the
call's own kernels (timing "kernel", rounds started on every rank's GPU together, as `bench low-latency`).
- RDMA GB/s: bytes this rank's tokens cross to other nodes per call / time. One copy of a token crosses
  to each other node holding at least one of its experts (counted from the routing), carrying the token's
  payload: hidden x element size + float32 scales (FP8) + int32 top-k ids + float32 top-k weights
  (combine: the reduced row + its weights coming back). DeepEP's test_internode counts hidden bytes only
  and includes the own node; ours counts what leaves the node.
- Measured through the proxies, when the backend reports it (`proxy_stats`): bytes per call to the ranks
  of other nodes and commands/s (all destinations).
- NVL GB/s: bytes this rank receives (all rows, own node included; hidden + scales, as bench intranode)
  / time.
NCCL all_to_all_single of the same bytes is the yardstick (op "alltoall"; skipped on a gloo group with
CUDA tensors). Without GPUs it runs gloo ranks on CPU (reference backend) at a small default shape.
`--json PATH` writes one record per (op, SMs), averaged over ranks, with the run's command, date, commit,
device and GPU count, and "sms_occupied": Buffer.occupied_sms of the timed call's Config (None for the
reference backend and all_to_all_single).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import (LAYER_SHAPE, add_layer_shape_args, add_ranks_arg, add_ranks_per_node_arg, add_transport_arg,
               aligned_device_us, gpus_used, init_rank_group, int_list, on_own_stream, publish, rank_records,
               ranks_env, run_context, transport_env, warn_without_mps)
from ..launch import launched_world

FP8_BLOCK = 128
CPU_LAYER_SHAPE = {"num_tokens": 128, "hidden": 512, "num_experts": 32, "num_topk": 4}  # gloo ranks on CPU
SEED = 1234  # rank r routes with torch.Generator().manual_seed(SEED + r): see make_inputs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="uccl-ep-train bench internode", description=__doc__.split("\n")[0])
    add_ranks_arg(p, "visible GPUs, at least 2; 4 on CPU")
    add_ranks_per_node_arg(p, "half the ranks")
    add_transport_arg(p)
    add_layer_shape_args(p)
    p.set_defaults(**{k: None for k in LAYER_SHAPE})  # resolved per device: DeepSeek-V3 on GPUs, small on CPU
    p.add_argument("--sms", type=int_list, default="24", help="comma-separated SM counts (Config.num_sms) to sweep")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--backend", default="auto", choices=("auto", "native", "reference"), help="UCCL_EP_BACKEND")
    p.add_argument("--num-nvl-bytes", type=float, default=0, help="NVLink buffer bytes (default: what the shape needs)")
    p.add_argument("--num-rdma-bytes", type=float, default=0, help="RDMA buffer bytes (default: what the shape needs)")
    p.add_argument("--no-fp8", action="store_true")
    p.add_argument("--no-alltoall", action="store_true", help="skip the all_to_all_single comparison")
    p.add_argument("--json", default=None, help="write the records here")
    return p


def resolve_shape(args, cuda: bool) -> dict:
    """The layer shape: flags given win, the rest from DeepSeek-V3 on GPUs or CPU_LAYER_SHAPE on CPU."""
    base = LAYER_SHAPE if cuda else CPU_LAYER_SHAPE
    return {k: getattr(args, k) if getattr(args, k) is not None else base[k] for k in LAYER_SHAPE}


def make_inputs(rank: int, shape: dict, device: torch.device):
    """This rank's tokens and routing (CPU generator, so every device routes alike): x [T, H] bf16, topk_idx
    [T, K] int64 (K distinct experts per token), topk_weights [T, K] float32."""
    T, H, E, K = shape["num_tokens"], shape["hidden"], shape["num_experts"], shape["num_topk"]
    g = torch.Generator().manual_seed(SEED + rank)
    topk_idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(torch.int64)
    topk_w = torch.rand(T, K, generator=g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return x.to(device), topk_idx.to(device), topk_w.to(device)


def tokens_per_node(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int) -> torch.Tensor:
    """[num_nodes] int64: tokens with at least one expert on each node (DeepEP's num_tokens_per_rdma_rank)."""
    num_nodes = num_ranks // ranks_per_node
    node = topk_idx // (num_experts // num_ranks) // ranks_per_node
    node = torch.where(topk_idx >= 0, node, num_nodes)  # -1 (no expert) goes to a column dropped below
    hit = torch.zeros(topk_idx.size(0), num_nodes + 1, dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, node, True)
    return hit[:, :num_nodes].sum(dim=0).cpu()


def payload_bytes(op: str, hidden: int, num_topk: int) -> int:
    """Bytes of one token's copy crossing to another node: hidden x element size, float32 scales (FP8),
    int32 top-k ids and float32 top-k weights (dispatch); the reduced bf16 row and its weights (combine)."""
    if op in ("dispatch_bf16", "dispatch_fresh_bf16"):
        return hidden * 2 + num_topk * (4 + 4)
    if op == "dispatch_fp8":
        return hidden + hidden // FP8_BLOCK * 4 + num_topk * (4 + 4)
    if op == "combine":
        return hidden * 2 + num_topk * 4
    raise ValueError(f"payload_bytes: unknown op {op!r}")


def rdma_bytes(op: str, topk_idx: torch.Tensor, shape: dict, num_ranks: int, ranks_per_node: int,
               rank: int) -> int:
    """Bytes this rank's tokens cross to (dispatch) or get back from (combine) other nodes per call."""
    per_node = tokens_per_node(topk_idx, shape["num_experts"], num_ranks, ranks_per_node)
    remote = int(per_node.sum()) - int(per_node[rank // ranks_per_node])
    return remote * payload_bytes(op, shape["hidden"], shape["num_topk"])


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _time_calls(fn: Callable[[], object], iters: int, warmup: int, group, cuda: bool,
                stats: Optional[Callable[[], tuple[int, int]]] = None
                ) -> tuple[list[float], list[float], Optional[tuple]]:
    """Per-call µs of `iters` back-to-back calls after `warmup` (CUDA events around each call; wall clock on
    CPU), started together on every rank, and the host µs each call took to return; with `stats`, its
    (bytes, commands) difference over the timed calls."""
    for _ in range(warmup):
        fn()
    _sync(cuda)
    dist.barrier(group=group)
    _sync(cuda)
    before = stats() if stats else None
    if cuda:
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        host = []
        for start, end in marks:
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e6)
            end.record()
        torch.cuda.synchronize()
        us = [start.elapsed_time(end) * 1e3 for start, end in marks]
    else:
        us = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            us.append((time.perf_counter() - t0) * 1e6)
        host = us
    delta = None
    if stats:
        after = stats()
        delta = (after[0] - before[0], after[1] - before[1])
    return us, host, delta


# The native kernels of each op, in launch order, as (step, kernel name): the "kernel" timing is the sum of
# their device time per call, and each step's share is recorded (kernel_us) to show where an op's time goes
# (pack: reading x into rows, waiting for the peers' READY; forward: the proxies' hand-over and transfer,
# then the rows to the node's ranks; copy-out: the node barrier and the rows into the outputs). torch's own
# small kernels in a call, e.g. zero fills, are not counted.
_DISPATCH = (("pack", "dispatch_pack_kernel"), ("forward", "dispatch_forward_kernel"),
             ("copy_out", "dispatch_copy_out_kernel"))
_KERNELS = {"dispatch_bf16": _DISPATCH, "dispatch_fp8": _DISPATCH,
            "dispatch_fresh_bf16": (("layout", "dispatch_layout_kernel"), ("notify", "notify_kernel"),
                                    ("counts", "counts_kernel"), *_DISPATCH),
            "combine": (("stage", "combine_stage_kernel"), ("forward", "combine_forward_kernel"),
                        ("reduce", "combine_reduce_kernel"))}


def _rank_main(rank: int, world: int, args, shape: dict, device: torch.device, group) -> list[dict]:
    from uccl_ep_train import Buffer, validation
    from uccl_ep_train.fp8 import fp8_dtype_for, per_token_cast_to_fp8
    from uccl_ep_train.topology import detect_topology

    if args.backend != "auto":
        os.environ["UCCL_EP_BACKEND"] = args.backend
    cuda = device.type == "cuda"
    topo = detect_topology(group)
    L, nodes = topo.ranks_per_node, topo.num_nodes
    T, H, E, K = shape["num_tokens"], shape["hidden"], shape["num_experts"], shape["num_topk"]
    x, topk_idx, topk_w = make_inputs(rank, shape, device)
    x_fp8 = per_token_cast_to_fp8(x, dtype=fp8_dtype_for(device))

    row = H * 2 + H // FP8_BLOCK * 4 + K * 12 + 16
    nvl = int(args.num_nvl_bytes) or world * T * row + (64 << 20)
    rdma = int(args.num_rdma_bytes) or (2 * nodes * T * row + (64 << 20) if nodes > 1 else 0)
    buf = Buffer(group, nvl, rdma, explicitly_destroy=True)
    # the layout and the fresh dispatch exactly as DeepEP's tests/test_internode.py passes them
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \
        buf.get_dispatch_layout(topk_idx, E)
    per_node = tokens_per_node(topk_idx, E, world, L)
    if num_tokens_per_rdma_rank is not None and not torch.equal(num_tokens_per_rdma_rank.cpu().long(), per_node):
        raise RuntimeError(f"rank {rank}: get_dispatch_layout's num_tokens_per_rdma_rank "
                           f"{num_tokens_per_rdma_rank.tolist()} != tokens per node from the routing "
                           f"{per_node.tolist()}")
    sms_list = args.sms
    cfg0 = dataclasses.replace(Buffer.get_dispatch_config(world), num_sms=sms_list[0])
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
        topk_weights=topk_w, config=cfg0)
    num_recv = recv_x.size(0)
    nvl_bytes = {"dispatch_bf16": num_recv * H * 2, "dispatch_fp8": num_recv * (H + H // FP8_BLOCK * 4),
                 "combine": num_recv * H * 2, "dispatch_fresh_bf16": num_recv * H * 2}
    # the fresh dispatch as Megatron's drop-and-pad calls it: layout, then outputs sized by num_worst_tokens
    # (the most any rank receives here)
    received: list = [0] * world
    dist.all_gather_object(received, num_recv, group=group)

    def fresh_dispatch(config) -> None:
        with validation.trusted_values():
            per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
            buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                         is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                         topk_weights=topk_w, num_worst_tokens=max(received), num_max_tokens_per_rank=T,
                         config=config)

    proxy_stats = getattr(buf.backend, "proxy_stats", None)
    remote_ranks = [r for r in range(world) if topo.node_of(r) != topo.node_of(rank)]

    def proxy_totals() -> tuple[int, int]:
        s = proxy_stats()
        return sum(int(s["bytes_to"][r]) for r in remote_ranks), sum(int(c) for c in s["commands_to"])

    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    gpus = gpus_used(device, group)
    common = {"bench": "internode", "ranks": world, "ranks_per_node": L, "nodes": nodes, "device": name,
              "gpus": gpus, "group": str(dist.get_backend(group)),
              "transport": getattr(buf.backend, "proxy_transport", None), **shape}
    # kernel timing: the native kernels on GPUs (the reference backend has none of its own)
    kernel_timing = cuda and buf.backend_name == "native"
    records = []
    for sms in sms_list:
        dcfg = dataclasses.replace(Buffer.get_dispatch_config(world), num_sms=sms)
        ccfg = dataclasses.replace(Buffer.get_combine_config(world), num_sms=sms)
        runs = [("dispatch_bf16", dcfg, lambda: buf.dispatch(x, handle=handle, config=dcfg)),
                ("dispatch_fresh_bf16", dcfg, lambda: fresh_dispatch(dcfg))]
        if not args.no_fp8:
            runs.append(("dispatch_fp8", dcfg, lambda: buf.dispatch(x_fp8, handle=handle, config=dcfg)))
        runs.append(("combine", ccfg, lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=ccfg)))
        for op, cfg, fn in runs:
            us, host, delta = _time_calls(fn, args.iters, args.warmup, group, cuda,
                                          proxy_totals if proxy_stats else None)
            timed = {"api": statistics.median(us)}
            split = None
            if kernel_timing:
                split = aligned_device_us({op: fn}, {step: (kernel,) for step, kernel in _KERNELS[op]}, args.iters,
                                          args.warmup, group)
                timed["kernel"] = sum(split.values())
            rb = rdma_bytes(op, topk_idx, shape, world, L, rank)
            for timing, med in timed.items():
                api = timing == "api"
                records.append({**common, "op": op, "rank": rank, "sms": sms, "timing": timing,
                                "sms_occupied": buf.occupied_sms(cfg), "us": med, "backend": buf.backend_name,
                                "host_us": statistics.median(host) if api else None,
                                "kernel_us": None if api else split, "rdma_bytes": rb,
                                "nvl_bytes": nvl_bytes[op], "gbps": rb / med / 1e3,
                                "nvl_gbps": nvl_bytes[op] / med / 1e3,
                                "proxy_bytes": delta[0] / args.iters if delta and api else None,
                                "proxy_commands_per_s": delta[1] / (sum(us) * 1e-6) if delta and api else None})

    if not args.no_alltoall:
        if str(dist.get_backend(group)) == "gloo" and cuda:
            if rank == 0:
                print("[internode] alltoall: skipped (gloo group with CUDA tensors: ranks share GPUs)", flush=True)
        else:
            # the bytes the ranks receive in a BF16 dispatch, the same on every rank (equal splits need it)
            total = torch.tensor([nvl_bytes["dispatch_bf16"]], dtype=torch.int64, device=device)
            dist.all_reduce(total, group=group)
            dtype = torch.bfloat16 if cuda else torch.float32  # gloo: float32
            elem = torch.empty((), dtype=dtype).element_size()
            n = max(int(total.item()) // world // elem // world * world, world)
            inp = torch.randn(n, device=device).to(dtype)
            out = torch.empty_like(inp)
            nbytes = n * inp.element_size()
            remote = nbytes * (world - L) // world  # the slices bound for other nodes' ranks
            us, host, _ = _time_calls(lambda: dist.all_to_all_single(out, inp, group=group), args.iters,
                                      args.warmup, group, cuda)
            med = statistics.median(us)
            records.append({**common, "op": "alltoall", "rank": rank, "sms": 0, "timing": "api",
                            "sms_occupied": None, "us": med, "host_us": statistics.median(host), "kernel_us": None,
                            "backend": str(dist.get_backend(group)), "rdma_bytes": remote, "nvl_bytes": nbytes,
                            "gbps": remote / med / 1e3, "nvl_gbps": nbytes / med / 1e3, "proxy_bytes": None,
                            "proxy_commands_per_s": None})
    _sync(cuda)
    dist.barrier(group=group)
    buf.destroy()
    return records


def _rank(rank: int, world: int, args, shape: dict) -> list[dict]:
    device = init_rank_group()
    return on_own_stream(device, lambda: _rank_main(rank, world, args, shape, device, dist.group.WORLD))


def summarise(records: list[dict]) -> list[dict]:
    """One record per (op, SMs, timing): means over ranks, the slowest rank's GB/s, the per-rank RDMA bytes."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["op"], r["sms"], r["timing"]), []).append(r)
    order = {"dispatch_bf16": 0, "dispatch_fresh_bf16": 1, "dispatch_fp8": 2, "combine": 3, "alltoall": 4}
    out = []
    for (op, sms, timing), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] == "alltoall", kv[0][1],
                                                                         order.get(kv[0][0], 9), kv[0][2])):
        rs = sorted(rs, key=lambda r: r["rank"])
        n = len(rs)
        mean = lambda key: sum(r[key] for r in rs) / n  # noqa: E731
        base = {k: v for k, v in rs[0].items() if k != "rank"}
        base.update(us=mean("us"), us_max=max(r["us"] for r in rs), gbps=mean("gbps"),
                    gbps_min=min(r["gbps"] for r in rs), nvl_gbps=mean("nvl_gbps"),
                    nvl_gbps_min=min(r["nvl_gbps"] for r in rs), rdma_bytes=mean("rdma_bytes"),
                    rdma_bytes_per_rank=[r["rdma_bytes"] for r in rs], nvl_bytes=mean("nvl_bytes"))
        for key in ("host_us", "proxy_bytes", "proxy_commands_per_s"):
            base[key] = mean(key) if all(r[key] is not None for r in rs) else None
        if all(r["kernel_us"] is not None for r in rs):  # each step's mean over ranks
            base["kernel_us"] = {step: sum(r["kernel_us"][step] for r in rs) / n for step in rs[0]["kernel_us"]}
        out.append(base)
    return out


def sms_column(record: dict) -> str:
    """The SMs a record's call occupied per rank (`sms_occupied` total), as "requested>occupied" where the
    Buffer gave it fewer than Config.num_sms asked (ranks sharing a GPU), the requested count where it does not
    say (the reference backend, all_to_all_single)."""
    occupied = (record.get("sms_occupied") or {}).get("total")
    if occupied is None or occupied == record["sms"]:
        return str(record["sms"] if occupied is None else occupied)
    return f"{record['sms']}>{occupied}"


def _print(summary: list[dict]) -> None:
    if not summary:
        return
    s = next((r for r in summary if r["op"] != "alltoall"), summary[0])
    print(f"[internode] {s['ranks']} ranks = {s['nodes']} nodes x {s['ranks_per_node']}, {s['gpus']} GPUs "
          f"({s['device']}), {s['group']} group, backend {s['backend']}, transport {s.get('transport')}, "
          f"tokens {s['num_tokens']}, "
          f"hidden {s['hidden']}, experts {s['num_experts']}, top-{s['num_topk']}; mean over ranks (min rank)")
    print("SMs: those the call occupies per rank (Buffer.occupied_sms), after the requested count and '>' where "
          "they differ (ranks sharing a GPU share its SMs)")
    print(f"{'op':<15}{'SMs':>7}{'timing':>8}{'µs':>11}{'host µs':>9}{'RDMA GB/s':>17}{'NVL GB/s':>17}"
          f"{'proxy MB/call':>15}{'proxy Mcmd/s':>14}  kernel µs by step")
    for r in summary:
        pb = f"{r['proxy_bytes'] / 1e6:.3f}" if r["proxy_bytes"] is not None else "-"
        pc = f"{r['proxy_commands_per_s'] / 1e6:.3f}" if r["proxy_commands_per_s"] is not None else "-"
        host = f"{r['host_us']:.1f}" if r["host_us"] is not None else "-"
        steps = " ".join(f"{k} {v:.0f}" for k, v in (r.get("kernel_us") or {}).items())
        print(f"{r['op']:<15}{sms_column(r):>7}{r['timing']:>8}{r['us']:>11.1f}{host:>9}{r['gbps']:>9.4g} "
              f"({r['gbps_min']:>5.4g}){r['nvl_gbps']:>9.4g} ({r['nvl_gbps_min']:>5.4g}){pb:>15}{pc:>14}  {steps}",
              flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    shape = resolve_shape(args, cuda)
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    sms = args.sms
    if not sms or any(s <= 0 or s % 2 for s in sms):
        parser.error(f"--sms: positive even SM counts, got {args.sms!r}")
    launched = launched_world()
    world = launched or args.ranks or (max(torch.cuda.device_count(), 2) if cuda else 4)
    if world < 2:
        parser.error(f"--ranks: need at least 2 ranks, got {world}")
    if shape["num_experts"] % world:
        parser.error(f"--num-experts ({shape['num_experts']}) must be divisible by the number of ranks ({world})")
    if not 1 <= shape["num_topk"] <= shape["num_experts"] or shape["hidden"] % FP8_BLOCK or shape["num_tokens"] < 1:
        parser.error(f"layer shape: need 1 <= --num-topk <= --num-experts, --hidden a multiple of {FP8_BLOCK}, "
                     f"--num-tokens >= 1; got {shape}")
    if args.ranks_per_node is None and not launched:  # launched: nodes from LOCAL_WORLD_SIZE
        args.ranks_per_node = max(world // 2, 1)
    env = {**transport_env(args), **ranks_env(args.ranks_per_node, world)}
    context = run_context("bench internode", argv)
    if cuda:
        warn_without_mps(world, "internode")
    records = rank_records(_rank, world, args, shape, env=env)
    if records is None:  # a launched rank other than 0
        return 0
    publish(summarise(records), context, _print, args.json, "internode")
    return 0


if __name__ == "__main__":
    sys.exit(main())
