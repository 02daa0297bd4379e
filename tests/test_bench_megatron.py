"""`uccl-ep-train bench megatron` on CPU ranks: records per dispatcher, flex backends by name, clear skips."""
from __future__ import annotations

import json

import pytest

from record_check import assert_complete

pytest.importorskip("megatron.core")


def test_bench_megatron_records_and_skips(tmp_path, capfd):  # capfd: the ranks are child processes
    from uccl_ep_train.apps.bench import megatron as bench

    out = tmp_path / "records.json"
    assert bench.main(["--ranks", "2", "--num-tokens", "16", "--hidden", "32", "--num-experts", "4",
                       "--num-topk", "2", "--warmup", "1", "--iters", "2", "--json", str(out),
                       "--dispatchers", "uccl,alltoall,flex-nosuchbackend,alltoall-x"]) == 0
    records = json.loads(out.read_text())
    assert [r["dispatcher"] for r in records] == ["uccl", "alltoall"]
    assert_complete(records)  # what tests/test_records.py asks of committed records
    for r in records:
        assert r["ms"] > 0 and r["experts_ms"] > 0 and r["num_topk"] == 2
        assert (r["device"], r["gpus"], r["timing"]) == ("cpu", 0, "api")
        assert "uccl-ep-train bench megatron --ranks 2 " in r["command"]  # after any FI_* the run had set
        assert r["sms_occupied"] is None  # uccl on CPU: the reference backend; alltoall: no Buffer
        # every record names the dispatchers of its run that did not start, and why (what stdout says)
        assert set(r["skipped"]) == {"flex-nosuchbackend", "alltoall-x"}
        assert "only flex takes a backend suffix, got alltoall-x" in r["skipped"]["alltoall-x"]
    text = capfd.readouterr().out
    assert f"flex-nosuchbackend: skipped ({records[0]['skipped']['flex-nosuchbackend']})" in text
    assert "alltoall-x: skipped (ValueError: --dispatchers: only flex takes a backend suffix, got alltoall-x)" in text


def test_skip_reason_says_how_to_get_deep_ep():
    """flex over DeepEP without `deep_ep`: the reason carries Megatron's error and the way to ours."""
    from uccl_ep_train.apps.bench.megatron import skip_reason

    missing = ImportError("DeepEP is not installed.")
    for kind in ("flex", "flex-deepep"):
        reason = skip_reason(kind, missing)
        assert reason.startswith("ImportError: DeepEP is not installed. (flex needs `deep_ep` importable")
        assert "export PYTHONPATH=$(uccl-ep-train deep-ep-path):$PYTHONPATH" in reason
    # other backends and other failures: the error alone (we ship no HybridEP)
    assert skip_reason("flex-hybridep", ImportError("HybridEP is not installed.")) == \
        "ImportError: HybridEP is not installed."
    assert skip_reason("flex", RuntimeError("needs NCCL")) == "RuntimeError: needs NCCL"


def test_bench_megatron_drop_and_pad(tmp_path):
    """Megatron's drop-and-pad routing through both dispatchers; the settings are in the records."""
    from uccl_ep_train.apps.bench import megatron as bench

    out = tmp_path / "records.json"
    assert bench.main(["--ranks", "2", "--num-tokens", "16", "--hidden", "32", "--num-experts", "4",
                       "--num-topk", "2", "--warmup", "1", "--iters", "2", "--json", str(out),
                       "--dispatchers", "uccl,alltoall", "--moe-expert-capacity-factor", "1.0",
                       "--moe-pad-expert-input-to-capacity"]) == 0
    records = json.loads(out.read_text())
    assert [r["dispatcher"] for r in records] == ["uccl", "alltoall"]
    assert all(r["moe_expert_capacity_factor"] == 1.0 and r["moe_pad_expert_input_to_capacity"] for r in records)
    with pytest.raises(SystemExit):
        bench.main(["--moe-pad-expert-input-to-capacity"])


@pytest.mark.gpu
def test_bench_megatron_api_kernel_host_times_on_shared_gpu(tmp_path, mps, capfd):
    """Two ranks on one GPU (gloo + MPS): only uccl runs (the others are skipped, saying why); each record
    carries the back-to-back api, kernel and host time per round trip."""
    import torch

    from uccl_ep_train.apps.bench import megatron as bench

    ranks = torch.cuda.device_count() + 1  # one more than GPUs: they share over gloo
    if ranks > 8:
        pytest.skip("more than 8 GPUs: the extra rank would make a second node")
    out = tmp_path / "records.json"
    assert bench.main(["--ranks", str(ranks), "--num-tokens", "256", "--hidden", "512", "--num-experts", "16",
                       "--num-topk", "4", "--warmup", "2", "--iters", "5", "--json", str(out),
                       "--dispatchers", "uccl,alltoall", "--moe-expert-capacity-factor", "1.0",
                       "--moe-pad-expert-input-to-capacity"]) == 0
    records = json.loads(out.read_text())
    assert [r["dispatcher"] for r in records] == ["uccl"]
    assert_complete(records)
    r = records[0]
    assert r["backend"] == "native" and r["gpus"] == ranks - 1
    assert r["api_us"] > 0 and r["kernel_us"] > 0 and r["host_us"] > 0
    assert "alltoall: skipped (RuntimeError: needs NCCL" in capfd.readouterr().out
