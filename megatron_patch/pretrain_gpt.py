"""Run Megatron-LM's pretrain_gpt.py with the uccl dispatcher registered.

    uccl-ep-train pretrain-gpt [--megatron-lm PATH] <Megatron-LM args> [--uccl-ep-num-sms N ...]
    python -m megatron_patch.pretrain_gpt ...

The megatron-core wheel ships megatron.training but not pretrain_gpt.py (it lives at the root of a
Megatron-LM checkout), so the checkout is found from `--megatron-lm`, then `MEGATRON_LM_PATH`, then the
current directory. Our `--uccl-ep-*` flags are taken out of the command line and applied; everything else
goes to Megatron-LM unchanged (e.g. `--moe-token-dispatcher-type uccl`, which its parser accepts once
`megatron_patch.apply()` has run).

Ranks sharing a GPU (torchrun's LOCAL_WORLD_SIZE beyond the host's GPUs: emulated nodes on one GPU, under
MPS): `share_gpus` points LOCAL_RANK at the rank's GPU before Megatron-LM reads it (its
`_initialize_distributed` calls `torch.cuda.set_device(LOCAL_RANK)`) and sets what the ranks need
(gpu_sharing.shared_gpu_env); Megatron-LM's groups must then be gloo (`--distributed-backend gloo`), since
NCCL refuses two ranks on one GPU. On gloo, Megatron's coalesced gradient all-reduce is split into single
calls (megatron_patch.gloo_grad_sync: gloo has no coalesced all-reduce for CUDA tensors).
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Optional

from uccl_ep_train.gpu_sharing import ranks_per_gpu_on_host, shared_gpu_env

from . import settings


def find_checkout(explicit: Optional[str]) -> str:
    candidates = [explicit, os.environ.get("MEGATRON_LM_PATH"), os.getcwd()]
    for path in candidates:
        if path and os.path.isfile(os.path.join(path, "pretrain_gpt.py")):
            return os.path.abspath(path)
    where = explicit or os.environ.get("MEGATRON_LM_PATH") or os.getcwd()
    raise SystemExit(f"pretrain-gpt: no Megatron-LM checkout found ({where} has no pretrain_gpt.py). "
                     f"Clone https://github.com/NVIDIA/Megatron-LM and pass --megatron-lm PATH or set "
                     f"MEGATRON_LM_PATH=PATH")


def distributed_backend(megatron_argv: list[str]) -> str:
    """Megatron-LM's `--distributed-backend` in its command line (its default: nccl)."""
    flag = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    flag.add_argument("--distributed-backend", default="nccl")
    return flag.parse_known_args(megatron_argv)[0].distributed_backend


def share_gpus(megatron_argv: list[str]) -> int:
    """Before Megatron-LM starts in this rank: when the host's ranks (LOCAL_WORLD_SIZE) outnumber its GPUs,
    LOCAL_RANK becomes this rank's GPU (consecutive ranks share one) and shared_gpu_env is set; returns the
    ranks per GPU (0 without GPUs). Refuses (SystemExit) sharing without `--distributed-backend gloo`."""
    import torch  # device_count asks NVML: no CUDA context yet, so the environment set here still counts

    per_gpu = ranks_per_gpu_on_host(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
    if per_gpu <= 1:
        return per_gpu
    backend = distributed_backend(megatron_argv)
    if backend != "gloo":
        raise SystemExit(f"pretrain-gpt: {os.environ['LOCAL_WORLD_SIZE']} ranks share {torch.cuda.device_count()} "
                         f"GPU(s) ({per_gpu} per GPU) and NCCL refuses two ranks on one GPU: pass "
                         f"--distributed-backend gloo (got {backend}), and run them under MPS "
                         f"(bash scripts/mps.sh start)")
    os.environ["LOCAL_RANK"] = str(int(os.environ.get("LOCAL_RANK", "0")) // per_gpu)
    os.environ.update(shared_gpu_env(per_gpu))
    return per_gpu


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours = settings.add_arguments(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    ours.add_argument("--megatron-lm", default=None)
    known, rest = ours.parse_known_args(argv)
    checkout = find_checkout(known.megatron_lm)
    settings.apply_arguments(known)
    share_gpus(rest)
    sys.path.insert(0, checkout)  # before megatron is imported: the checkout's megatron package wins
    import megatron_patch
    megatron_patch.apply()
    if distributed_backend(rest) == "gloo":
        from megatron_patch import gloo_grad_sync
        gloo_grad_sync.apply()
    script = os.path.join(checkout, "pretrain_gpt.py")
    sys.argv = [script] + rest
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
