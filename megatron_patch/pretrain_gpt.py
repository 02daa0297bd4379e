"""Run Megatron-LM's pretrain_gpt.py with the uccl dispatcher registered.

    uccl-ep-train pretrain-gpt [--megatron-lm PATH] <Megatron-LM args> [--uccl-ep-num-sms N ...]
    python -m megatron_patch.pretrain_gpt ...

The megatron-core wheel ships megatron.training but not pretrain_gpt.py (it lives at the root of a
Megatron-LM checkout), so the checkout is found from `--megatron-lm`, then `MEGATRON_LM_PATH`, then the
current directory. Our `--uccl-ep-*` flags are taken out of the command line and applied; everything else
goes to Megatron-LM unchanged (e.g. `--moe-token-dispatcher-type uccl`, which its parser accepts once
`megatron_patch.apply()` has run).
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Optional

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


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours = settings.add_arguments(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    ours.add_argument("--megatron-lm", default=None)
    known, rest = ours.parse_known_args(argv)
    checkout = find_checkout(known.megatron_lm)
    settings.apply_arguments(known)
    sys.path.insert(0, checkout)  # before megatron is imported: the checkout's megatron package wins
    import megatron_patch
    megatron_patch.apply()
    script = os.path.join(checkout, "pretrain_gpt.py")
    sys.argv = [script] + rest
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
