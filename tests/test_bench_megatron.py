"""`uccl-ep-train bench megatron` on CPU ranks: records per dispatcher, flex backends by name, clear skips."""
from __future__ import annotations

import json

import pytest

from record_check import assert_complete

pytest.importorskip("megatron.core")


def test_bench_megatron_records_and_skips(tmp_path, capfd):  # capfd: the ranks are child processes
    from uccl_ep_train.bench import megatron as bench

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
        assert r["command"].startswith("uccl-ep-train bench megatron --ranks 2 ")
        assert r["sms_occupied"] is None  # uccl on CPU: the reference backend; alltoall: no Buffer
    text = capfd.readouterr().out
    assert "flex-nosuchbackend: skipped" in text
    assert "only flex takes a backend suffix, got alltoall-x" in text
