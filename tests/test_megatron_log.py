"""uccl_ep_train/apps/megatron_log.py reads "lm loss" from Megatron-LM's training_log lines (format of
megatron/training/training.py's training_log) and fails a run whose losses leave the reference's rtol."""
from __future__ import annotations

import json
import math

from uccl_ep_train.apps import megatron_log
from record_check import record_problems

# Written from training_log's format strings (Megatron-LM main d98e8a6), one MoE aux-loss term included.
EXCERPT = """\
> compiling dataset index builder ...
 [2026-11-28 15:45:01.123456] iteration        1/      30 | consumed samples:            8 | elapsed time per iteration (ms): 912.3 | learning rate: 1.000000E-04 | global batch size:     8 | lm loss: 1.039231E+01 | load_balancing_loss: 1.012345E+00 | loss scale: 1.0 | grad norm: 3.141 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2026-11-28 15:45:01.523456] iteration        2/      30 | consumed samples:           16 | elapsed time per iteration (ms): 401.0 | learning rate: 1.000000E-04 | global batch size:     8 | lm loss: 1.021000E+01 | load_balancing_loss: 1.010000E+00 | loss scale: 1.0 | grad norm: 2.718 | number of skipped iterations:   0 | number of nan iterations:   0 |
 validation loss at iteration 2 on validation set | lm loss value: 1.020000E+01 | lm loss PPL: 2.69E+04 |
"""


def test_lm_losses_reads_training_lines_only():
    assert megatron_log.lm_losses(EXCERPT) == {1: 10.39231, 2: 10.21}
    assert megatron_log.lm_losses("no training here\n") == {}


def test_compare_flags_drift_missing_and_nan():
    ref = {1: 10.0, 2: 9.0}
    assert megatron_log.compare(ref, {1: 10.05, 2: 9.0}) == []
    assert megatron_log.compare(ref, {1: 10.2, 2: 9.0})  # 2% off
    assert megatron_log.compare(ref, {1: 10.0})  # iteration 2 missing
    assert megatron_log.compare(ref, {1: math.nan, 2: 9.0})
    assert megatron_log.compare({}, {1: 1.0})  # a reference that never trained is no parity


def test_main_writes_records_and_fails_on_drift(tmp_path):
    ref, same, off = tmp_path / "alltoall.log", tmp_path / "uccl.log", tmp_path / "flex.log"
    ref.write_text(EXCERPT)
    same.write_text(EXCERPT)
    off.write_text(EXCERPT.replace("lm loss: 1.021000E+01", "lm loss: 1.121000E+01"))
    out = tmp_path / "r.json"
    cmd = ["--reference", f"alltoall={ref}", "--run", f"uccl={same}", "--json", str(out), "--command", "x"]
    assert megatron_log.main(cmd) == 0
    records = json.loads(out.read_text())["records"]
    assert [r["dispatcher"] for r in records] == ["alltoall", "uccl"] and records[1]["parity"]
    assert all(record_problems(r) == [] for r in records)
    assert megatron_log.main(cmd + ["--run", f"flex={off}"]) == 1
    assert json.loads(out.read_text())["records"][2]["problems"]
