"""`uccl-ep-train bench intranode`: high-throughput dispatch/combine on the GPUs of one node.

DeepEP's conventions, so lines compare with its tests/test_intranode.py: per-rank "NVL GB/s" = bytes
this rank receives (its own tokens included) over the kernel time, and µs per call. Kernel time is read
from the profiler (kernels whose names contain `dispatch` / `combine`), as DeepEP's bench_kineto does;
the time the Python API takes (events around the Buffer call, host work included) is printed beside it.
Timed like DeepEP's tuning: cached-handle dispatch (BF16 and FP8 + scales) and combine (BF16) per SM
count, then the fresh dispatch (layout, notify, dispatch) twice: sized by the host (one host sync for the
receive size) and sync-free with num_worst_tokens = ranks x tokens ("_worst"). NCCL all_to_all_single
moving the same bytes is the yardstick (one rank per GPU only).

Every "api" record also carries, for the same call, "kernel_us" (the device time of the call's own kernels:
layout, notify, dispatch / combine, from the profiler) and "host_us" (the host's time per call when calls
are issued back to back without a sync): a sync-free call's API time approaches its kernel time because the
host runs ahead of the GPU; a call that syncs adds the host's time to it.

Runs its own ranks (spawned; one per GPU, or `--num-processes` more sharing the GPUs under MPS over a gloo
group) unless started by torchrun. Writes `--json PATH` (records: bench, op, ranks, gbps, us, device, gpus,
sms, sms_occupied, tokens, hidden, topk, experts, backend, timing, kernel_us, host_us, command, date,
commit) and `--plot PATH.png` (GB/s against SMs). "timing" is "kernel" for the profiler's kernel time, "api"
for events around the call; "sms_occupied" is Buffer.occupied_sms of the timed call's Config (None for the
reference backend and NCCL): the plain dispatch / combine timed here add no side blocks.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from . import (add_layer_shape_args, add_ranks_arg, device_us, gpus_used, init_rank_group, int_list, publish,
               rank_records, run_context, warn_without_mps)
from ..launch import launched_world

FP8_BLOCK = 128


def _parse(argv):
    p = argparse.ArgumentParser(prog="uccl-ep-train bench intranode", description=__doc__.splitlines()[0])
    add_ranks_arg(p, "all visible GPUs; more share the GPUs, under NVIDIA MPS")
    add_layer_shape_args(p)
    p.add_argument("--sms", type=int_list, default="8,16,24", help="comma-separated SM counts to sweep")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--backend", default="native", choices=("native", "reference"))
    p.add_argument("--num-nvl-bytes", type=float, default=0, help="NVLink buffer bytes (default: what the shape needs)")
    p.add_argument("--no-nccl", action="store_true", help="skip the NCCL all_to_all_single comparison")
    p.add_argument("--no-fp8", action="store_true")
    p.add_argument("--push-warps", type=int_list, default="",
                   help="comma-separated push-warp counts (of 16 per block) to sweep for the native kernels "
                        "(Config.dispatch_push_warps and combine_push_warps)")
    p.add_argument("--flag-batch", type=int_list, default="",
                   help="comma-separated rows-per-fence values to sweep (Config.flag_batch and combine_flag_batch)")
    p.add_argument("--combine-kernel", type=int_list, default="",
                   help="comma-separated combine kernel variants to sweep (Config.combine_kernel: 1, 2)")
    p.add_argument("--no-api", action="store_true", help="kernel times only (faster sweeps)")
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--plot", default=None, help="draw GB/s vs SMs into this PNG (needs matplotlib)")
    return p.parse_args(argv)


def _align(group):
    """Start timed loops together: a rank that starts late shows up as the peer's waiting time."""
    torch.cuda.synchronize()
    dist.barrier(group=group)
    torch.cuda.synchronize()


def _kernel_us(fn, names, iters, warmup, group):
    """Mean device time per call of kernels whose name contains one of `names` (µs)."""
    for _ in range(warmup):
        fn()
    _align(group)
    return device_us(fn, {"call": names}, iters)["call"]


