"""Every committed benchmark record says how, where, when and on what code it was measured.

benchmarks/results/*.json hold a list of records or a dict with "records". Each record needs a non-empty
"command" (as a user types it), "device" (the GPU's name, or "cpu") with a GPU count ("gpus", as
`bench internode` writes it: GPUs the run used, 0 on CPU; or a count in the name itself, "2x NVIDIA H200"),
"date" (YYYY-MM-DD first), "commit" (a git hash) and "timing": "api" (the time includes the host API call)
or "kernel" (GPU time only, no host call in the interval)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
FILES = sorted(RESULTS.glob("*.json"))
TIMINGS = {"api", "kernel"}
COMMIT = re.compile(r"[0-9a-f]{7,40}(-dirty)?")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
COUNT_IN_NAME = re.compile(r"\d+\s*x\s*\S")


def _records(path: Path) -> list:
    doc = json.loads(path.read_text(encoding="utf-8"))
    recs = doc.get("records") if isinstance(doc, dict) else doc
    assert isinstance(recs, list) and recs, f"{path.name}: neither a non-empty list nor a dict with records"
    return recs


def _text(r: dict, key: str) -> str:
    v = r.get(key)
    return v.strip() if isinstance(v, str) else ""


def record_problems(r: dict) -> list[str]:
    """What a record lacks (empty when complete)."""
    if not isinstance(r, dict):
        return ["not an object"]
    bad = [f"no {k}" for k in ("command", "device", "date", "commit") if not _text(r, k)]
    if _text(r, "date") and not DATE.match(_text(r, "date")):
        bad.append(f"date {r['date']!r} does not start YYYY-MM-DD")
    if _text(r, "commit") and not COMMIT.fullmatch(_text(r, "commit")):
        bad.append(f"commit {r['commit']!r} is not a git hash")
    if r.get("timing") not in TIMINGS:
        bad.append(f"timing {r.get('timing')!r} not in {sorted(TIMINGS)}")
    device, gpus = _text(r, "device"), r.get("gpus")
    if "gpus" in r:
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
            bad.append(f"gpus {gpus!r} is not a count")
        elif device and (gpus == 0) != (device.lower() == "cpu"):
            bad.append(f"gpus {gpus} does not match device {device!r}")
    elif device and not COUNT_IN_NAME.match(device):
        bad.append(f"no GPU count: no 'gpus' and device {device!r} does not start with one ('2x ...')")
    return bad


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
