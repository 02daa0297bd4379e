"""`uccl-ep-train bench low-latency`: DeepEP's low-latency dispatch / combine, native kernels vs the reference.

Per rank, as DeepEP's test_low_latency times them: `--num-tokens` tokens (default 128) of hidden 7168, top-8
of 256 experts; BF16 and FP8 dispatch, BF16 combine. µs per call = median over `--iters` (after `--warmup`)
of CUDA events around the call (timing "api": host work included); with the recv hook, the send call and the
hook are timed apart ("send" / "recv"). The native kernels are also timed as DeepEP's test_low_latency.py
times them for its published figures (timing "kernel": the mean device time of the call's kernels from the
profiler, every round started on all ranks' GPUs together; with the hook, a GPU wait stands for the GEMM
DeepEP runs before calling it, so the receive phase finds its data there). Ranks form nodes of
`--ranks-per-node` consecutive ranks (UCCL_EP_RANKS_PER_NODE): ranks of other nodes are reached through the
CPU proxies (the ipc transport when one host plays several nodes; `--transport fabric` with FI_PROVIDER=shm
for libfabric's, every call then from a stream of the rank's own: `on_own_stream`), node peers over NVLink/IPC. More ranks than
GPUs share them under MPS (gloo group with CUDA tensors). The reference backend (torch.distributed, a host sync per call) runs the same calls
in the same ranks (op prefix "reference"), unless `--no-reference`.

`--json PATH` writes one record per (backend, op, mode), means over ranks (and the slowest rank), with the
run's command, date, commit, device and GPU count; `host_us` is the median host time of the call (the events
measure the host instead of the GPU when the host is slower).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from . import (add_ranks_arg, add_transport_arg, gpus_used, init_rank_group, on_own_stream, publish, rank_records,
               run_context, transport_env, warn_without_mps)
from ..launch import check_ranks_per_node, launched_world

SHAPE = {"num_tokens": 128, "hidden": 7168, "num_experts": 256, "num_topk": 8}  # DeepEP's LL test shape
SEED = 4321


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="uccl-ep-train bench low-latency", description=__doc__.split("\n")[0])
    add_ranks_arg(p, "visible GPUs, at least 2")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per (emulated) node, sets UCCL_EP_RANKS_PER_NODE (default: all ranks on one node)")
    add_transport_arg(p)
    for name, default in SHAPE.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=default)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-reference", action="store_true", help="time the native kernels only")
    p.add_argument("--json", default=None, metavar="PATH", help="write the records here")
    return p


def _time(pieces: dict, iters: int, warmup: int, group) -> dict:
    """Per piece of a round (run in order, every iteration: sends and receives must pair up): the median µs
    between the CUDA events recorded around it, and the median host µs of its call (`<piece>_host`): when
    the host takes longer than the GPU, the events measure the host."""
    names = list(pieces)
    for _ in range(warmup):
        for fn in pieces.values():
            fn()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    marks = [[torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)] for _ in range(iters)]
    host = [[0.0] * len(names) for _ in range(iters)]
    stream = torch.cuda.current_stream()  # named once: looking it up costs several µs of host time per record
    for ev, spent in zip(marks, host):
        ev[0].record(stream)
        for i, name in enumerate(names):
            t0 = time.perf_counter()
            pieces[name]()
            spent[i] = (time.perf_counter() - t0) * 1e6
            ev[i + 1].record(stream)
    torch.cuda.synchronize()
    out = {name: statistics.median(ev[i].elapsed_time(ev[i + 1]) * 1e3 for ev in marks)
           for i, name in enumerate(names)}
    out.update({f"{name}_host": statistics.median(spent[i] for spent in host) for i, name in enumerate(names)})
    return out


_GEMM_CYCLES = 500_000  # ~0.25 ms of GPU wait before a recv hook: the transfer lands first, as behind DeepEP's GEMM


def _kernel_time(pieces: dict, iters: int, warmup: int, group) -> dict:
    """Per piece, the mean device µs of its native kernel launch (`dispatch` -> dispatch_kernel, both phases;
    with the hook `dispatch_send` -> the first dispatch_kernel of a round, `dispatch_recv` -> the second, the
    same for combine), over rounds that start on every rank's GPU at once (aligned_device_us); a recv hook
    runs behind a GPU wait standing for the GEMM."""
    from . import aligned_device_us

    def gemm(name: str) -> None:
        if name.endswith("_recv"):
            torch.cuda._sleep(_GEMM_CYCLES)

    kernels = {name: (f"{name.split('_')[0]}_kernel",) for name in pieces}
    every = {name: (int(name.endswith("_recv")), 2) for name in pieces if name.endswith(("_send", "_recv"))}
    return aligned_device_us(pieces, kernels, iters, warmup, group, every, before=gemm)


def _round(buf, x, idx, w, shape: dict, use_fp8: bool, hook: bool) -> dict:
    """One dispatch + combine round as timed pieces: {dispatch, combine}, or with the recv hook
    {dispatch_send, dispatch_recv, combine_send, combine_recv}."""
    M, E = shape["num_tokens"], shape["num_experts"]
    state: dict = {}

    def dispatch_send():
        recv, _, handle, _, hook_fn = buf.low_latency_dispatch(x, idx, M, E, use_fp8=use_fp8, return_recv_hook=hook)
        data = recv[0] if use_fp8 else recv
        if "y" not in state:
            state["y"] = torch.zeros(data.shape, dtype=torch.bfloat16, device=data.device)
        state.update(handle=handle, hook=hook_fn)

    def combine_send():
        _, _, hook_fn = buf.low_latency_combine(state["y"], idx, w, state["handle"], return_recv_hook=hook)
        state["chook"] = hook_fn

    if not hook:
        return {"dispatch": dispatch_send, "combine": combine_send}
    return {"dispatch_send": dispatch_send, "dispatch_recv": lambda: state["hook"](),
            "combine_send": combine_send, "combine_recv": lambda: state["chook"]()}


def _rank_main(rank: int, world: int, args, device: torch.device, group) -> list[dict]:
    from uccl_ep_train import Buffer

    shape = {k: getattr(args, k) for k in SHAPE}
    g = torch.Generator().manual_seed(SEED + rank)
    T, H, E, K = shape["num_tokens"], shape["hidden"], shape["num_experts"], shape["num_topk"]
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
    w = torch.rand(T, K, generator=g).to(device)
    hint = Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    gpus = gpus_used(device, group)
    records = []
    for backend in ["native"] + ([] if args.no_reference else ["reference"]):
        os.environ["UCCL_EP_BACKEND"] = "auto" if backend == "native" else "reference"
        buf = Buffer(group, 0, hint, low_latency_mode=True, num_qps_per_rank=E // world)
        served = type(buf.low_latency_backend).__name__
        native = served == "NativeLowLatencyBackend"  # (the kernel timing names its kernels)
        common = {"rank": rank, "backend": backend, "served_by": served, "ranks": world,
                  "ranks_per_node": int(os.environ["UCCL_EP_RANKS_PER_NODE"]), "gpus": gpus,
                  "device": torch.cuda.get_device_name(device), "group": dist.get_backend(group),
                  "transport": getattr(buf.low_latency_backend, "proxy_transport", None), **shape}
        for use_fp8 in (False, True):
            for hook in (False, True):
                pieces = _round(buf, x, idx, w, shape, use_fp8, hook)
                timed = _time(pieces, args.iters, args.warmup, group)
                kernel = _kernel_time(pieces, args.iters, args.warmup, group) if native else {}
                for op in pieces:
                    if op.startswith("combine") and use_fp8:
                        continue  # combine is BF16 either way: recorded once, after the BF16 dispatch
                    name = op if op.startswith("combine") else f"{op}_{'fp8' if use_fp8 else 'bf16'}"
                    records.append({**common, "op": name, "hook": hook, "timing": "api", "us": timed[op],
                                    "host_us": timed[f"{op}_host"]})
                    if op in kernel:
                        records.append({**common, "op": name, "hook": hook, "timing": "kernel", "us": kernel[op]})
        torch.cuda.synchronize()
        dist.barrier(group=group)
        buf.destroy()
    return records


def _rank(rank: int, world: int, args) -> list[dict]:
    device = init_rank_group()
    return on_own_stream(device, lambda: _rank_main(rank, world, args, device, dist.group.WORLD))


def summarise(records: list[dict]) -> list[dict]:
    groups: dict = {}
    for r in records:
        groups.setdefault((r["backend"], r["op"], r["hook"], r["timing"]), []).append(r)
    out = []
    for _, rs in groups.items():
        base = {k: v for k, v in rs[0].items() if k != "rank"}
        base.update(us=sum(r["us"] for r in rs) / len(rs), us_max=max(r["us"] for r in rs))
        if "host_us" in base:
            base["host_us"] = sum(r["host_us"] for r in rs) / len(rs)
        out.append(base)
    return out


def _print(summary: list[dict]) -> None:
    if not summary:
        return
    s = summary[0]
    print(f"[low-latency] {s['ranks']} ranks, {s['ranks_per_node']} per node, {s['gpus']} GPUs ({s['device']}), "
          f"{s['num_tokens']} tokens x hidden {s['hidden']}, top-{s['num_topk']} of {s['num_experts']} experts; "
          f"µs per call, mean over ranks (slowest rank), host µs of the call (api timing)")
    for r in summary:
        host = f"{r['host_us']:>10.1f}" if "host_us" in r else ""
        print(f"{r['backend']:<10}{r['op']:<20}{'hook' if r['hook'] else '':<6}{r['timing']:<8}"
              f"{r['us']:>10.1f} ({r['us_max']:.1f}){host}", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("bench low-latency needs CUDA/HIP GPUs (the LL kernels; the reference runs beside them)")
    world = launched_world() or args.ranks or max(torch.cuda.device_count(), 2)
    if world < 2 or args.num_experts % world:
        parser.error(f"--ranks: at least 2, dividing --num-experts ({args.num_experts}); got {world}")
    if args.hidden % 512 or args.iters < 1 or args.warmup < 0:
        parser.error("--hidden must be a multiple of 512, --iters >= 1, --warmup >= 0")
    args.ranks_per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_ranks_per_node(args.ranks_per_node, world)
    context = run_context("bench low-latency", argv)
    warn_without_mps(world, "low-latency")
    records = rank_records(_rank, world, args, env=dict(transport_env(args),
                                                         UCCL_EP_RANKS_PER_NODE=str(args.ranks_per_node)))
    if records is None:  # a launched rank other than 0
        return 0
    publish(summarise(records), context, _print, args.json, "low-latency")
    return 0


if __name__ == "__main__":
    sys.exit(main())
