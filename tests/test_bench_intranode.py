"""`uccl-ep-train bench intranode` on one GPU under MPS (two ranks sharing it): complete records, and every
API record carries the same call's kernel and host time (the sync-free dispatch's API time is compared with
its kernel time from these)."""
from __future__ import annotations

import json

import pytest

from record_check import assert_complete

pytestmark = pytest.mark.gpu


def test_bench_intranode_records_api_kernel_and_host_time(mps, tmp_path, capfd):  # capfd: child processes
    from uccl_ep_train.apps.cli import main

    out = tmp_path / "intranode.json"
    argv = ["--num-processes", "2", "--tokens", "256", "--hidden", "1024", "--topk", "4", "--experts", "32",
            "--sms", "8", "--iters", "4", "--warmup", "1", "--json", str(out)]
    assert main(["bench", "intranode", *argv]) == 0
    records = json.loads(out.read_text())
    assert_complete(records)
    ops = {(r["op"], r["timing"]) for r in records}
    for op in ("dispatch_bf16", "dispatch_fp8", "combine", "dispatch_bf16_fresh", "dispatch_bf16_fresh_worst"):
        assert {(op, "api"), (op, "kernel")} <= ops, op
    assert ("nccl_all_to_all", "api") not in ops  # ranks sharing a GPU: a gloo group, no NCCL yardstick
    for r in records:
        assert r["gpus"] == 1 and r["ranks"] == 2 and r["backend"] == "native"
        if r["timing"] == "api":
            assert r["kernel_us"] > 0 and r["host_us"] > 0 and r["us"] > 0, r
    assert "api/kernel" in capfd.readouterr().out
