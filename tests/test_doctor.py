"""`uccl-ep-train doctor`: runs anywhere, says clearly when there are no RDMA devices, writes JSON; the settings
table (config.SETTINGS) is the one list of environment settings: the code reads no other, the README lists all."""
import json
import re
from pathlib import Path

import pytest

from uccl_ep_train.apps import doctor
from uccl_ep_train.apps.cli import main as cli_main


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
    assert set(report) >= {"rdma", "gpus", "native", "fabric_providers", "settings", "unread_settings"}


def test_doctor_falls_back_to_native_queries_when_pyverbs_is_missing(monkeypatch):
    monkeypatch.setattr(doctor, "_pyverbs_devices", lambda: (None, "pyverbs not usable (test)"))
    report = doctor.collect()
    assert report["rdma"]["pyverbs"] == "pyverbs not usable (test)"
    if report["native"]["importable"]:
        from uccl_ep_train import _native
        if _native.WITH_VERBS:
            assert report["rdma"]["source"] == "native libibverbs"
            assert report["rdma"]["devices"] == [dict(d, source="native") for d in _native.verbs_devices()]


def test_doctor_lists_settings_in_effect_and_names_unread_ones(monkeypatch, capsys):
    monkeypatch.setenv("UCCL_EP_PROXY_THREADS", "3")
    monkeypatch.setenv("UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC", "1")  # UCCL-EP's; nothing here reads it
    report = doctor.collect()
    assert report["settings"]["UCCL_EP_PROXY_THREADS"] == "3"
    assert report["unread_settings"] == ["UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC"]
    assert cli_main(["doctor"]) == 0
    assert "read by nothing here (typo? see the README's settings table): UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC" in \
        capsys.readouterr().out


def test_doctor_names_a_leftover_tuning_variable_as_read_by_nothing(monkeypatch, capsys):
    """The intranode kernels' tuning knobs are Config fields now (docs/api.md): a run that still sets one of
    their old variables is told that nothing reads it."""
    monkeypatch.setenv("UCCL_EP_FLAG_BATCH", "8")
    report = doctor.collect()
    assert "UCCL_EP_FLAG_BATCH" in report["unread_settings"] and "UCCL_EP_FLAG_BATCH" not in report["settings"]
    assert cli_main(["doctor"]) == 0
    assert "read by nothing here (typo? see the README's settings table): UCCL_EP_FLAG_BATCH" in capsys.readouterr().out


ROOT = Path(__file__).resolve().parent.parent


def _names_in(paths) -> set:
    names = set()
    for path in paths:
        names |= set(re.findall(r'"(UCCL_(?:EP_|IB_|RDMA_)[A-Z0-9_]+)"', path.read_text()))
    return names


def test_every_setting_the_code_reads_is_in_the_one_table_and_the_readme():
    from uccl_ep_train.config import SETTINGS

    code = [*ROOT.glob("uccl_ep_train/**/*.py"), *ROOT.glob("megatron_patch/*.py"),
            *[p for p in ROOT.glob("csrc/**/*") if p.suffix in (".h", ".cpp", ".cu", ".cuh")]]
    read = _names_in(code) - set(doctor.OTHER_VARS)
    assert read - set(SETTINGS) == set(), "read by the code but missing from config.SETTINGS"
    assert set(SETTINGS) - read == set(), "in config.SETTINGS but read by nothing"
    readme = (ROOT / "README.md").read_text()
    table = set(re.findall(r"^\| `(UCCL_[A-Z0-9_]+)`", readme, flags=re.M))
    assert table == set(SETTINGS), f"README settings table: missing {set(SETTINGS) - table}, extra {table - set(SETTINGS)}"


def test_settings_checked_for_agreement_are_settings():
    from uccl_ep_train.agreement import SHARED_SETTINGS
    from uccl_ep_train.config import SETTINGS

    assert set(SHARED_SETTINGS) <= set(SETTINGS)


def test_a_gpu_machine_without_usable_kernels_is_told_why(monkeypatch, caplog):
    """Buffer warns once, loudly, and doctor prints the reason, when GPUs are present but the native kernels
    cannot serve them (here: simulated, the module built without GPU kernels)."""
    import types

    import torch

    from uccl_ep_train import buffer
    from uccl_ep_train.backends import native

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(native, "_module", lambda: types.SimpleNamespace(WITH_CUDA=False, GPU_ARCHS=""))
    why = native.native_problem()
    assert "built without GPU kernels" in why
    monkeypatch.setattr(buffer, "_announced", set())
    with caplog.at_level("WARNING", logger="uccl_ep_train"):
        buffer._warn_without_native_kernels()
        buffer._warn_without_native_kernels()
    warnings = [r.getMessage() for r in caplog.records if "REFERENCE backend" in r.getMessage()]
    assert len(warnings) == 1 and why in warnings[0]
    assert doctor.collect()["native"]["problem"] == why


def test_doctor_says_what_the_fabric_transport_would_open_or_why_not(monkeypatch):
    """The fabric line runs the transport's own provider selection: for a GPU's proxies (GPU memory asked) on
    tcp, the system libfabric refuses with the transport's sentence; without GPUs it names provider and layout."""
    from uccl_ep_train import proxy
    from uccl_ep_train.apps import doctor

    if "fabric" not in proxy.compiled_transports():
        pytest.skip("the fabric transport is not compiled in")
    from uccl_ep_train import _native

    monkeypatch.setenv("FI_PROVIDER", "tcp")
    monkeypatch.setenv("FI_TCP_IFACE", "lo")
    assert doctor._fabric_choice({"gpus": [{"transport": {"name": "fabric", "provider": "efa",
                                                          "devices": ["rdmap16s27-rdm"]}}]}) == \
        ("efa", "rdmap16s27-rdm")
    assert doctor._fabric_choice({"gpus": []}) == ("tcp", "")
    host = doctor._fabric_probe(_native, ["fabric"], gpus=False, provider="tcp")
    assert host["provider"] == "tcp;ofi_rxm" and not host["gpu_memory_asked"]
    assert "provider tcp;ofi_rxm domain lo" in doctor._render_fabric(host)
    gpu = doctor._fabric_probe(_native, ["fabric"], gpus=True, provider="tcp")
    line = doctor._render_fabric(gpu)
    if "error" in gpu:
        assert "cannot register GPU memory" in line and "UCCL_EP_TRANSPORT=ipc" in line, line
    else:
        assert gpu["hmem"] and "GPU memory yes (FI_HMEM)" in line, line
    assert "not compiled in" in doctor._fabric_probe(_native, [], gpus=True)["error"]
