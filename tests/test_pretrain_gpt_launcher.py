"""The pretrain-gpt launcher: finds the Megatron-LM checkout, applies the patch, strips our flags."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

FAKE_PRETRAIN = textwrap.dedent('''
    # stands in for Megatron-LM's pretrain_gpt.py: parse args with Megatron's own parser, build a config
    import sys
    from megatron.training.arguments import parse_args
    from megatron.core.transformer.transformer_config import TransformerConfig
    args = parse_args()
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                            moe_router_topk=2, moe_token_dispatcher_type=args.moe_token_dispatcher_type)
    from megatron_patch import settings
    print("dispatcher", cfg.moe_token_dispatcher_type, "sms", settings.num_sms, "argv", sys.argv[1:])
''')


def _run(args, cwd, megatron_lm=None):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_PATH"}
    if megatron_lm:
        env["MEGATRON_LM_PATH"] = megatron_lm
    return subprocess.run([sys.executable, "-m", "uccl_ep_train.apps.cli", "pretrain-gpt", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)


def test_launcher_runs_checkout_with_uccl(tmp_path):
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text(FAKE_PRETRAIN)
    r = _run(["--moe-token-dispatcher-type", "uccl", "--uccl-ep-num-sms", "8"], cwd=tmp_path,
             megatron_lm=str(checkout))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dispatcher uccl sms 8 argv ['--moe-token-dispatcher-type', 'uccl']" in r.stdout


def test_launcher_without_checkout_says_what_to_do(tmp_path):
    r = _run(["--moe-token-dispatcher-type", "uccl"], cwd=tmp_path)
    assert r.returncode != 0
    assert "no Megatron-LM checkout found" in r.stderr and "MEGATRON_LM_PATH" in r.stderr


def test_ranks_sharing_a_gpu_get_its_index_as_local_rank_and_need_gloo(monkeypatch):
    """4 ranks of a host with 1 GPU: rank 3's LOCAL_RANK becomes 0 (Megatron-LM sets that device), the ranks
    keep CUDA tensors over gloo and load eagerly; without --distributed-backend gloo it stops, naming the
    flag; with a GPU per rank nothing changes."""
    import torch

    from megatron_patch.pretrain_gpt import share_gpus

    for var in ("UCCL_EP_DEVICE", "CUDA_MODULE_LOADING"):  # share_gpus sets them: restored after the test
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert share_gpus([]) == 1 and os.environ["LOCAL_RANK"] == "3" and "UCCL_EP_DEVICE" not in os.environ
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="4 ranks share 1 GPU.*pass --distributed-backend gloo \\(got nccl\\)"):
        share_gpus(["--num-layers", "2"])
    assert os.environ["LOCAL_RANK"] == "3"
    assert share_gpus(["--distributed-backend", "gloo", "--num-layers", "2"]) == 4
    assert os.environ["LOCAL_RANK"] == "0"
    assert os.environ["UCCL_EP_DEVICE"] == "cuda" and os.environ["CUDA_MODULE_LOADING"] == "EAGER"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert share_gpus(["--distributed-backend=gloo"]) == 2 and os.environ["LOCAL_RANK"] == "1"


def test_launcher_on_gloo_splits_megatron_coalesced_grad_sync(tmp_path):
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text(
        "from megatron.core.distributed import param_and_grad_buffer as b\n"
        "print('coalescing from', b._coalescing_manager.__module__)\n")
    for backend, module in (("gloo", "megatron_patch.gloo_grad_sync"), ("nccl", "torch.distributed")):
        r = _run(["--distributed-backend", backend], cwd=tmp_path, megatron_lm=str(checkout))
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"coalescing from {module}" in r.stdout, (backend, r.stdout)
