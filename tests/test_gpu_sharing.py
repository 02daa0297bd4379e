"""Several ranks on one GPU: the MPS check (pure rule, through real gloo all-gathers with faked GPUs, the
opt-out), mps_active against fake control sockets and pipes, scripts/mps.sh without a daemon, group_device;
on GPUs (marked `gpu`), two ranks on one GPU under MPS through run_ranks(backend="gloo", device="cuda")."""
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from uccl_ep_train import gpu_sharing as gs
from uccl_ep_train.gpu_sharing import RankGpu, sharing_verdict

MPS_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "mps.sh"


def _r(host="h0", gpu="GPU-a", mps=False, allow=False, eager=True):
    return RankGpu(host, gpu, mps, allow, eager)


def test_ranks_sharing_a_gpu_must_load_modules_eagerly():
    n, err = sharing_verdict([_r(mps=True), _r(mps=True, eager=False), _r(gpu="GPU-b", eager=False)], "x")
    assert n == 2 and err.startswith("x: ranks [1] share a GPU with other ranks but load CUDA modules lazily")
    assert "CUDA_MODULE_LOADING=EAGER" in err
    assert sharing_verdict([_r(mps=True), _r(mps=True)], "x") == (2, None)
    assert sharing_verdict([_r(mps=True, allow=True, eager=False)] * 2, "x") == (2, None)


# ---- the rule ------------------------------------------------------------------------------------------
def test_one_rank_per_gpu_passes():
    assert sharing_verdict([_r(gpu="GPU-a"), _r(gpu="GPU-b")], "x") == (1, None)
    assert sharing_verdict([_r(gpu=None), _r(gpu=None)], "x") == (1, None)     # CPU ranks share nothing
    assert sharing_verdict([_r(host="h0"), _r(host="h1")], "x") == (1, None)   # same id, other host


def test_shared_gpu_without_mps_names_ranks_gpu_and_the_fix():
    per_gpu, err = sharing_verdict([_r(), _r(gpu="GPU-b"), _r(), _r(gpu="GPU-b", mps=True),
                                    _r(gpu="GPU-b", mps=True)], "Buffer")
    assert per_gpu == 3
    assert err.startswith("Buffer: ranks [0, 2] share GPU GPU-a on h0 (MPS not running for ranks [0, 2]); "
                          "ranks [1, 3, 4] share GPU GPU-b on h0 (MPS not running for ranks [1])")
    assert "bash scripts/mps.sh start" in err and "UCCL_EP_ALLOW_SHARED_GPU=1" in err


def test_shared_gpu_with_mps_on_every_sharing_rank_passes():
    assert sharing_verdict([_r(mps=True), _r(mps=True), _r(gpu="GPU-b")], "x") == (2, None)


def test_opt_out_needs_every_rank():
    assert sharing_verdict([_r(allow=True), _r(allow=True)], "x") == (2, None)
    assert sharing_verdict([_r(allow=True), _r()], "x")[1] is not None  # ranks must agree, or all raise


def test_check_gpu_sharing_raises_and_returns(monkeypatch):
    monkeypatch.setattr(gs, "gather_reports", lambda group, device: [_r(), _r()])
    with pytest.raises(RuntimeError, match=r"internode: ranks \[0, 1\] share GPU GPU-a"):
        gs.check_gpu_sharing(None, torch.device("cpu"), "internode")
    monkeypatch.setattr(gs, "gather_reports", lambda group, device: [_r(mps=True)] * 3)
    assert gs.check_gpu_sharing(None, torch.device("cpu"), "internode") == 3


def _faked_shared_gpu(rank, world, device):
    """Real gloo all-gathers; every rank claims the same GPU and no MPS."""
    gs.gpu_uuid = lambda device: "GPU-fake"
    gs.mps_active = lambda pipe_directory=None: False
    assert gs.ranks_per_gpu(dist.group.WORLD, torch.device("cpu")) == world
    try:
        return gs.check_gpu_sharing(dist.group.WORLD, torch.device("cpu"), f"rank {rank}")
    except RuntimeError as exc:
        return str(exc)


def test_every_rank_raises_over_a_real_group():
    out = run_ranks(_faked_shared_gpu, 3, timeout=120)
    for rank, msg in enumerate(out):
        assert isinstance(msg, str) and msg.startswith(f"rank {rank}: ranks [0, 1, 2] share GPU GPU-fake"), msg


def test_opt_out_over_a_real_group():
    assert run_ranks(_faked_shared_gpu, 2, env={"UCCL_EP_ALLOW_SHARED_GPU": "1"}, timeout=120) == [2, 2]


def _cpu_ranks(rank, world, device):
    return gs.check_gpu_sharing(dist.group.WORLD, torch.device("cpu"), "cpu"), str(gs.group_device(dist.group.WORLD))


