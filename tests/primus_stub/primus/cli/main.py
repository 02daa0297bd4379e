"""Primus's CLI (`primus train pretrain --config EXP.yaml`) and its runtime
(primus/core/runtime/train_runtime.py), reduced to the patch phases: the Megatron arguments are built from
the experiment's overrides (only the keys Megatron knows, here the two the patches touch), then build_args,
the overrides merged into the arguments, setup, before_train, and training, which prints what it got. As in
Primus, any failure on the way (SystemExit included) ends the process with status 1 and the cause."""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

from primus.core.patches import APPLIED, run_patches

MEGATRON_DEFAULTS = {"moe_token_dispatcher_type": "allgather", "moe_enable_deepep": False}


def train(overrides: dict) -> dict:
    """Run the phases on one experiment's overrides; returns what training would get."""
    module_config = SimpleNamespace(params=SimpleNamespace(**overrides))
    args = SimpleNamespace(**{k: overrides.get(k, v) for k, v in MEGATRON_DEFAULTS.items()})

    def phase(name: str) -> None:
        run_patches(backend="megatron", phase=name,
                    extra={"backend_args": args, "module_config": module_config, "primus_config": None})

    phase("build_args")
    for k, v in vars(module_config.params).items():   # Primus-only keys join the arguments
        if not hasattr(args, k):
            setattr(args, k, v)
    module_config.params = args
    phase("setup")
    phase("before_train")
    return {"dispatcher": args.moe_token_dispatcher_type, "deepep": args.moe_enable_deepep,
            "applied": [list(a) for a in APPLIED]}


def main() -> None:
    argv = sys.argv[1:]
    if argv[:2] != ["train", "pretrain"] or "--config" not in argv:
        print("usage: primus train pretrain --config EXP.yaml", file=sys.stderr)
        raise SystemExit(2)
    from megatron_patch.primus import load_yaml, module_overrides   # Primus's YAML loader, stood in for
    try:
        result = train(module_overrides(load_yaml(argv[argv.index("--config") + 1])))
    except BaseException as e:
        print(f"[Primus] Error: RuntimeError: Training execution failed: {e}", file=sys.stderr)
        raise SystemExit(1)
    print("PRIMUS_STUB", json.dumps(dict(result, rank=int(os.environ.get("RANK", "0")))), flush=True)
