"""`uccl-ep-train doctor`: runs anywhere, says clearly when there are no RDMA devices, writes JSON."""
import json

from uccl_ep_train import doctor
from uccl_ep_train.cli import main as cli_main


def test_doctor_reports_rdma_state_and_native_module(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    assert cli_main(["doctor", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert "RDMA devices" in text and "native module" in text
    if not report["rdma"]["devices"]:
        assert "no RDMA devices found" in text
    else:
        for d in report["rdma"]["devices"]:
            assert d["name"] and isinstance(d["ports"], list)
    assert set(report) >= {"rdma", "gpus", "native", "fabric_providers", "knobs"}


def test_doctor_falls_back_to_native_queries_when_pyverbs_is_missing(monkeypatch):
    monkeypatch.setattr(doctor, "_pyverbs_devices", lambda: (None, "pyverbs not usable (test)"))
    report = doctor.collect()
    assert report["rdma"]["pyverbs"] == "pyverbs not usable (test)"
    if report["native"]["importable"]:
        from uccl_ep_train import _native
        if _native.WITH_VERBS:
            assert report["rdma"]["source"] == "native libibverbs"
            assert report["rdma"]["devices"] == [dict(d, source="native") for d in _native.verbs_devices()]


def test_doctor_lists_knobs_in_effect(monkeypatch):
    monkeypatch.setenv("UCCL_EP_PROXY_THREADS", "3")
    assert doctor.collect()["knobs"]["UCCL_EP_PROXY_THREADS"] == "3"
