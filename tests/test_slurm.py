"""slurm/launch.sh and slurm/train.sbatch under a fake Slurm environment (no Slurm, no GPUs needed)."""
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "slurm" / "launch.sh"
SBATCH = ROOT / "slurm" / "train.sbatch"


def base_env(tmp_path, **extra):
    """A clean environment: no inherited SLURM_* / NCCL_* / UCCL_* variables."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT), "UCCL_PYTHON": sys.executable, "UCCL_LAUNCH_DRY_RUN": "1",
           "UCCL_TORCHRUN": "torchrun", "PYTHONWARNINGS": "ignore"}
    for k in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):  # conftest's
        if k in os.environ:
            env[k] = os.environ[k]
    env.update({k: str(v) for k, v in extra.items()})
    return env


def fake_megatron(tmp_path):
    d = tmp_path / "Megatron-LM"
    d.mkdir(exist_ok=True)
    (d / "pretrain_gpt.py").write_text("# stand-in\n")
    return d


def launch(tmp_path, env, *args):
    return subprocess.run(["bash", str(LAUNCH), *args], env=env, capture_output=True, text=True, timeout=120)


def opt(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_fake_slurm_environment_gives_the_right_torchrun_command(tmp_path):
    mlm = fake_megatron(tmp_path)
    dump = tmp_path / "doctor_env"
    env = base_env(tmp_path, SLURM_JOB_ID=12345, SLURM_JOB_NUM_NODES=4, SLURM_NNODES=4, SLURM_NODEID=2,
                   SLURM_JOB_NODELIST="gpu[003-006]", SLURM_GPUS_ON_NODE=8, NCCL_SOCKET_IFNAME="ib0",
                   NCCL_IB_GID_INDEX=3, MEGATRON_LM_PATH=mlm,
                   UCCL_DOCTOR_CMD=f"env > {shlex.quote(str(dump))}")
    res = launch(tmp_path, env, "deepseek-v2-lite", "--nic", "thor2", "--", "--data-path", "/data/my corpus")
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout.strip().splitlines()[-1])
    assert cmd[0] == "torchrun"
    assert opt(cmd, "--nnodes") == "4"
    assert opt(cmd, "--nproc-per-node") == "8"
    assert opt(cmd, "--node-rank") == "2"
    assert opt(cmd, "--master-addr") == "gpu003"
    assert opt(cmd, "--master-port") == str(20000 + 12345 % 20000)
    assert cmd[cmd.index("-m") + 1:cmd.index("-m") + 3] == ["uccl_ep_train.apps.cli", "pretrain-gpt"]
    assert opt(cmd, "--moe-token-dispatcher-type") == "uccl"
    assert opt(cmd, "--expert-model-parallel-size") == "16"
    assert cmd[-2:] == ["--data-path", "/data/my corpus"]
    assert "--mock-data" not in cmd            # real data given: the recipe's mock data goes
    # the doctor ran on this node, after the environment was set up
    seen = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
    assert seen["UCCL_SOCKET_IFNAME"] == seen["NCCL_SOCKET_IFNAME"] == seen["GLOO_SOCKET_IFNAME"] == "ib0"
    assert seen["UCCL_IB_GID_INDEX"] == seen["NCCL_IB_GID_INDEX"] == "3"
    assert seen["UCCL_IB_MAX_INFLIGHT_NORMAL"] == "1"              # thor2 profile beats the recipe's 8
    assert seen["UCCL_IB_MAX_INFLIGHT_BYTES"] == "1572864"
    assert seen["UCCL_IB_MAX_INFLIGHT_LOW_LATENCY"] == "32"        # from the recipe
    assert seen["MASTER_ADDR"] == "gpu003" and seen["NODE_RANK"] == "2" and seen["LOCAL_WORLD_SIZE"] == "8"
    assert seen["MEGATRON_LM_PATH"] == str(mlm)
    assert seen["PYTHONPATH"].split(":")[0] == str(mlm)


def test_user_settings_win_and_gid_twin_is_copied(tmp_path):
    dump = tmp_path / "env"
    env = base_env(tmp_path, SLURM_JOB_ID=7, SLURM_JOB_NUM_NODES=2, SLURM_NODEID=1,
                   SLURM_JOB_NODELIST="a-node,b-node", SLURM_GPUS_PER_NODE="h100:8", UCCL_SOCKET_IFNAME="eth9",
                   UCCL_IB_GID_INDEX=5, UCCL_IB_MAX_INFLIGHT_NORMAL=4, MEGATRON_LM_PATH=fake_megatron(tmp_path),
                   UCCL_DOCTOR_CMD=f"env > {shlex.quote(str(dump))}")
    res = launch(tmp_path, env, "deepseek-v2-lite")
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout.strip().splitlines()[-1])
    assert opt(cmd, "--master-addr") == "a-node" and opt(cmd, "--nproc-per-node") == "8"
    seen = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
    assert seen["NCCL_SOCKET_IFNAME"] == "eth9" and seen["NCCL_IB_GID_INDEX"] == "5"
    assert seen["UCCL_IB_MAX_INFLIGHT_NORMAL"] == "4"


def test_nccl_qp_settings_carry_over_to_uccl_unless_set(tmp_path):
    dump = tmp_path / "env"
    env = base_env(tmp_path, SLURM_JOB_ID=7, SLURM_JOB_NUM_NODES=2, SLURM_NODEID=0,
                   SLURM_JOB_NODELIST="a-node,b-node", SLURM_GPUS_PER_NODE="h100:8", UCCL_SOCKET_IFNAME="eth9",
                   NCCL_IB_TIMEOUT=22, NCCL_IB_RETRY_CNT=5, NCCL_IB_SL=3, NCCL_IB_TC=106, NCCL_IB_GID_INDEX=3,
                   UCCL_IB_TC=41, MEGATRON_LM_PATH=fake_megatron(tmp_path),
                   UCCL_DOCTOR_CMD=f"env > {shlex.quote(str(dump))}")
    res = launch(tmp_path, env, "deepseek-v2-lite")
    assert res.returncode == 0, res.stderr
    seen = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
    assert (seen["UCCL_IB_TIMEOUT"], seen["UCCL_IB_RETRY_CNT"], seen["UCCL_IB_SL"]) == ("22", "5", "3")
    assert seen["UCCL_IB_GID_INDEX"] == "3"
    assert seen["UCCL_IB_TC"] == "41" and seen["NCCL_IB_TC"] == "106"  # the user's UCCL value wins


def test_without_nccl_settings_the_uccl_qp_settings_stay_unset(tmp_path):
    dump = tmp_path / "env"
    env = base_env(tmp_path, SLURM_JOB_ID=7, SLURM_JOB_NUM_NODES=2, SLURM_NODEID=0,
                   SLURM_JOB_NODELIST="a-node,b-node", SLURM_GPUS_PER_NODE="h100:8", UCCL_SOCKET_IFNAME="eth9",
                   MEGATRON_LM_PATH=fake_megatron(tmp_path), UCCL_DOCTOR_CMD=f"env > {shlex.quote(str(dump))}")
    res = launch(tmp_path, env, "deepseek-v2-lite")
    assert res.returncode == 0, res.stderr
    seen = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
    assert not {"UCCL_IB_TIMEOUT", "UCCL_IB_RETRY_CNT", "UCCL_IB_SL", "UCCL_IB_TC"} & set(seen)


def test_without_slurm_it_runs_on_one_node(tmp_path):
    env = base_env(tmp_path, LOCAL_WORLD_SIZE=2, UCCL_SKIP_DOCTOR=1)
    res = launch(tmp_path, env, "tiny", "--entry", "train", "--", "--steps", "2")
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout.strip().splitlines()[-1])
    assert [opt(cmd, "--nnodes"), opt(cmd, "--nproc-per-node"), opt(cmd, "--node-rank")] == ["1", "2", "0"]
    assert opt(cmd, "--master-addr") == "127.0.0.1"
    assert cmd[cmd.index("-m") + 1:] == ["uccl_ep_train.apps.cli", "train", "--recipe", "tiny", "--steps", "2"]


def test_missing_megatron_checkout_is_a_clear_error(tmp_path):
    env = base_env(tmp_path, LOCAL_WORLD_SIZE=2, UCCL_SKIP_DOCTOR=1)
    res = launch(tmp_path, env, "tiny")
    assert res.returncode == 2
    assert "MEGATRON_LM_PATH is not set" in res.stderr and "NVIDIA/Megatron-LM" in res.stderr
    env["MEGATRON_LM_PATH"] = str(tmp_path)
    res = launch(tmp_path, env, "tiny")
    assert res.returncode == 2
    assert "has no pretrain_gpt.py" in res.stderr


def test_layout_that_does_not_fit_stops_before_launch(tmp_path):
    env = base_env(tmp_path, SLURM_JOB_NUM_NODES=2, SLURM_NODEID=0, SLURM_JOB_NODELIST="n[1-2]",
                   SLURM_GPUS_ON_NODE=8, MEGATRON_LM_PATH=fake_megatron(tmp_path), UCCL_SKIP_DOCTOR=1)
    res = launch(tmp_path, env, "deepseek-v3")
    assert res.returncode == 2
    assert "not divisible by ETP*EP*PP" in res.stderr and "does not fit" in res.stderr
    assert res.stdout == ""


def test_failed_preflight_stops_the_node(tmp_path):
    env = base_env(tmp_path, LOCAL_WORLD_SIZE=2, MEGATRON_LM_PATH=fake_megatron(tmp_path), UCCL_DOCTOR_CMD="false")
    res = launch(tmp_path, env, "tiny")
    assert res.returncode == 2
    assert "pre-flight check failed on node 0" in res.stderr
    assert res.stdout == ""


def test_sbatch_runs_the_launcher_once_per_node(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "srun.log"
    (bindir / "srun").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {shlex.quote(str(log))}\n")
    (bindir / "srun").chmod(0o755)
    env = base_env(tmp_path, PATH=f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                   SLURM_SUBMIT_DIR=ROOT, MEGATRON_LM_PATH=fake_megatron(tmp_path))
    res = subprocess.run(["bash", str(SBATCH), "deepseek-v3", "--nic", "efa", "--", "--train-iters", "5"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    args = log.read_text().splitlines()
    assert "--ntasks-per-node=1" in args
    i = args.index(str(LAUNCH))
    assert args[i - 1] == "bash" and args[i + 1:] == ["deepseek-v3", "--nic", "efa", "--", "--train-iters", "5"]
    # a missing checkout fails on the batch host, before srun
    log.unlink()
    env["MEGATRON_LM_PATH"] = str(tmp_path / "nowhere")
    res = subprocess.run(["bash", str(SBATCH), "deepseek-v3"], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "MEGATRON_LM_PATH" in res.stderr and not log.exists()


@pytest.mark.parametrize("script", [LAUNCH, SBATCH])
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tiny_recipe_trains_on_cpu_ranks_through_the_launcher(tmp_path):
    """No Slurm: launch.sh on one node, torchrun with 2 CPU (gloo) ranks, `uccl-ep-train train` with the uccl
    dispatcher on the tiny recipe; the loss must go down."""
    import importlib.util
    import json
    log = tmp_path / "train.json"
    env = base_env(tmp_path, LOCAL_WORLD_SIZE=2, MASTER_PORT=_free_port(), UCCL_LAUNCH_DRY_RUN=0,
                   UCCL_TORCHRUN=f"{shlex.quote(sys.executable)} -m torch.distributed.run", OMP_NUM_THREADS=1,
                   UCCL_SOCKET_IFNAME="lo")                # loopback only
    if importlib.util.find_spec("uccl_ep_train.apps.doctor") is None:
        env["UCCL_SKIP_DOCTOR"] = "1"   # the pre-flight command is not there yet
    # --lr 3e-3 (3x the recipe's): the loss falls by a fifth within the 20 steps this test can afford
    res = subprocess.run(["bash", str(LAUNCH), "tiny", "--entry", "train", "--", "--steps", "20", "--lr", "3e-3",
                          "--log-every", "5", "--json", str(log)],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    assert "torch.distributed.run --nnodes 1 --nproc-per-node 2" in res.stderr
    assert "ifname=lo" in res.stderr
    rec = json.loads(log.read_text())
    assert (rec["recipe"], rec["dispatcher"], rec["ranks"], rec["device"]) == ("tiny", "uccl", 2, "cpu")
    losses = [s["loss"] for s in rec["steps"]]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


FAKE_TORCHRUN = '''
import json, os, sys
argv = sys.argv[1:]
i = argv.index("-m")
opts = dict(zip(argv[:i:2], argv[1:i:2]))
json.dump(opts, open(os.environ["FAKE_TORCHRUN_LOG"], "w"))
# one worker, as torchrun would start it: rank 0 of the job
env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(int(opts["--nnodes"]) * int(opts["--nproc-per-node"])))
os.execve(sys.executable, [sys.executable] + argv[i:], env)
'''

FAKE_PRETRAIN_GPT = '''
# stands in for Megatron-LM's pretrain_gpt.py: parse the command line with Megatron-LM's own parser
import json
from megatron.training.arguments import parse_args
a = parse_args()
print("PARSED " + json.dumps({k: getattr(a, k) for k in ("num_layers", "num_experts", "moe_router_topk",
      "moe_token_dispatcher_type", "expert_model_parallel_size", "pipeline_model_parallel_size",
      "multi_latent_attention", "q_lora_rank", "mock_data", "data_path")}))
'''


def test_deepseek_v3_reaches_megatron_pretrain_gpt_through_the_patch(tmp_path):
    """launch.sh -> plan -> torchrun -> `uccl-ep-train pretrain-gpt` -> megatron_patch -> the checkout's
    pretrain_gpt.py, whose Megatron-LM parser takes every DeepSeek-V3 recipe argument with dispatcher uccl
    (torchrun and pretrain_gpt.py are stand-ins: one worker of the 256-rank job runs, on CPU)."""
    import json
    mlm = fake_megatron(tmp_path)
    (mlm / "pretrain_gpt.py").write_text(FAKE_PRETRAIN_GPT)
    torchrun = tmp_path / "torchrun.py"
    torchrun.write_text(FAKE_TORCHRUN)
    log = tmp_path / "torchrun.json"
    env = base_env(tmp_path, SLURM_JOB_ID=4242, SLURM_JOB_NUM_NODES=32, SLURM_NODEID=0,
                   SLURM_JOB_NODELIST="gpu[100-131]", SLURM_GPUS_ON_NODE=8, UCCL_SOCKET_IFNAME="lo",
                   MEGATRON_LM_PATH=mlm, UCCL_SKIP_DOCTOR=1, UCCL_LAUNCH_DRY_RUN=0,
                   UCCL_TORCHRUN=f"{shlex.quote(sys.executable)} {shlex.quote(str(torchrun))}",
                   FAKE_TORCHRUN_LOG=log)
    res = launch(tmp_path, env, "deepseek-v3", "--", "--data-path", "/data/corpus")
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    opts = json.loads(log.read_text())
    assert opts["--nnodes"] == "32" and opts["--nproc-per-node"] == "8" and opts["--master-addr"] == "gpu100"
    line = [l for l in res.stdout.splitlines() if l.startswith("PARSED ")][-1]
    parsed = json.loads(line[len("PARSED "):])
    assert parsed == {"num_layers": 61, "num_experts": 256, "moe_router_topk": 8, "moe_token_dispatcher_type": "uccl",
                      "expert_model_parallel_size": 32, "pipeline_model_parallel_size": 8,
                      "multi_latent_attention": True, "q_lora_rank": 1536, "mock_data": False,
                      "data_path": ["/data/corpus"]}
