"""The one launcher (uccl_ep_train.apps.launch): loopback rendezvous ports free and outside the OS's
ephemeral range when possible; spawned ranks get torchrun's environment, a failing rank's traceback comes
back naming it, a run past its timeout names the ranks missing, no child outlives the call; a launched
process (RANK / WORLD_SIZE set) runs as its one rank; a command runs unchanged under torchrun."""
from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from uccl_ep_train.apps import launch


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    low = launch._ephemeral_low()
    for _ in range(5):
        port = launch.free_loopback_port()
        if low > launch._LOWEST_PORT:
            assert launch._LOWEST_PORT <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_handed_port_is_not_handed_again_while_its_group_may_still_be_starting(monkeypatch):
    """Threads spawning groups at once (the GPU fuzz suite on several GPUs) each get a port of their own, though
    none is bound yet: two candidates, two calls, two different ports, then only the OS's pick is left."""
    low = next(p for p in range(20000, 10000, -1) if launch._unbound(p - 1) and launch._unbound(p - 2))
    monkeypatch.setattr(launch, "_LOWEST_PORT", low - 2)  # (below Linux's ephemeral range: the OS picks there)
    monkeypatch.setattr(launch, "_ephemeral_low", lambda: low)
    monkeypatch.setattr(launch, "_handed", {})
    first, second = launch.free_loopback_port(), launch.free_loopback_port()
    assert {first, second} == {low - 2, low - 1}
    assert launch.free_loopback_port() not in (first, second)
    monkeypatch.setattr(launch, "_HANDED_S", 0.0)  # once long enough ago, a port is a candidate again
    assert launch.free_loopback_port() in (first, second)


def test_busy_candidates_are_skipped(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        monkeypatch.setattr(launch, "_LOWEST_PORT", busy)
        monkeypatch.setattr(launch, "_ephemeral_low", lambda: busy + 1)  # the only candidate is busy
        assert launch.free_loopback_port() != busy  # so the OS picks one


def test_a_listener_on_another_loopback_address_blocks_the_port(monkeypatch):
    """A port held on [::1] only (127.0.0.1 is free) is still busy for a store listening on the wildcard."""
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with s:
        s.listen()
        busy = s.getsockname()[1]
        assert not launch._unbound(busy)
        monkeypatch.setattr(launch, "_LOWEST_PORT", busy)
        monkeypatch.setattr(launch, "_ephemeral_low", lambda: busy + 1)
        assert launch.free_loopback_port() != busy


TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "EXTRA")


def _environment(rank: int, world: int) -> dict:
    return {"rank": rank, "world": world, **{k: os.environ.get(k) for k in TORCHRUN_VARS}}


def _prints(rank: int, world: int, marker: str) -> int:
    print(f"{marker} from rank {rank}", flush=True)
    return rank


def test_ranks_take_the_launchers_stdout_and_environment_as_they_are(capfd, tmp_path, monkeypatch):
    """The ranks fork from a server that may have started while descriptor 1 and the environment were others
    (an earlier call, here one made with stdout pointing at a file): they still write where the launcher's
    stdout points now and see its environment as it is now, as spawned interpreters would."""
    saved = os.dup(1)
    monkeypatch.setenv("LAUNCH_TEST_VALUE", "early")
    try:
        with open(tmp_path / "elsewhere", "w") as f:
            os.dup2(f.fileno(), 1)
            launch.spawn(_prints, 1, "early", timeout=120)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    monkeypatch.setenv("LAUNCH_TEST_VALUE", "late")
    assert launch.spawn(_prints, 2, os.environ["LAUNCH_TEST_VALUE"], timeout=120) == [0, 1]
    assert launch.spawn(_environment_value, 1, timeout=120) == ["late"]
    out = capfd.readouterr().out
    assert "late from rank 0" in out and "late from rank 1" in out and "early" not in out


def _environment_value(rank: int, world: int) -> str:
    return os.environ.get("LAUNCH_TEST_VALUE", "")


MAIN_SCRIPT = """
from uccl_ep_train.apps.launch import spawn

def square(rank, world, base):
    return base + rank * rank

if __name__ == "__main__":
    print(spawn(square, 3, 10, timeout=120))
"""


