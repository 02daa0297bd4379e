"""Every committed benchmark record says how, where, when and on what code it was measured.

benchmarks/results/*.json hold a list of records or a dict with "records". Each record needs a non-empty
"command" (as a user types it), "device" (the GPU's name, or "cpu") with a GPU count ("gpus", as
`bench internode` writes it: GPUs the run used, 0 on CPU; or a count in the name itself, "2x NVIDIA H200"),
"date" (YYYY-MM-DD first), "commit" (a git hash) and "timing": "api" (the time includes the host API call)
or "kernel" (GPU time only, no host call in the interval)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from record_check import record_problems  # (tests/record_check.py: the bench tests check their records with it)

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
FILES = sorted(RESULTS.glob("*.json"))


def _records(path: Path) -> list:
    doc = json.loads(path.read_text(encoding="utf-8"))
    recs = doc.get("records") if isinstance(doc, dict) else doc
    assert isinstance(recs, list) and recs, f"{path.name}: neither a non-empty list nor a dict with records"
    return recs


def test_results_exist():
    assert FILES, f"no records in {RESULTS}"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_records_complete(path):
    problems = [f"record {i}: {', '.join(b)}" for i, r in enumerate(_records(path)) if (b := record_problems(r))]
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def test_checker_rejects_incomplete_records():
    ok = {"command": "uccl-ep-train bench intranode --sms 24", "device": "NVIDIA H200", "gpus": 2,
          "date": "2026-11-23", "commit": "7d8eeea", "timing": "kernel"}
    assert record_problems(ok) == []
    assert record_problems({**ok, "gpus": None, "device": "2x NVIDIA H200"}) != []
    assert record_problems({k: v for k, v in ok.items() if k != "gpus"} | {"device": "2x NVIDIA H200"}) == []
    assert record_problems({**ok, "device": "cpu", "gpus": 0}) == []
    for key, value in (("command", ""), ("device", " "), ("date", "yesterday"), ("commit", "HEAD"),
                       ("timing", "wall"), ("gpus", 0), ("gpus", True)):
        assert record_problems({**ok, key: value}), (key, value)
    for key in ok:
        assert record_problems({k: v for k, v in ok.items() if k != key}), key
