"""`uccl-ep-train bench expert-major`: expert-major dispatch/combine, fused vs separate permute kernels.

Per op, on the native backend over all visible GPUs (or `--num-processes`), mean µs per call (max over
ranks, CUDA events around `--iters` back-to-back calls, as the Megatron dispatcher issues them):
- fresh: `Buffer.dispatch_expert_major` (layout, notify, host sync, then the dispatch kernel straight into
  expert-major rows when fused) against `dispatch` + `permute.expert_major_map` + `expand_rows`;
- cached: `dispatch_expert_major_cached` with the copy-out expanding in the kernel (fused) and through the
  separate expand kernel;
- combine: `combine_expert_major` with the fold inside combine's push (fused) and through `reduce_rows`
  first (separate).
"side_blocks": the expansion / fold on blocks beside the kernel's SMs in the same launch (expand / fold
blocks). Each column's calls pass the Buffer's default Config with its knobs (fuse_max_width, expand_blocks,
fold_blocks); the "auto" column leaves them None: what the backend picks (backends/native.py). Every fused /
side-block result is first checked bit-exact against the separate path. JSON records with `--json PATH`
(timing "api"; the run's command, date, commit, device and GPU count; "sms_occupied": Buffer.occupied_sms of
the op's default Config at that SM count, i.e. the "auto" column's call: the separate path's kernels add no
side blocks).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import add_layer_shape_args, add_ranks_arg, gpus_used, init_rank_group, int_list, run_context
from ..launch import launched_world, run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="uccl-ep-train bench expert-major", description=__doc__.split("\n")[0])
    add_ranks_arg(p, "visible GPUs")
    add_layer_shape_args(p)
    p.add_argument("--sms", type=int_list, default="20,32", help="comma-separated SM counts")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None)
    return p


def _timer(iters: int) -> Callable[[Callable[[], object]], float]:
    """µs per call of back-to-back calls (intranode's API timing), the max over ranks."""
    from .intranode import _api_us

    def timeit(fn: Callable[[], object]) -> float:
        t = torch.tensor(_api_us(fn, iters, 3, dist.group.WORLD), device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()
    return timeit


# Config knobs per column (on top of the Buffer's default Config at the swept SM count)
FUSED = {"fuse_max_width": math.inf}
SEPARATE = {"fuse_max_width": 0, "fold_blocks": 0, "expand_blocks": 0}
SIDE_BLOCKS = {"fuse_max_width": 0}  # the default expand / fold blocks (the SMs left free)
AUTO: dict = {}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _rank(rank: int, world: int, args, out_path: Optional[str], context: dict) -> None:
    os.environ.update(UCCL_EP_BACKEND="native", UCCL_EP_CHECK_VALUES="0")
    gpu = init_rank_group()
    from uccl_ep_train import Buffer, Config, permute

    T, H, E, K = args.num_tokens, args.hidden, args.num_experts, args.num_topk
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices.cuda()
    w = torch.rand(T, K, generator=g).cuda()
    x = torch.randn(T, H, generator=g).bfloat16().cuda()
    buf = Buffer(dist.group.WORLD, int(1e9), 0)
    device, gpus = torch.cuda.get_device_name(), gpus_used(gpu)

    def separate_fresh():
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        recv_x, recv_idx, _, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w)
        em = permute.expert_major_map(recv_idx, counts)
        return permute.expand_rows_raw(recv_x, em, sum(counts)), em, handle, recv_x.size(0)

    def dispatch_config(knobs: dict) -> Config:  # (read at the call: Buffer.num_sms changes per SM count)
        return replace(Buffer.get_dispatch_config(world), **knobs)

    def fresh(knobs: dict):
        x_em, _, _, _, em, handle, _ = buf.dispatch_expert_major(x, idx, w, E, config=dispatch_config(knobs))
        return x_em, em, handle

    ref_em, ref_map, _, num_recv = separate_fresh()
    x_em, em, handle = fresh(FUSED)
    rows = x_em.size(0)
    y_em = torch.randn(rows, H, generator=g).bfloat16().cuda()

    def cached(knobs: dict) -> torch.Tensor:
        return buf.dispatch_expert_major_cached(x, handle, em, rows, config=dispatch_config(knobs))[0]

    def combine(knobs: dict) -> torch.Tensor:
        cfg = replace(Buffer.get_combine_config(world), **knobs)
        return buf.combine_expert_major(y_em, handle, em, config=cfg)[0]

    side_em, side_map, _ = fresh(SIDE_BLOCKS)
    exact = {"fresh": _bits_equal(x_em, ref_em) and torch.equal(em, ref_map),
             "fresh_side_blocks": _bits_equal(side_em, ref_em) and torch.equal(side_map, ref_map),
             "cached": _bits_equal(cached(FUSED), cached(SEPARATE)),
             "cached_side_blocks": _bits_equal(cached(SIDE_BLOCKS), cached(SEPARATE)),
             "combine": _bits_equal(combine(FUSED), combine(SEPARATE)),
             "combine_side_blocks": _bits_equal(combine(SIDE_BLOCKS), combine(SEPARATE))}
    if not all(exact.values()):
        raise RuntimeError(f"rank {rank}: fused expert-major results differ from the separate path: {exact}")

    timeit = _timer(args.iters)
    records = []
    for sms in args.sms:
        Buffer.set_num_sms(sms)
        ops = {op: {"separate": timeit(separate_fresh if op == "fresh" else partial(fn, SEPARATE)),
                    "fused": timeit(partial(fn, FUSED)), "side_blocks": timeit(partial(fn, SIDE_BLOCKS)),
                    "auto": timeit(partial(fn, AUTO))}
               for op, fn in (("fresh", fresh), ("cached", cached), ("combine", combine))}
        for op, t in ops.items():
            # the "auto" column's Config: the Buffer's defaults at Buffer.num_sms = sms
            cfg = (Buffer.get_combine_config if op == "combine" else Buffer.get_dispatch_config)(world)
            rec = {"bench": "expert_major", "op": op, "ranks": world, "sms": sms,
                   "sms_occupied": buf.occupied_sms(cfg, expert_major=True), "num_tokens": T, "hidden": H, "num_experts": E,
                   "num_topk": K, "fold_width": rows / max(num_recv, 1), "device": device, "gpus": gpus,
                   "timing": "api", **{f"{k}_us": v for k, v in t.items()}, **context}
            records.append(rec)
            if rank == 0:
                print(f"[expert-major] {op:<8} EP={world} sms={sms} width={rec['fold_width']:.2f}: "
                      + "  ".join(f"{k} {v:.0f} us" for k, v in t.items()), flush=True)
    if rank == 0 and out_path:
        with open(out_path, "w") as f:
            json.dump(records, f, indent=1)
    buf.destroy()


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA/HIP GPUs (the native backend)")
    world = launched_world() or args.ranks or torch.cuda.device_count()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # one rank per GPU (NCCL)
    if world < 2 or local > torch.cuda.device_count():
        parser.error(f"--num-processes: need 2..{torch.cuda.device_count()} GPUs, got {world}")
    context = run_context("bench expert-major", argv)
    run(_rank, world, args, args.json, context, timeout=1800)
    return 0


if __name__ == "__main__":
    sys.exit(main())
