"""Compare Megatron-LM training logs: each dispatcher's per-iteration "lm loss" against a reference run's.

    python -m uccl_ep_train.apps.megatron_log --reference alltoall=LOG [--run uccl=LOG ...] --json OUT
        [--rtol 1e-2] [--command "..."]

Megatron-LM's `training_log` (megatron/training/training.py) prints, on the last rank, one line per
`--log-interval` iterations: ` [date] iteration        3/      30 | consumed samples: ... | lm loss:
1.234567E+01 | ...`. That line is the one place a real pretrain_gpt.py run reports its loss, so parity of a
dispatcher with alltoall (same seeds, same data) is read from it. Writes a benchmarks/results-style record
per run ({"records": [...]}, the fields tests/test_records.py requires) and exits non-zero unless every run
has the reference's iterations, each loss within `rtol` relative of the reference's.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
from pathlib import Path
from typing import Optional

from .bench import git_commit

DEFAULT_RTOL = 1e-2
_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|")
_LM_LOSS = re.compile(r"\|\s*lm loss:\s*([-+0-9.eEnaNinf]+)\s*\|")


def lm_losses(text: str) -> dict[int, float]:
    """Iteration -> "lm loss" from Megatron-LM's training_log lines (validation/test lines say
    "on validation set" and carry no "iteration N/M |", so they are not read). Lines of several ranks or a
    repeated iteration: the last one wins."""
    losses: dict[int, float] = {}
    for line in text.splitlines():
        it, loss = _ITERATION.search(line), _LM_LOSS.search(line)
        if it and loss:
            losses[int(it.group(1))] = float(loss.group(1))
    return losses


def compare(reference: dict[int, float], run: dict[int, float], rtol: float = DEFAULT_RTOL) -> list[str]:
    """Problems of `run` against `reference` (empty: parity). A run missing an iteration, or with a loss
    that is not finite or off by more than rtol relative, is a problem; so is an empty reference."""
    if not reference:
        return ["the reference log has no 'lm loss' lines (did it train?)"]
    problems = []
    for it, ref in sorted(reference.items()):
        got = run.get(it)
        if got is None:
            problems.append(f"iteration {it}: missing")
        elif not (abs(got - ref) <= rtol * abs(ref)):  # also catches nan
            problems.append(f"iteration {it}: lm loss {got:.6g} vs {ref:.6g} (rtol {rtol:g})")
    return problems


def _device() -> tuple[str, int]:
    """The GPU's name and the GPUs the ranks shared (the launcher's ranks share every visible one)."""
    import torch
    if not torch.cuda.is_available():
        return "cpu", 0
    return torch.cuda.get_device_name(0), torch.cuda.device_count()


def _named(value: str) -> tuple[str, Path]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=LOG, got {value!r}")
    return name, Path(path)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference", type=_named, required=True, help="NAME=LOG of the reference (alltoall) run")
    p.add_argument("--run", type=_named, action="append", default=[], help="NAME=LOG of a run to compare")
    p.add_argument("--json", type=Path, required=True, help="where the records go")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL)
    p.add_argument("--command", default=" ".join(sys.argv), help="the command that made the logs")
    args = p.parse_args(argv)
    if not (math.isfinite(args.rtol) and args.rtol >= 0):
        p.error(f"--rtol {args.rtol}: must be a non-negative finite number")
    for name, path in [args.reference, *args.run]:
        if not path.is_file():
            p.error(f"--reference/--run {name}: no log at {path}")
    ref_name, ref_path = args.reference
    reference = lm_losses(ref_path.read_text(errors="replace"))
    device, gpus = _device()
    common = {"command": args.command, "device": device, "gpus": gpus,
              "date": datetime.date.today().isoformat(), "commit": git_commit(), "timing": "api"}
    records = [{**common, "dispatcher": ref_name, "lm_loss": reference}]
    failed = not reference
    for name, path in args.run:
        losses = lm_losses(path.read_text(errors="replace"))
        problems = compare(reference, losses, args.rtol)
        failed |= bool(problems)
        records.append({**common, "dispatcher": name, "lm_loss": losses, "reference": ref_name,
                        "rtol": args.rtol, "parity": not problems, "problems": problems})
        print(f"{name} vs {ref_name}: " + ("parity over "
              f"{len(reference)} iterations" if not problems else "; ".join(problems[:5])))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"records": records}, indent=1) + "\n", encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
