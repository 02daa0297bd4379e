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


# ---- ranks sharing GPUs, the step record, --compare ----------------------------------------------------------
@pytest.mark.parametrize("local, gpus, per_gpu, collectives", [(4, 0, 0, "gloo"), (4, 4, 1, "nccl"), (2, 8, 1, "nccl"),
                                                              (4, 1, 4, "gloo"), (4, 2, 2, "gloo"), (3, 2, 2, "gloo")])
def test_ranks_per_gpu_and_the_collectives_backend(local, gpus, per_gpu, collectives):
    from uccl_ep_train.apps.train import collectives_of
    from uccl_ep_train.gpu_sharing import ranks_per_gpu_on_host, shared_gpu_env

    assert ranks_per_gpu_on_host(local, gpus) == per_gpu
    assert collectives_of(per_gpu) == collectives
    env = shared_gpu_env(per_gpu)
    assert env == ({"UCCL_EP_DEVICE": "cuda", "CUDA_MODULE_LOADING": "EAGER"} if per_gpu > 1 else {})


def test_start_line_says_what_carries_the_traffic():
    from uccl_ep_train.apps.train import describe_ranks

    shared = describe_ranks(4, 1, 4, 2, "MPS: started", "uccl")
    assert shared.startswith("4 ranks on 1 GPU(s), 4 per GPU (MPS: started); EP dispatch/combine through uccl's")
    assert "on gloo with CUDA tensors (NCCL refuses two ranks on one GPU)" in shared
    assert shared.endswith(", 2 nodes x 2 ranks per node (UCCL_EP_RANKS_PER_NODE=2)")
    assert "Megatron's alltoall dispatch/combine and the model's other collectives on gloo" in describe_ranks(
        4, 1, 4, None, "MPS", "alltoall")
    assert describe_ranks(2, 0, 0, None, "", "uccl") == "2 ranks (gloo/CPU)"
    assert describe_ranks(2, 2, 1, None, "", "uccl") == "2 ranks (NCCL/GPU)"


def test_compare_losses():
    from uccl_ep_train.apps.train import COMPARE_RTOL, compare_losses

    ref = [{"step": s, "loss": 2.0} for s in (1, 2, 3)]
    run = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 2.0 * (1 + COMPARE_RTOL / 2)},
           {"step": 3, "loss": 2.0 * (1 + 2 * COMPARE_RTOL)}]
    worst, bad = compare_losses(run, ref)
    assert bad == [3] and worst == pytest.approx(2 * COMPARE_RTOL)
    with pytest.raises(SystemExit, match="different steps"):
        compare_losses(run[:2], ref)


def test_compare_with_a_missing_log_stops_before_any_rank(monkeypatch, tmp_path):
    from uccl_ep_train.apps.train import main

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="--compare .*no such log"):
        main(["--ranks", "2", "--steps", "1", "--compare", str(tmp_path / "none.json")])


def test_mps_is_used_started_or_explained(monkeypatch):
    """A daemon that answers is used as it is (nothing to stop); without one and without the control binary,
    the error says what to install or start."""
    from uccl_ep_train.apps import mps

    monkeypatch.setattr(mps, "mps_active", lambda pipe=None: pipe is None)
    with mps.mps_for_ranks() as (env, note):
        assert env == {} and "already running" in note
    monkeypatch.setattr(mps, "mps_active", lambda pipe=None: pipe == mps.SCRIPT_PIPE_DIRECTORY)
    with mps.mps_for_ranks() as (env, note):
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == mps.SCRIPT_PIPE_DIRECTORY and mps.SCRIPT_PIPE_DIRECTORY in note
    monkeypatch.setattr(mps, "mps_active", lambda pipe=None: False)
    monkeypatch.setattr(mps.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="need NVIDIA MPS, and nvidia-cuda-mps-control is not on PATH"):
        with mps.mps_for_ranks():
            pass


def _v3_small_uccl_and_alltoall(rank: int, world: int, device: str) -> tuple[list[dict], list[dict]]:
    """deepseek-v3-small, 3 steps, on 2 emulated nodes x 2 ranks with the uccl dispatcher, then Megatron's
    alltoall dispatcher with the same seeds."""
    import torch

    from uccl_ep_train.apps.train import build_parser, train_rank, use_ranks_per_node

    runs = []
    for dispatcher in ("uccl", "alltoall"):
        args = build_parser().parse_args(["--recipe", "deepseek-v3-small", "--ranks", str(world), "--steps", "3",
                                          "--ranks-per-node", "2", "--dispatcher", dispatcher, "--quiet"])
        use_ranks_per_node(args.ranks_per_node)
        runs.append(train_rank(rank, world, args, torch.device(device)))
    return runs[0], runs[1]