def _api_us(fn, iters, warmup, group):
    """(µs per call between events around `iters` back-to-back calls, µs of host time per call)."""
    for _ in range(warmup):
        fn()
    _align(group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    host = (time.perf_counter() - t0) * 1e6 / iters
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters, host


def _rank_main(rank: int, world: int, args) -> list[dict]:
    from uccl_ep_train import Buffer, Config
    from uccl_ep_train.fp8 import fp8_dtype_for, per_token_cast_to_fp8

    os.environ["UCCL_EP_BACKEND"] = args.backend
    group = dist.new_group(list(range(world)))
    dev = torch.device("cuda", torch.cuda.current_device())
    T, H, K, E = args.num_tokens, args.hidden, args.num_topk, args.num_experts
    g = torch.Generator(device=dev).manual_seed(1234 + rank)
    x = torch.randn((T, H), device=dev, generator=g).to(torch.bfloat16)
    scores = torch.randn((T, E), device=dev, generator=g).abs() + 1
    topk_idx = torch.topk(scores, K, dim=-1, largest=True, sorted=False).indices.to(torch.int64)
    topk_w = torch.rand((T, K), device=dev, generator=g)
    x_fp8 = per_token_cast_to_fp8(x, dtype=fp8_dtype_for(dev))

    nvl = int(args.num_nvl_bytes) or (world * T * (H * 2 + K * 12 + H // FP8_BLOCK * 4 + 4) + (64 << 20))
    buf = Buffer(group, nvl, 0)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
    cfg0 = Config(24, 6, 256)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                   num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                   topk_weights=topk_w, config=cfg0)
    num_recv = recv_x.size(0)
    bf16_bytes = num_recv * H * 2
    fp8_bytes = num_recv * (H + H // FP8_BLOCK * 4)
    name = torch.cuda.get_device_name(dev)
    gpus = gpus_used(dev, group)
    shape = {"tokens": T, "hidden": H, "topk": K, "experts": E}
    records = []

    def rec(op, us, nbytes, sms, timing, knobs=None, cfg=None, **times):
        records.append({"bench": "intranode", "op": op, "ranks": world, "rank": rank, "gbps": nbytes / us / 1e3,
                        "us": us, "bytes": nbytes, "device": name, "gpus": gpus, "sms": sms,
                        "sms_occupied": buf.occupied_sms(cfg) if cfg is not None else None,
                        "backend": buf.backend_name, "timing": timing, "push_warps": 0, "flag_batch": 0,
                        "combine_kernel": -1, **(knobs or {}), **shape, **times})

    _kernel_us(lambda: buf.dispatch(x, handle=handle, config=cfg0), ("dispatch",), 1, 1, group)  # profiler warm-up
    # records name the defaults 0 (push warps, flag batch) and -1 (combine kernel)
    sweep = [(sms, pw, fb, ck) for sms in args.sms for pw in (args.push_warps or [0])
             for fb in (args.flag_batch or [0]) for ck in (args.combine_kernel or [-1])]
    for sms, pw, fb, ck in sweep:
        knobs = {"push_warps": pw, "flag_batch": fb, "combine_kernel": ck}
        cfg = Config(sms, 6, 256, dispatch_push_warps=pw or None, combine_push_warps=pw or None,
                     flag_batch=fb or None, combine_flag_batch=fb or None, combine_kernel=None if ck < 0 else ck)
        d_bf16 = lambda: buf.dispatch(x, handle=handle, config=cfg)  # noqa: E731
        d_fp8 = lambda: buf.dispatch(x_fp8, handle=handle, config=cfg)  # noqa: E731
        comb = lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=cfg)  # noqa: E731

        def fresh(worst=0):  # the whole fresh call, layout included, as a training step makes it
            pr, _, pe, ir, _ = buf.get_dispatch_layout(topk_idx, E)
            return buf.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe,
                                topk_idx=topk_idx, topk_weights=topk_w, num_worst_tokens=worst, config=cfg)

        runs = [("dispatch_bf16", d_bf16, bf16_bytes, ("dispatch",), args.iters)]
        if not args.no_fp8:
            runs.append(("dispatch_fp8", d_fp8, fp8_bytes, ("dispatch",), args.iters))
        runs.append(("combine", comb, bf16_bytes, ("combine",), args.iters))
        if not args.no_api:
            fresh_names = ("dispatch", "notify")  # (the layout kernel's name contains "dispatch")
            runs += [("dispatch_bf16_fresh", fresh, bf16_bytes, fresh_names, max(args.iters // 2, 3)),
                     ("dispatch_bf16_fresh_worst", lambda: fresh(world * T), bf16_bytes, fresh_names, args.iters)]
        for op, fn, nbytes, names, iters in runs:
            kernel = None
            if buf.backend_name == "native":
                kernel = _kernel_us(fn, names, iters, args.warmup, group)
                rec(op, kernel, nbytes, sms, "kernel", knobs, cfg)
            if not args.no_api:
                api, host = _api_us(fn, iters, args.warmup, group)
                rec(op, api, nbytes, sms, "api", knobs, cfg, kernel_us=kernel, host_us=host)

    if not args.no_nccl and str(dist.get_backend(group)) == "nccl":  # (ranks sharing a GPU: a gloo group)
        # the same bytes through NCCL: every rank sends num_recv rows' worth, split evenly over ranks
        n = (bf16_bytes // 2) // world * world
        inp = torch.randn(n, device=dev).to(torch.bfloat16)
        out = torch.empty_like(inp)
        a2a = lambda: dist.all_to_all_single(out, inp, group=group)  # noqa: E731
        api, host = _api_us(a2a, args.iters, args.warmup, group)
        rec("nccl_all_to_all", api, n * 2, 0, "api", host_us=host)
    buf.destroy()
    return records


def _rank(rank: int, world: int, args) -> list[dict]:
    init_rank_group()
    return _rank_main(rank, world, args)


def _summarise(records: list[dict]) -> list[dict]:
    """Mean over ranks per (op, sms, timing); also keeps the slowest rank's GB/s."""
    keys = {}
    for r in records:
        keys.setdefault((r["op"], r["timing"], r["sms"], r.get("push_warps", 0), r.get("flag_batch", 0),
                         r.get("combine_kernel", -1)), []).append(r)
    out = []
    for _, rs in sorted(keys.items()):
        base = {k: v for k, v in rs[0].items() if k not in ("rank", "gbps", "us", "bytes")}
        base.update(gbps=sum(r["gbps"] for r in rs) / len(rs), gbps_min=min(r["gbps"] for r in rs),
                    us=sum(r["us"] for r in rs) / len(rs), bytes=sum(r["bytes"] for r in rs) // len(rs))
        for key in ("kernel_us", "host_us"):  # api records: the same call's kernel and host time
            if all(r.get(key) is not None for r in rs):
                base[key] = sum(r[key] for r in rs) / len(rs)
        out.append(base)
    return out


def _print(summary: list[dict]) -> None:
    print(f"{'op':<26}{'timing':<8}{'SMs':>5}{'push':>5}{'fb':>8}{'ck':>4}{'µs':>10}{'NVL GB/s':>10}{'min rank':>10}"
          f"{'kernel µs':>11}{'host µs':>9}{'api/kernel':>11}")
    for r in summary:
        k, h = r.get("kernel_us"), r.get("host_us")
        extra = (f"{k:>11.1f}" if k else f"{'':>11}") + (f"{h:>9.1f}" if h else f"{'':>9}")
        extra += f"{r['us'] / k:>11.2f}" if k and r["timing"] == "api" else ""
        print(f"{r['op']:<26}{r['timing']:<8}{r['sms']:>5}{r.get('push_warps', 0):>5}{r.get('flag_batch', 0):>8}"
              f"{r.get('combine_kernel', -1):>4}{r['us']:>10.1f}{r['gbps']:>10.1f}{r['gbps_min']:>10.1f}{extra}")


def _plot(summary: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install 'uccl-ep-train[plot]'); skipped", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in ("dispatch_bf16", "dispatch_fp8", "combine"):
        pts = [(r["sms"], r["gbps"]) for r in summary if r["op"] == op and r["timing"] == "kernel"]
        if pts:
            ax.plot(*zip(*sorted(pts)), marker="o", label=f"{op} (kernel)")
    for r in summary:
        if r["op"] == "nccl_all_to_all":
            ax.axhline(r["gbps"], linestyle="--", color="gray", label="NCCL all_to_all_single")
    if summary:
        s = summary[0]
        ax.set_title(f"intranode, {s['ranks']}x {s['device']}, {s['tokens']} tok/rank, hidden {s['hidden']}, "
                     f"top-{s['topk']}, {s['experts']} experts", fontsize=9)
    ax.set_xlabel("SMs")
    ax.set_ylabel("NVL GB/s per rank (DeepEP convention)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("bench intranode: needs CUDA/HIP GPUs", file=sys.stderr)
        return 2
    context = run_context("bench intranode", argv)  # the code and command that run, before they run
    world = launched_world() or args.ranks or torch.cuda.device_count()
    warn_without_mps(world, "intranode")
    records = rank_records(_rank, world, args)
    if records is None:  # a launched rank other than 0
        return 0
    summary = publish(_summarise(records), context, _print, args.json, "intranode")
    if args.plot:
        _plot(summary, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
