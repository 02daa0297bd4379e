"""The fields every benchmark record carries (tests/test_records.py checks the committed ones; the bench
tests check what the benches write). See test_records.py's docstring for what each field means."""
from __future__ import annotations

import re

TIMINGS = {"api", "kernel"}
COMMIT = re.compile(r"[0-9a-f]{7,40}(-dirty)?")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
COUNT_IN_NAME = re.compile(r"\d+\s*x\s*\S")


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


def assert_complete(records: list) -> None:
    """Every record of `records` (a non-empty list) is complete."""
    assert isinstance(records, list) and records, "no records"
    problems = [f"record {i}: {', '.join(b)}" for i, r in enumerate(records) if (b := record_problems(r))]
    assert not problems, "\n".join(problems)
