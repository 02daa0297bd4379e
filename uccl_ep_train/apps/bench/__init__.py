"""Benchmarks: commands whose ranks start through apps.launch (spawned, or one rank per process under
torchrun), printing DeepEP conventions and writing JSON records.

Every record a bench writes says how, where, when and on what code it was measured (tests/record_check.py
checks it): "command" (`run_context`), "device" with "gpus" (`gpus_used`), "date" and "commit"
(`run_context`), and "timing": "api" (the interval includes the host API call: CUDA events or the wall
clock around it) or "kernel" (GPU time only: profiler kernel time, or the GPU's clock read inside a kernel)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, Optional, TypeVar

from ..launch import run

# DeepSeek-V3's MoE layer, the shape every benchmark that routes tokens defaults to.
LAYER_SHAPE = {"num_tokens": 4096, "hidden": 7168, "num_experts": 256, "num_topk": 8}


# Earlier spellings each benchmark still accepts (records name the commands that made them): the shape's
# short forms and DeepEP's --num-processes for the rank count.
_SHAPE_ALIASES = {"num_tokens": "--tokens", "num_experts": "--experts", "num_topk": "--topk"}


def add_layer_shape_args(p: argparse.ArgumentParser) -> None:
    """The MoE layer shape the benchmarks default to: DeepSeek-V3 (4096 tokens/rank, hidden 7168, 256
    experts, top-8), one definition and one spelling (`--num-tokens --hidden --num-experts --num-topk`) for
    every benchmark that routes tokens."""
    for name, default in LAYER_SHAPE.items():
        flags = ["--" + name.replace("_", "-")] + ([_SHAPE_ALIASES[name]] if name in _SHAPE_ALIASES else [])
        p.add_argument(*flags, dest=name, type=int, default=default)


def add_ranks_arg(p: argparse.ArgumentParser, default_help: str) -> None:
    """`--ranks N`, the rank count of every command that spawns ranks (`--num-processes`: the same)."""
    p.add_argument("--ranks", "--num-processes", dest="ranks", type=int, default=None,
                   help=f"ranks to spawn (default: {default_help})")


def add_ranks_per_node_arg(p: argparse.ArgumentParser, default_help: str) -> None:
    """`--ranks-per-node L`: ranks of one (emulated) node, UCCL_EP_RANKS_PER_NODE in every rank (ranks_env)."""
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help=f"ranks per (emulated) node, sets UCCL_EP_RANKS_PER_NODE (default: {default_help})")


def ranks_env(ranks_per_node: Optional[int], world: int) -> dict:
    """The ranks' environment for --ranks-per-node (checked against the rank count; None: nothing set)."""
    from ..launch import check_ranks_per_node

    check_ranks_per_node(ranks_per_node, world)
    return {} if ranks_per_node is None else {"UCCL_EP_RANKS_PER_NODE": str(ranks_per_node)}


def add_transport_arg(p: argparse.ArgumentParser) -> None:
    """`--transport`: the proxies' transport for the bytes between nodes (UCCL_EP_TRANSPORT in every rank;
    default: the automatic choice, `ipc` when every rank is on one host)."""
    p.add_argument("--transport", default=None, choices=("ipc", "fabric", "verbs"),
                   help="proxy transport between nodes (UCCL_EP_TRANSPORT; default: the automatic choice)")


def transport_env(args: argparse.Namespace) -> dict:
    """The ranks' environment for `--transport` (empty: the automatic choice)."""
    return {} if args.transport is None else {"UCCL_EP_TRANSPORT": args.transport}


def int_list(text: str) -> list[int]:
    """A comma-separated list of ints (`--sms 8,16,24`), the list spelling of every benchmark."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def git_commit() -> str:
    """HEAD of the git tree this package lives in, with "-dirty" when tracked files differ from it (the
    record then does not name the code that ran); "unknown" outside a git tree (an installed wheel)."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> Optional[str]:
        try:
            out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if not head:
        return "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no")
    return head + ("-dirty" if changed is None or changed else "")