def test_a_function_of_the_main_script_runs_on_the_ranks(tmp_path):
    """A program whose rank function lives in its own main module (scripts/ll_checks.py, tests/fuzz_runner.py
    run as scripts): the ranks forked from the fork server import that module as spawned interpreters do."""
    script = tmp_path / "main_script.py"
    script.write_text(MAIN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[10, 11, 14]"


def test_spawned_ranks_get_torchrun_environment_on_loopback():
    out = launch.spawn(_environment, 3, env={"EXTRA": "x"}, timeout=120)
    port = out[0]["MASTER_PORT"]
    for rank, seen in enumerate(out):
        assert seen == {"rank": rank, "world": 3, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                        "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "3",
                        "EXTRA": "x"}
    assert not multiprocessing.active_children()


def _group_sum(rank: int, world: int, base: int) -> int:
    """An env:// gloo group, left up for the launcher to tear down."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([base + rank])
    dist.all_reduce(t)
    return int(t.item())


def test_run_spawns_ranks_that_form_an_env_group(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launch.run(_group_sum, 2, 10, timeout=120) == [21, 21]
    assert not multiprocessing.active_children()


def _fails_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one's own error")
    return rank


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"ranks \[1\] of 2 failed") as info:
        launch.spawn(_fails_on_rank_1, 2, timeout=120)
    assert "--- rank 1 ---" in str(info.value) and "ValueError: rank one's own error" in str(info.value)
    assert not multiprocessing.active_children()


def _rank_1_fails_rank_0_later(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one's own error")
    time.sleep(launch._MORE_ERRORS_S + 5)
    return rank


def test_a_failure_names_the_ranks_that_had_not_reported_yet():
    """The others' errors are awaited a few seconds after the first (often the cause); a rank still silent
    then is named, so the reader knows the report is partial."""
    with pytest.raises(RuntimeError, match=r"ranks \[1\] of 2 failed:\nranks \[0\] had not reported [56] s after "):
        launch.spawn(_rank_1_fails_rank_0_later, 2, timeout=120)
    assert not multiprocessing.active_children()


def _rank_of(rank: int, world: int) -> int:
    return rank


def test_the_silent_ranks_wait_is_the_one_made_when_the_overall_timeout_ends_it_sooner(monkeypatch):
    """Here the wait for the others' errors would be 60 s (the ranks, forked from a server that imported the
    module unpatched, still fail and sleep as above); the overall timeout of 8 s ends it first, and the message
    says how long it was."""
    assert launch.spawn(_rank_of, 2, timeout=120) == [0, 1]  # the fork server is up: rank 1 fails at once
    monkeypatch.setattr(launch, "_MORE_ERRORS_S", 60.0)
    with pytest.raises(RuntimeError, match=r"ranks \[0\] had not reported (\d+) s after ") as exc:
        launch.spawn(_rank_1_fails_rank_0_later, 2, timeout=8)
    waited = int(re.search(r"had not reported (\d+) s", str(exc.value)).group(1))
    assert waited <= 8
    assert not multiprocessing.active_children()


def _rank_1_dies(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def test_a_rank_that_dies_without_a_result_is_named_with_its_exit_code():
    with pytest.raises(RuntimeError, match=r"(?s)ranks \[1\] of 2 failed.*exited with code 3 without a result"):
        launch.spawn(_rank_1_dies, 2, timeout=120)


def _rank_1_hangs(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def test_a_timeout_names_the_missing_ranks_and_kills_them():
    t0 = time.monotonic()
    # rank 0 finishes unless a loaded machine starts it slower than the timeout: rank 1 is named either way
    with pytest.raises(TimeoutError, match=r"ranks \[(0, )?1\] of 2 did not finish within 20 s \(finished: "):
        launch.spawn(_rank_1_hangs, 2, timeout=20)
    assert time.monotonic() - t0 < 90
    assert not multiprocessing.active_children()


def test_a_launched_process_runs_as_its_one_rank(monkeypatch):
    for key, value in launch.torchrun_env(0, 1, launch.free_loopback_port()).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("EXTRA", "")  # restored after the test
    assert launch.launched_world() == 1
    assert launch.run(_group_sum, 1, 5, env={"EXTRA": "y"}, timeout=None) == [5]
    assert os.environ["EXTRA"] == "y"
    import torch.distributed as dist

    assert not dist.is_initialized()  # torn down by the launcher
    with pytest.raises(ValueError, match="2 ranks asked for, but the launcher started 1"):
        launch.run(_group_sum, 2, 5, timeout=None)


ROOT = Path(__file__).resolve().parent.parent


def test_a_command_runs_unchanged_under_torchrun(tmp_path):
    """`bench internode` under `torchrun --standalone --nproc-per-node 2`: each process is one rank (nothing
    spawned), rank 0 writes every rank's records."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU shape and backend")
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("no torchrun beside this Python")
    out = tmp_path / "internode.json"
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "--local-addr", "127.0.0.1", "-m", "uccl_ep_train.apps.cli",
         "bench", "internode", "--ranks-per-node", "1", "--num-tokens", "32", "--hidden", "256", "--num-experts", "8",
         "--num-topk", "2", "--sms", "24", "--iters", "1", "--warmup", "0", "--json", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    records = json.loads(out.read_text())
    assert records and all((r["ranks"], r["nodes"], r["ranks_per_node"]) == (2, 2, 1) for r in records)
    assert sorted(len(r["rdma_bytes_per_rank"]) for r in records if r["op"] != "alltoall") == [2, 2, 2, 2]
