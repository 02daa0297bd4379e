"""`uccl-ep-train train`: quiet by default (rank 0 reports, the libraries' noise filtered), a progress bar on
a terminal and plain lines elsewhere, the log and plot under runs/train/; `--ranks-per-node`: nodes of
consecutive ranks give the one-node run's losses."""
from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("megatron.core")


def _losses_one_node_and_two(rank: int, world: int, device: str) -> tuple[list[float], list[float]]:
    """The tiny default train, 2 steps, as parsed from the command line: one node, then 2 nodes x 2 ranks
    (the rank's environment set as `train --ranks-per-node 2` sets it). Same seeds, same rows: same losses."""
    import torch

    from uccl_ep_train.apps.train import build_parser, train_rank, use_ranks_per_node

    os.environ.pop("UCCL_EP_RANKS_PER_NODE", None)  # the first run is one node whatever the caller set
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    curves = []
    for extra in ([], ["--ranks-per-node", "2"]):
        args = build_parser().parse_args(["--ranks", str(world), "--steps", "2", "--quiet", *extra])
        use_ranks_per_node(args.ranks_per_node)
        curves.append([r["loss"] for r in train_rank(rank, world, args, torch.device(device))])
    return curves[0], curves[1]


def test_two_emulated_nodes_match_one_node():
    # one spawn of 4 ranks runs both configurations (megatron's start-up dominates on small CPUs)
    from dist_utils import run_ranks

    for one, two in run_ranks(_losses_one_node_and_two, 4, timeout=400):
        assert len(one) == len(two) == 2
        for step, (a, b) in enumerate(zip(one, two)):
            assert abs(a - b) <= 1e-5, f"step {step + 1}: one node {a} vs 2 nodes x 2 ranks {b}"


@pytest.mark.parametrize("ranks,per_node", [(4, 3), (4, 0), (16, 16)])
def test_ranks_per_node_is_checked(ranks, per_node):
    from uccl_ep_train.apps.launch import check_ranks_per_node

    with pytest.raises(SystemExit, match="--ranks-per-node must be in 1..8 and divide the number of ranks"):
        check_ranks_per_node(per_node, ranks)
    check_ranks_per_node(None, ranks)
    check_ranks_per_node(2, 4)


def test_cli_rejects_bad_ranks_per_node(monkeypatch):
    from uccl_ep_train.apps.train import main

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="divide the number of ranks"):
        main(["--ranks", "4", "--ranks-per-node", "3", "--steps", "1"])


def test_train_is_quiet_and_logs_plain_lines_when_stdout_is_not_a_terminal(tmp_path):
    """A real run on 2 CPU ranks, stdout and stderr pipes (as under CI or Slurm): stderr holds the start line
    only (no rank's Megatron / TE / Apex / torch warnings), stdout one line every --log-every steps, the
    first and last included, then the summary naming the log and the plot under runs/train/."""
    import uccl_ep_train

    root = os.path.dirname(os.path.dirname(os.path.abspath(uccl_ep_train.__file__)))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-m", "uccl_ep_train.apps.cli", "train", "--ranks", "2", "--steps", "5",
                        "--log-every", "2", "--no-loss-check", "--plot"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [l for l in r.stderr.splitlines() if not l.startswith("uccl-ep-train train: 2 ranks (gloo/CPU)")] == []
    lines = r.stdout.splitlines()
    assert "\r" not in r.stdout
    assert [l.split(":")[0] for l in lines if l.startswith("step ")] == ["step 1/5", "step 2/5", "step 4/5",
                                                                         "step 5/5"]
    step = next(l for l in lines if l.startswith("step 2/5: "))
    assert all(f in step for f in ("loss ", " tok/s, dispatch ", " ms, combine ", " ms"))
    log, png = os.path.join("runs", "train", "uccl.json"), os.path.join("runs", "train", "uccl.png")
    assert lines[-2].endswith(f"; log {log}") and lines[-1] == f"loss curve: {png}"
    assert len(json.loads((tmp_path / log).read_text())["steps"]) == 5 and (tmp_path / png).is_file()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


RECORD = {"loss": 2.5, "tokens_per_s": 12345.0, "dispatch_ms": 1.25, "combine_ms": 0.5}


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere():
    from uccl_ep_train.apps.train import Progress

    term = _Terminal()
    bar = Progress(3, 10, term)
    for step in (1, 2, 3):
        bar.update(dict(RECORD, step=step))
    bar.close()
    text = term.getvalue()
    assert "\r" in text and "3/3" in text
    assert "loss 2.5000, 12,345 tok/s, dispatch 1.25 ms, combine 0.50 ms" in text
    pipe = io.StringIO()
    lines = Progress(7, 3, pipe)
    for step in range(1, 8):
        lines.update(dict(RECORD, step=step))
    lines.close()
    assert pipe.getvalue().splitlines() == [
        f"step {s}/7: loss 2.5000, 12,345 tok/s, dispatch 1.25 ms, combine 0.50 ms" for s in (1, 3, 6, 7)]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("rank, verbose", [(0, False), (1, False), (0, True), (1, True)])
def test_quiet_libraries(rank, verbose):
    """Rank 0 drops the libraries' noise (by message, category and module) and info logs, and keeps other
    warnings; the other ranks keep errors only; --verbose changes nothing."""
    from uccl_ep_train.apps.train import LIBRARY_NOISE_LOGS, quiet_libraries

    loggers = [logging.getLogger(name) for name in (*LIBRARY_NOISE_LOGS, "uccl_ep_train")]
    saved = [list(lg.filters) for lg in loggers]
    handler = _Records()
    for lg in loggers:
        lg.addHandler(handler)
    level = loggers[-1].level
    loggers[-1].setLevel(logging.INFO)  # as megatron's root handler at INFO has it
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_libraries(rank, verbose)
            warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning,
                                   "backends.py", 34, module="megatron.core.models.backends")
            warnings.warn_explicit("Guards may run slower on Python 3.13.0.", RuntimeWarning, "guards.py", 1,
                                   module="torch._dynamo.guards")
            warnings.warn_explicit("Apex is not installed.", UserWarning, "mine.py", 1, module="mine")
            warnings.warn_explicit("something else", UserWarning, "x.py", 1, module="megatron.core.x")
            for lg, message in zip(loggers, [*LIBRARY_NOISE_LOGS.values(), "a warning of ours"]):
                lg.warning(message + " ...")
            loggers[-1].info("an info log")
            loggers[-1].error("an error")
    finally:
        logging.disable(logging.NOTSET)
        loggers[-1].setLevel(level)
        for lg, filters in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.filters[:] = filters
    shown = [str(w.message) for w in caught]
    if verbose:
        assert len(shown) == 4 and len(handler.messages) == 5
    elif rank == 0:  # same message from another module, another message from megatron: kept
        assert shown == ["Apex is not installed.", "something else"]
        assert handler.messages == ["a warning of ours ...", "an error"]
    else:
        assert shown == [] and handler.messages == ["an error"]