def _portable(arg: str) -> str:
    """An argument without this machine's directories: an absolute path (also in `--opt=PATH`) becomes
    relative to the working directory when it lies below it, else its file name."""
    opt, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if not os.path.isabs(value):
        return arg
    rel = os.path.relpath(value)
    value = rel if not rel.startswith("..") else os.path.basename(value)
    return f"{opt}{eq}{value}"


# Settings that change what the proxies' bytes travel on without being an argument of the bench: a record's
# command line names the ones that were set (FI_PROVIDER=shm and =tcp measure different copies).
RECORDED_ENV = ("FI_PROVIDER", "FI_TCP_IFACE", "UCCL_EP_NICS")


def run_context(command: str, argv: list[str]) -> dict:
    """What a record needs to be reproduced: the UTC date, the commit, and the command line as the user
    types it (`[FI_PROVIDER=shm ...] uccl-ep-train <command> <argv>`, no interpreter, install path or machine
    directory)."""
    env = [f"{k}={os.environ[k]}" for k in RECORDED_ENV if os.environ.get(k)]
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(),
            "command": shlex.join([*env, "uccl-ep-train", *command.split(), *map(_portable, argv)])}


def gpus_used(device, group=None) -> int:
    """GPUs the ranks of `group` run on (distinct host and device index; 0 when `device` is the CPU).
    Collective: every rank of `group` calls it."""
    import torch
    import torch.distributed as dist

    cuda = device.type == "cuda"
    index = (torch.cuda.current_device() if device.index is None else device.index) if cuda else -1
    where: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(where, (socket.gethostname(), index), group=group)
    return len(set(where)) if cuda else 0


def rank_records(rank_fn: Callable[..., list[dict]], world: int, *args: Any,
                 env: Optional[Mapping[str, str]] = None) -> Optional[list[dict]]:
    """Every rank's records of rank_fn(rank, world, *args), in rank order, through apps.launch.run (ranks
    spawned, or this process as one rank under torchrun; 30 minutes at most); None on a launched rank other
    than 0, which has nothing left to do."""
    out = run(rank_fn, world, *args, env=env, timeout=1800)
    return None if out is None else [r for rs in out for r in rs]