def test_v3_small_on_two_emulated_nodes_matches_alltoall_and_records_each_step():
    """The V3-shaped recipe (top-8 of 64, node-limited groups, shared expert, aux loss) through the uccl
    dispatcher across 2 emulated nodes: every step's loss within COMPARE_RTOL of Megatron's alltoall run, and
    each record names the backend of every MoE layer (3), the proxies' bytes (none on CPU: the reference
    backend has no proxies) and the growths."""
    from dist_utils import run_ranks

    from uccl_ep_train.apps.train import COMPARE_RTOL, compare_losses

    uccl, alltoall = run_ranks(_v3_small_uccl_and_alltoall, 4, timeout=600)[0]
    worst, bad = compare_losses(uccl, alltoall)
    assert bad == [], (worst, [r["loss"] for r in uccl], [r["loss"] for r in alltoall])
    for record in uccl:
        assert record["moe_backends"] == ["reference internode"] * 3
        assert record["proxy_bytes"] == 0 and isinstance(record["buffer_growths"], int)
        assert record["dispatch_ms"] > 0 and record["combine_ms"] > 0
    assert alltoall[0]["moe_backends"] == ["MoEAlltoAllTokenDispatcher (torch.distributed)"] * 3


def test_compare_run_plots_both_curves_and_records_provenance(tmp_path):
    """The comparison as the README runs it, on 2 CPU ranks: alltoall first, then uccl with --compare and
    --plot: exit 0, the comparison line, one figure, and the log's command / date / commit."""
    import uccl_ep_train

    root = os.path.dirname(os.path.dirname(os.path.abspath(uccl_ep_train.__file__)))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    base = [sys.executable, "-m", "uccl_ep_train.apps.cli", "train", "--ranks", "2", "--steps", "3", "--quiet",
            "--no-loss-check"]
    ref = subprocess.run(base + ["--dispatcher", "alltoall"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=400)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_log = os.path.join("runs", "train", "alltoall.json")
    r = subprocess.run(base + ["--compare", ref_log, "--plot", "both.png"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(l for l in r.stdout.splitlines() if l.startswith("compared with "))
    assert line.startswith(f"compared with {ref_log} (alltoall): largest relative loss difference ")
    assert r.stdout.splitlines()[-1] == "loss curve: both.png" and (tmp_path / "both.png").is_file()
    assert "MoE layers served by reference intranode; proxies 0.00 MB per step; buffer growths at steps " in r.stdout
    log = json.loads((tmp_path / "runs" / "train" / "uccl.json").read_text())
    assert log["command"] == "uccl-ep-train train " + " ".join(base[4:] + ["--compare", ref_log, "--plot", "both.png"])
    assert log["collectives"] == "gloo" and log["ranks_per_gpu"] == 0 and log["date"].endswith(" UTC")


def test_the_learning_rate_defaults_to_the_recipes(tmp_path):
    """--lr unset: the recipe's lr (deepseek-v3-small's 1e-3; at 3e-3 its training is chaotic, see
    docs/megatron.md); a recipe without one is refused, naming the flag."""
    from uccl_ep_train.apps.recipes import load_recipe
    from uccl_ep_train.apps.train import build_parser, recipe_lr

    assert build_parser().parse_args([]).lr is None
    assert recipe_lr("deepseek-v3-small") == load_recipe("deepseek-v3-small").args["lr"] == 1e-3
    no_lr = tmp_path / "no_lr.json"
    no_lr.write_text(json.dumps({"name": "no-lr", "args": {"num_layers": 2, "hidden_size": 64,
                                                          "num_attention_heads": 2, "seq_length": 64,
                                                          "micro_batch_size": 1, "global_batch_size": 4}}))
    with pytest.raises(SystemExit, match="has no lr; pass --lr"):
        recipe_lr(str(no_lr))


def test_deterministic_turns_on_torchs_deterministic_algorithms(monkeypatch):
    import torch

    from uccl_ep_train.apps.train import use_deterministic_algorithms

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        use_deterministic_algorithms()
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("lr", ["0", "-1e-3", "nan"])
def test_a_bad_lr_stops_before_any_rank(lr):
    from uccl_ep_train.apps.train import main

    with pytest.raises(SystemExit, match="--lr"):
        main(["--ranks", "2", "--steps", "1", f"--lr={lr}"])