def test_cpu_ranks_share_nothing_and_stay_on_cpu():
    assert run_ranks(_cpu_ranks, 2, timeout=120) == [(1, "cpu"), (1, "cpu")]


def test_group_device_rejects_unknown_choice(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group: "gloo")
    monkeypatch.setenv("UCCL_EP_DEVICE", "tpu")
    with pytest.raises(ValueError, match="UCCL_EP_DEVICE must be 'cpu' or 'cuda', got 'tpu'"):
        gs.group_device(None)
    monkeypatch.setenv("UCCL_EP_DEVICE", "cpu")
    assert gs.group_device(None) == torch.device("cpu")


# ---- mps_active ----------------------------------------------------------------------------------------
def test_mps_active_on_an_empty_directory(tmp_path, monkeypatch):
    assert not gs.mps_active(str(tmp_path))
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert gs.mps_pipe_directory() == str(tmp_path) and not gs.mps_active()


@pytest.mark.parametrize("kind", [socket.SOCK_SEQPACKET, socket.SOCK_STREAM])
def test_mps_active_needs_a_listening_control_socket(tmp_path, kind):
    control = tmp_path / "control"
    with socket.socket(socket.AF_UNIX, kind) as server:
        server.bind(str(control))
        server.listen(4)
        assert gs.mps_active(str(tmp_path))
    assert control.exists() and not gs.mps_active(str(tmp_path))  # the stale socket a quit daemon leaves


def test_mps_active_with_a_control_pipe(tmp_path):
    control = tmp_path / "control"
    os.mkfifo(control)
    assert not gs.mps_active(str(tmp_path))  # nobody reads it
    reader = os.open(control, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert gs.mps_active(str(tmp_path))
    finally:
        os.close(reader)


# ---- scripts/mps.sh ------------------------------------------------------------------------------------
def _script(action, **env):
    return subprocess.run([shutil.which("bash") or "/bin/bash", str(MPS_SCRIPT), action], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})


def test_mps_script_without_the_mps_binary_says_so(tmp_path):
    for action in ("status", "stop", "start"):
        done = _script(action, PATH=str(tmp_path))  # an empty PATH: no nvidia-cuda-mps-control
        assert done.returncode == 0, done.stderr
        assert "nvidia-cuda-mps-control not found" in done.stdout and f"nothing to {action}" in done.stdout


def test_mps_script_without_a_daemon(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    tool = fake / "nvidia-cuda-mps-control"  # answers like the real client with no daemon: fails
    tool.write_text("#!/bin/sh\necho 'Cannot find MPS control daemon process' >&2\nexit 1\n")
    tool.chmod(0o755)
    pipe = tmp_path / "pipe"
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    done = _script("status", **env)
    assert done.returncode == 0 and f"no control daemon answers in {pipe}" in done.stdout, done
    done = _script("stop", **env)
    assert done.returncode == 0 and "nothing to stop" in done.stdout, done
    assert _script("restart", **env).returncode == 2


# ---- GPU: two ranks on one GPU under MPS ---------------------------------------------------------------
def _mps_clients():
    """{server pid: number of MPS clients} from the control daemon."""
    def ask(cmd):
        return subprocess.run(["nvidia-cuda-mps-control"], input=cmd + "\n", capture_output=True, text=True,
                              timeout=30).stdout.split()
    return {pid: len(ask(f"get_client_list {pid}")) for pid in ask("get_server_list")}


def _two_ranks_one_gpu(rank, world, device):
    x = torch.full((1 << 20,), float(rank + 1), device=device)
    assert x.device == torch.device("cuda", 0) and gs.group_device(dist.group.WORLD) == x.device
    per_gpu = gs.check_gpu_sharing(dist.group.WORLD, x.device, "test")
    gathered = [torch.empty(1) for _ in range(world)]
    dist.all_gather(gathered, x.sum().reshape(1).cpu())  # gloo moves CPU copies
    clients = _mps_clients() if rank == 0 else None   # both ranks hold a context now (x exists)
    dist.barrier()
    return per_gpu, [t.item() for t in gathered], gs.mps_active(), clients


@pytest.mark.gpu
def test_two_ranks_share_one_gpu_under_mps(mps):
    out = run_ranks(_two_ranks_one_gpu, 2, device="cuda", backend="gloo", ranks_per_gpu=2, timeout=180)
    n = float(1 << 20)
    for per_gpu, sums, mps_seen, _ in out:
        assert per_gpu == 2 and sums == [n, 2 * n] and mps_seen
    clients = out[0][3]
    assert any(count >= 2 for count in clients.values()), clients  # both ranks are MPS clients