def write_records(records: list[dict], path: str, tag: str) -> None:
    """`--json PATH`: the records as a JSON list (missing directories made), and a line saying so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    print(f"[{tag}] wrote {len(records)} records to {path}", flush=True)


def publish(summary: list[dict], context: dict, show: Callable[[list[dict]], None], path: Optional[str],
            tag: str) -> list[dict]:
    """A run's summary records with its context (command, date, commit) in each: shown, written to
    `--json PATH` when given, and returned."""
    summary = [{**r, **context} for r in summary]
    show(summary)
    if path:
        write_records(summary, path, tag)
    return summary


def device_us(fn: Callable[[], Any], kernels: Mapping[str, tuple[str, ...]], iters: int,
              every: Optional[Mapping[str, tuple[int, int]]] = None) -> dict[str, float]:
    """Run fn `iters` times under the profiler: per key of `kernels`, the mean device µs per run of the
    kernels whose names contain one of its substrings (DeepEP's bench_kineto: the "kernel" timing). With
    `every[key] = (i, n)` only the i-th of every n such launches in time order counts (a call that launches
    one kernel twice, its send and then its receive phase). A key no kernel matched raises (a renamed kernel
    must not record 0 µs)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    totals = dict.fromkeys(kernels, 0.0)
    seen = dict.fromkeys(kernels, 0)
    launches = dict.fromkeys(kernels, 0)
    for evt in sorted(prof.events(), key=lambda e: e.time_range.start):
        for key, names in kernels.items():
            if any(n in evt.name for n in names):
                launches[key] += 1
                i, n = (every or {}).get(key, (0, 1))
                if (launches[key] - 1) % n != i:
                    continue
                dt = getattr(evt, "device_time", None)
                totals[key] += float(getattr(evt, "cuda_time", 0.0) if dt is None else dt)
                seen[key] += 1
    missing = [f"{key} ({', '.join(kernels[key])})" for key, n in seen.items() if n == 0]
    if missing:
        raise RuntimeError(f"kernel timing: the profiler saw no kernel for {'; '.join(missing)}")
    return {key: total / iters for key, total in totals.items()}


ALIGN_CYCLES = 2_000_000  # ~1 ms of GPU wait before a kernel-timed round: every rank's host enqueues it meanwhile


def aligned_device_us(pieces: Mapping[str, Callable[[], Any]], kernels: Mapping[str, tuple[str, ...]], iters: int,
                      warmup: int, group, every: Optional[Mapping[str, tuple[int, int]]] = None,
                      before: Optional[Callable[[str], None]] = None) -> dict[str, float]:
    """device_us ("kernel" timing) over `iters` rounds (after `warmup`) that each run the pieces in order and
    start on every rank's GPU at once: a host barrier, then a GPU wait long enough for every host to enqueue
    the round behind it (DeepEP syncs its GPUs with an all-reduce; ranks sharing a GPU have no NCCL), so a
    kernel's time is its own, not the wait for a peer that started later. `before(name)` runs ahead of each
    piece (e.g. a GPU wait standing for a GEMM)."""
    import torch
    import torch.distributed as dist

    stream, done = torch.cuda.current_stream(), torch.cuda.Event(blocking=True)

    def aligned_round() -> None:
        done.record(stream)
        done.synchronize()  # sleeping, not spinning: ranks sharing a host need the cores for their proxies
        dist.barrier(group=group)
        torch.cuda._sleep(ALIGN_CYCLES)
        for name, fn in pieces.items():
            if before is not None:
                before(name)
            fn()

    for _ in range(warmup):
        aligned_round()
    return device_us(aligned_round, kernels, iters, every)


T = TypeVar("T")


def on_own_stream(device, fn: Callable[[], T]) -> T:
    """fn() with a stream of its own current on GPUs, as training code issues EP calls (Megatron's streams):
    proxies on a provider that copies GPU memory through the CUDA runtime (the fabric transport on shm) refuse
    calls from the default stream, so a bench comparing transports issues every call from another one."""
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return fn()
    with torch.cuda.stream(torch.cuda.Stream(device)):
        return fn()


def init_rank_group():
    """The process group of a bench rank, from torchrun's environment (apps.launch sets it for the ranks it
    spawns) -> its device. One rank per GPU: NCCL. More ranks on a host than GPUs: local rank r on GPU
    r % count over a gloo group with CUDA tensors (UCCL_EP_DEVICE=cuda; NCCL refuses two ranks per GPU),
    which should run under NVIDIA MPS (`warn_without_mps`). No GPU: gloo on the CPU."""
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    for var, value in (("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"),
                       ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("GLOO_SOCKET_IFNAME", "lo")):
        os.environ.setdefault(var, value)
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    timeout = timedelta(minutes=10)
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        dist.init_process_group("gloo", timeout=timeout)
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", local_rank % gpus)
    torch.cuda.set_device(device)
    if local_world > gpus:
        os.environ["UCCL_EP_DEVICE"] = "cuda"
        dist.init_process_group("gloo", timeout=timeout)
    else:
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    return device


def warn_without_mps(world: int, tag: str) -> None:
    """Before running `world` ranks (the ranks on this host: LOCAL_WORLD_SIZE when a launcher started this
    process as one of them): when they outnumber the GPUs, say how they share them, make them load their
    kernels eagerly (gpu_sharing.sharing_verdict), and warn when NVIDIA MPS is not running."""
    import sys

    import torch

    gpus = torch.cuda.device_count()
    world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if gpus == 0 or world <= gpus:  # CPU ranks share no GPU
        return
    print(f"[{tag}] {world} ranks on {gpus} GPUs: rank r on GPU r % {gpus}, gloo group with CUDA tensors",
          file=sys.stderr)
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # the spawned ranks inherit it before CUDA starts
    from uccl_ep_train.gpu_sharing import mps_active

    if not mps_active():
        print(f"[{tag}] warning: NVIDIA MPS is not running: ranks sharing a GPU time-slice it and kernels that "
              "wait for each other crawl (`bash scripts/mps.sh start`, then export what it prints)", file=sys.stderr)
