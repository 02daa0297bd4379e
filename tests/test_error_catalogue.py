"""docs/errors.md, the catalogue of every error message, is generated from the sources by
scripts/error_catalogue.py: it must match what the sources make now, and hold the messages we know of."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def catalogue():
    """The generator, loaded from its file (scripts/ is no package); registered while it runs, as its
    dataclasses look their module up in sys.modules."""
    spec = importlib.util.spec_from_file_location("error_catalogue", ROOT / "scripts" / "error_catalogue.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


@pytest.fixture(scope="module")
def entries(catalogue):
    found, failed = catalogue.collect(ROOT)
    assert not failed, f"native calls the generator could not parse: {failed}"
    return found


def test_docs_up_to_date(catalogue, entries):
    on_disk = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    assert on_disk == catalogue.render(entries), "docs/errors.md is out of date: run python scripts/error_catalogue.py"


def test_known_messages_listed(entries):
    templates = [e.template for e in entries]
    # the host's bad expert id, worded by uccl_ep_train/errors.py bad_expert_id and resolved through the call
    bad_id = [e for e in entries if e.template.startswith("{arg}[{row}, {col}] = {value} is outside [-1, ")]
    assert bad_id and all(e.via == "bad_expert_id()" and e.via_at == "uccl_ep_train/errors.py"
                          for e in bad_id)
    assert any("must be contiguous" in t for t in templates)
    # a UCCL_CHECK of csrc, its condition stringified as the macro does
    assert any(e.path == "csrc/kernels/layout.cu" and e.template == "check failed: num_ranks >= 1: num_ranks "
               "{num_ranks} must be >= 1" for e in entries)
    # the kernels' records: every code of describe_error and a phase's wording
    records = {e.where for e in entries if e.path == "csrc/common/errors.cpp"}
    assert {"describe_error: kErrTimeout", "describe_error: kErrBadExpert", "describe_error: kErrAborted"} <= records
    assert "'dispatch (notify)': {peer} never started this dispatch (its counts did not arrive)" in templates


def test_every_area_has_messages(catalogue, entries):
    counts = {key: sum(e.area == key for e in entries) for key, _, _ in catalogue.AREAS}
    assert all(counts.values()), counts


def test_no_absolute_paths(entries):
    text = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    assert str(ROOT) not in text
    for e in entries:
        assert not Path(e.path).is_absolute() and (ROOT / e.path).is_file(), e
        assert not e.via_at or not Path(e.via_at).is_absolute(), e
