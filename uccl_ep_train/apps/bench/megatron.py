"""`uccl-ep-train bench megatron`: the MoE dispatcher round trip as Megatron drives it.

dispatch_preprocess -> token_dispatch -> dispatch_postprocess -> identity experts (y = x * prob) ->
combine_preprocess -> token_combine -> combine_postprocess, forward + backward, for the `uccl`, `alltoall`
and `flex` (DeepEP backend, when `deep_ep` imports — e.g. ours through `uccl-ep-train deep-ep-path`;
`flex-hybridep` / `flex-ncclep` pick Megatron's other flex backends when their packages import) dispatchers,
with the same routing and, with `--num-sms`, the same SM count. Default shape: DeepSeek-V3 layer (4096
tokens/rank, hidden 7168, 256 experts, top-8, bf16 on GPUs). Reported: mean ms per round trip over `--iters` after `--warmup`, the
max over ranks, and the identity experts' own fwd+bwd time on the same rows (timed alone) so the
dispatcher's share can be read off; JSON records with `--json PATH` (timing "api": the host's clock around
the round trip and a device sync; the run's command, date, commit, device and GPU count; for `uccl`,
"sms_occupied": Buffer.occupied_sms of the dispatcher's Buffer at its default Config, None on the
reference backend).

On GPUs every record also carries, per round trip issued back to back without a sync, "api_us" (events
around them), "kernel_us" (the device time of all its kernels, from the profiler) and "host_us" (the host's
time to issue it): a round trip without a host sync has api_us near kernel_us, one that waits for counts adds
the host's time. `--moe-expert-capacity-factor` (token dropping) and `--moe-pad-expert-input-to-capacity`
(drop-and-pad: the uccl dispatcher's sync-free path) route as Megatron's router does with those settings.
More ranks than GPUs: they share the GPUs over a gloo group (run NVIDIA MPS); only `uccl` runs then (the
other dispatchers need NCCL, which refuses two ranks on one GPU).

A dispatcher that cannot start here (its package does not import, NCCL is out) is skipped, saying why and
what would make it run (flex's DeepEP backend: ours, `export PYTHONPATH=$(uccl-ep-train deep-ep-path):$PYTHONPATH`),
on stdout and in every record ("skipped": {dispatcher: reason}); `uccl` itself never is.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from . import (add_layer_shape_args, add_ranks_arg, add_ranks_per_node_arg, gpus_used, init_rank_group, ranks_env,
               run_context, warn_without_mps)
from ..launch import launched_world, run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="uccl-ep-train bench megatron", description=__doc__.split("\n")[0])
    add_ranks_arg(p, "visible GPUs, or 2 on CPU")
    add_ranks_per_node_arg(p, "every rank on one node, or the launcher's")
    add_layer_shape_args(p)
    p.add_argument("--dispatchers", default="uccl,alltoall,flex",
                   help="comma-separated: uccl, alltoall, flex (= flex-deepep), flex-hybridep, flex-ncclep")
    p.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="Megatron's token dropping: each expert takes at most this factor of its fair share")
    p.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="with --moe-expert-capacity-factor: Megatron's drop-and-pad (uccl: no host sync)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sms", "--num-sms", dest="num_sms", type=int, default=None,
                   help="SMs of the uccl kernels (--uccl-ep-num-sms; default: the dispatcher's, 32) and of the flex "
                        "backends (moe_flex_dispatcher_num_sms; default: each backend's own)")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile 3 round trips per dispatcher on rank 0 and print where the time goes")
    p.add_argument("--trace", default=None, help="with --profile: write each rank's Chrome trace to TRACE.<dispatcher>.rank<r>.json")
    p.add_argument("--breakdown", action="store_true",
                   help="GPUs: also time each phase of the round trip (CUDA events between phases, and the host's "
                        "time to issue each phase; max over ranks)")
    return p


def _make_dispatcher(kind: str, num_experts: int, topk: int, hidden: int, world: int, dtype,
                     num_sms: Optional[int], capacity_factor: Optional[float], pad: bool):
    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher, MoEFlexTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patch.dispatcher import UCCLTokenDispatcher

    kind, _, flex_backend = kind.partition("-")
    if flex_backend and kind != "flex":
        raise ValueError(f"--dispatchers: only flex takes a backend suffix, got {kind}-{flex_backend}")
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=8, num_moe_experts=num_experts,
                            moe_router_topk=topk, moe_token_dispatcher_type=kind,
                            moe_flex_dispatcher_backend=flex_backend or "deepep", moe_flex_dispatcher_num_sms=num_sms,
                            expert_model_parallel_size=world,
                            moe_router_dtype="fp32", bf16=dtype == torch.bfloat16, params_dtype=dtype,
                            add_bias_linear=False, use_cpu_initialization=True,
                            moe_expert_capacity_factor=capacity_factor, moe_pad_expert_input_to_capacity=pad)
    pg = get_default_pg_collection()
    local = num_experts // world
    rank = dist.get_rank()
    cls = {"uccl": UCCLTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher, "flex": MoEFlexTokenDispatcher}[kind]
    return cls(local, list(range(rank * local, (rank + 1) * local)), config=cfg, pg_collection=pg)


# Megatron's flex dispatcher's DeepEP backend imports `deep_ep`; ours answers it once on PYTHONPATH
DEEP_EP_HINT = "flex needs `deep_ep` importable: ours is `export PYTHONPATH=$(uccl-ep-train deep-ep-path):$PYTHONPATH`"


def skip_reason(kind: str, exc: BaseException) -> str:
    """Why dispatcher `kind` could not start here, as the bench prints and records it: the error, and for flex
    over DeepEP (`flex`, `flex-deepep`) failing to import, how to get a `deep_ep` (ours, DEEP_EP_HINT)."""
    reason = f"{type(exc).__name__}: {exc}"
    if kind in ("flex", "flex-deepep") and isinstance(exc, ImportError):
        reason += f" ({DEEP_EP_HINT})"
    return reason


PHASES = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "experts", "combine_preprocess",
          "token_combine", "combine_postprocess", "backward")


def round_trip(disp, hidden: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor, grad: torch.Tensor,
               mark=None) -> int:
    """One forward + backward through `disp` with identity experts; returns the expert-major row count.
    `mark()`, when given, is called before the first phase and after each of PHASES (e.g. to record CUDA events:
    the GPU time between two marks includes the GPU idling while the host catches up)."""
    mark = mark or (lambda: None)
    mark()
    h, p = disp.dispatch_preprocess(hidden, routing_map, probs)
    mark()
    h, p = disp.token_dispatch(h, p)
    mark()
    h, _, p = disp.dispatch_postprocess(h, p)
    mark()
    y = identity_experts(h, p)
    mark()
    y = disp.combine_preprocess(y)
    mark()
    y = disp.token_combine(y)
    mark()
    out = disp.combine_postprocess(y)
    mark()
    out.backward(grad)
    mark()
    return h.size(0)


def identity_experts(h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return h * p.unsqueeze(-1).to(h.dtype)


def _time_experts(rows: int, hidden: int, dtype, device, warmup: int, iters: int) -> float:
    """Seconds per fwd+bwd of the identity experts alone on `rows` expert-major rows (part of every
    dispatcher's round trip, reported so the dispatcher's own share can be read off)."""
    h = torch.randn(rows, hidden, device=device).to(dtype).requires_grad_(True)
    p = torch.rand(rows, device=device, requires_grad=True)
    g = torch.randn(rows, hidden, device=device).to(dtype)
    times = []
    for i in range(warmup + iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        identity_experts(h, p).backward(g)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return sum(times) / len(times)


def _back_to_back(disp, x, routing_map, probs_full, grad, iters: int, warmup: int) -> tuple[float, float, float]:
    """(api, kernel, host) µs per round trip issued `iters` times without a sync between them: events around
    them and the host's clock (bench intranode's API timing), the profiler's device time of every kernel."""
    from torch.profiler import ProfilerActivity, profile

    from .intranode import _api_us

    def one() -> None:
        round_trip(disp, x.clone().requires_grad_(True), routing_map, probs_full.clone().requires_grad_(True), grad)

    api, host = _api_us(one, iters, warmup, dist.group.WORLD)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            one()
        torch.cuda.synchronize()
    kernel = sum(float(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA) / iters
    return api, kernel, host


def _profile(disp, x, routing_map, probs_full, grad, kind: str, rank: int, cuda: bool,
             trace: Optional[str] = None) -> None:
    """Three round trips under torch.profiler; rank 0 prints the top operators by device (or CPU) time, and
    with `trace` every rank writes its Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(3):
            round_trip(disp, x.clone().requires_grad_(True), routing_map, probs_full.clone().requires_grad_(True), grad)
        if cuda:
            torch.cuda.synchronize()
    if trace:  # every rank's: the ranks' timelines side by side show who waits for whom
        prof.export_chrome_trace(f"{trace}.{kind}.rank{rank}.json")
    if rank == 0:
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        print(f"[megatron] profile of {kind} (3 round trips, rank 0):", flush=True)
        print(prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=60), flush=True)


def _rank(rank: int, world: int, args, out_path: Optional[str], context: dict) -> None:
    device = init_rank_group()
    cuda = device.type == "cuda"
    shared_gpu = cuda and dist.get_backend() == "gloo"  # ranks share a GPU: NCCL is out
    import megatron_patch
    megatron_patch.apply()
    if args.num_sms is not None:
        from megatron_patch import settings
        settings.num_sms = args.num_sms
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world, create_gloo_process_groups=False)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(rank)
    T, H, E, K = args.num_tokens, args.hidden, args.num_experts, args.num_topk
    scores = torch.rand(T, E, generator=g)
    top = scores.topk(K, dim=1)
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top.indices, True).to(device)
    probs_full = torch.zeros(T, E).scatter_(1, top.indices, top.values.softmax(dim=1)).to(device)
    cf, pad = args.moe_expert_capacity_factor, args.moe_pad_expert_input_to_capacity
    if cf is not None:  # what Megatron's router does with these settings
        from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping
        probs_full, routing_map = apply_router_token_dropping(probs_full, routing_map, K, cf, pad_to_capacity=pad)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    grad = torch.randn(T, H, generator=g).to(device, dtype)
    device_name, gpus = torch.cuda.get_device_name(device) if cuda else "cpu", gpus_used(device)
    records = []
    skipped: dict[str, str] = {}
    for kind in [k for k in args.dispatchers.split(",") if k]:
        try:
            if shared_gpu and kind != "uccl":
                raise RuntimeError("needs NCCL (one rank per GPU); these ranks share a GPU over gloo")
            disp = _make_dispatcher(kind, E, K, H, world, dtype, args.num_sms, cf, pad)
        except (ImportError, ValueError, AssertionError, RuntimeError) as exc:
            if kind == "uccl":  # a peer that cannot start here is skipped; ours must
                raise
            skipped[kind] = skip_reason(kind, exc)
            if rank == 0:
                print(f"[megatron] {kind}: skipped ({skipped[kind]})", flush=True)
            continue
        times = []
        phase_ms = [0.0] * len(PHASES)
        host_ms = [0.0] * len(PHASES)
        for i in range(args.warmup + args.iters):
            hidden = x.clone().requires_grad_(True)
            probs = probs_full.clone().requires_grad_(True)
            events: list = []
            stamps: list = []

            def mark() -> None:
                events.append(torch.cuda.Event(enable_timing=True))
                events[-1].record()
                stamps.append(time.perf_counter())

            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            rows = round_trip(disp, hidden, routing_map, probs, grad, mark if (cuda and args.breakdown) else None)
            if cuda:
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
                for j in range(len(events) - 1):
                    phase_ms[j] += events[j].elapsed_time(events[j + 1]) / args.iters
                    host_ms[j] += (stamps[j + 1] - stamps[j]) * 1e3 / args.iters
        if args.profile:
            _profile(disp, x, routing_map, probs_full, grad, kind, rank, cuda, args.trace)
        mean = torch.tensor(sum(times) / len(times), dtype=torch.float64, device=device)
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)
        experts = torch.tensor(_time_experts(rows, H, dtype, device, args.warmup, args.iters), dtype=torch.float64,
                               device=device)
        dist.all_reduce(experts, op=dist.ReduceOp.MAX)
        rec = {"bench": "megatron", "op": "round_trip_fwd_bwd", "dispatcher": kind, "ranks": world,
               "us": mean.item() * 1e6, "ms": mean.item() * 1e3, "gbps": None, "device": device_name, "gpus": gpus,
               "timing": "api", "sms": None, "sms_occupied": None,
               "num_tokens": T, "hidden": H, "num_experts": E, "num_topk": K, "dtype": str(dtype),
               "experts_ms": experts.item() * 1e3, "ms_without_experts": (mean.item() - experts.item()) * 1e3,
               "moe_expert_capacity_factor": cf, "moe_pad_expert_input_to_capacity": pad, **context}
        if cuda:
            times3 = torch.tensor(_back_to_back(disp, x, routing_map, probs_full, grad, args.iters, args.warmup),
                                  dtype=torch.float64, device=device)
            dist.all_reduce(times3, op=dist.ReduceOp.MAX)
            rec["api_us"], rec["kernel_us"], rec["host_us"] = times3.tolist()
        if kind == "uccl":
            rec["backend"], rec["sms"] = disp.buffer.backend_name, disp.buffer.num_sms
            rec["sms_occupied"] = disp.buffer.occupied_sms(expert_major=True)  # the dispatcher's calls pass no Config
        elif kind.startswith("flex"):
            rec["sms"] = args.num_sms  # moe_flex_dispatcher_num_sms (None: the backend's own default)
        if cuda and args.breakdown:
            phases = torch.tensor([phase_ms, host_ms], dtype=torch.float64, device=device)
            dist.all_reduce(phases, op=dist.ReduceOp.MAX)
            rec["phases_ms"] = dict(zip(PHASES, phases[0].tolist()))
            rec["phases_host_ms"] = dict(zip(PHASES, phases[1].tolist()))
            if rank == 0:
                print(f"[megatron] {kind:<8} phases, ms of GPU time between marks (host time to issue them), max "
                      "over ranks: " + ", ".join(f"{k} {v:.3f} ({h:.3f})" for (k, v), h in
                                               zip(rec["phases_ms"].items(), rec["phases_host_ms"].values())),
                      flush=True)
        records.append(rec)
        if rank == 0:
            print(f"[megatron] {kind:<8} EP={world} tokens={T} hidden={H} experts={E} top-{K}: "
                  f"{rec['ms']:.3f} ms per fwd+bwd round trip (identity experts alone {rec['experts_ms']:.3f} ms, "
                  f"the rest {rec['ms_without_experts']:.3f} ms)", flush=True)
            if cuda:
                print(f"[megatron] {kind:<8} back to back: api {rec['api_us']:.1f} us, kernels {rec['kernel_us']:.1f} "
                      f"us (api/kernel {rec['api_us'] / rec['kernel_us']:.2f}), host {rec['host_us']:.1f} us per round "
                      "trip", flush=True)
    for rec in records:  # a record says what the run it belongs to could not compare it with
        rec["skipped"] = dict(skipped)
    if rank == 0 and out_path:
        with open(out_path, "w") as f:
            json.dump(records, f, indent=1)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_sms is not None and (args.num_sms <= 0 or args.num_sms % 2):
        parser.error(f"--sms must be a positive even number, got {args.num_sms}")
    if args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is None:
        parser.error("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    world = launched_world() or args.ranks or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    warn_without_mps(world, "megatron")
    env = ranks_env(args.ranks_per_node, world)
    context = run_context("bench megatron", argv)
    if run(_rank, world, args, args.json, context, env=env, timeout=1800) is None:  # a launched rank other than 0
        return 0
    if args.json:
        print(f"records: {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
