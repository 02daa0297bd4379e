"""GPU -> NIC choice from the PCI topology (uccl_ep_train/nics.py), the transport chosen from the NICs'
kind (proxy.choose_transport), UCCL_EP_NICS and its errors, and the chosen devices reaching the native
proxy threads. sysfs trees shaped like real machines are built by `Host` below (directories, attribute
files and the links sysfs has), not stored as data files."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from uccl_ep_train import nics as N
from uccl_ep_train import proxy as P

NVIDIA, AMD, MELLANOX, BROADCOM, AMAZON = 0x10DE, 0x1002, 0x15B3, 0x14E4, 0x1D0F


class Host:
    """A fake sysfs: PCI devices under sys/devices/pciDDDD:BB/..., linked from sys/bus/pci/devices, and RDMA
    devices under their PCI function, linked from sys/class/infiniband."""

    def __init__(self, root):
        self.root = str(root)
        self._bus = 0
        self._ports: dict[int, int] = {}

    def _next_bus(self) -> int:
        self._bus += 1
        return self._bus

    def _function(self, chain: list[str], numa: int, vendor: int, cls: int, driver: str = "") -> str:
        d = os.path.join(self.root, "sys", "devices", *chain)
        os.makedirs(d, exist_ok=True)
        for name, value in (("vendor", f"0x{vendor:04x}"), ("class", f"0x{cls:06x}"), ("numa_node", str(numa))):
            with open(os.path.join(d, name), "w") as f:
                f.write(value + "\n")
        link = os.path.join(self.root, "sys", "bus", "pci", "devices", chain[-1])
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(d, link)
        if driver:
            drv = os.path.join(self.root, "sys", "bus", "pci", "drivers", driver)
            os.makedirs(drv, exist_ok=True)
            os.symlink(drv, os.path.join(d, "driver"))
        return d

    def root_port(self, domain_bus: int) -> list[str]:
        """A root port of root complex pci0000:<domain_bus>."""
        self._ports[domain_bus] = self._ports.get(domain_bus, 0) + 1
        return [f"pci0000:{domain_bus:02x}", f"0000:{domain_bus:02x}:{self._ports[domain_bus]:02x}.0"]

    def switch(self, parent: list[str]) -> list[str]:
        """A PCIe switch (upstream port) below `parent`; devices below it hang off downstream ports."""
        return parent + [f"0000:{self._next_bus():02x}:00.0"]

    def _slot(self, parent: list[str]) -> list[str]:
        return parent + [f"0000:{self._next_bus():02x}:00.0"]  # a downstream port, then the device below

    def gpu(self, parent: list[str], numa: int, vendor: int = NVIDIA, cls: int = 0x030200) -> str:
        chain = self._slot(parent) + [f"0000:{self._next_bus():02x}:00.0"]
        self._function(chain, numa, vendor, cls)
        return chain[-1]

    def nic(self, parent: list[str], name: str, driver: str, numa: int, state: str = "ACTIVE",
            link: str = "InfiniBand", vendor: int = MELLANOX, fn: int = 0, chain: list[str] | None = None) -> list[str]:
        chain = chain or self._slot(parent) + [f"0000:{self._next_bus():02x}:00.{fn}"]
        d = self._function(chain, numa, vendor, 0x020700 if link == "InfiniBand" else 0x020000, driver)
        ib = os.path.join(d, "infiniband", name)
        os.makedirs(os.path.join(ib, "ports", "1"))
        code = {"ACTIVE": 4, "DOWN": 1, "INIT": 2}[state]
        with open(os.path.join(ib, "ports", "1", "state"), "w") as f:
            f.write(f"{code}: {state}\n")
        with open(os.path.join(ib, "ports", "1", "link_layer"), "w") as f:
            f.write(link + "\n")
        os.symlink(d, os.path.join(ib, "device"))
        cls_dir = os.path.join(self.root, "sys", "class", "infiniband")
        os.makedirs(cls_dir, exist_ok=True)
        os.symlink(ib, os.path.join(cls_dir, name))
        return chain


# -- machines -----------------------------------------------------------------------------------------------
# DGX H100: per socket two PCIe switches, each with two leaf switches holding one H100 and one CX-7; the
# compute NICs are named as on the machine (mlx5_0, 3, 4, 5, 6, 9, 10, 11), the two dual-port storage
# CX-7 cards (mlx5_1/2, mlx5_7/8) sit on root ports of their own.
DGX_COMPUTE = ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"]


def dgx_h100(root) -> tuple[Host, list[str]]:
    h = Host(root)
    gpus = []
    for i in range(8):
        numa = i // 4
        if i % 2 == 0:
            top = h.switch(h.root_port(0x10 * (1 + i // 2)))
        leaf = h.switch(h._slot(top))
        gpus.append(h.gpu(leaf, numa))
        h.nic(leaf, DGX_COMPUTE[i], "mlx5_core", numa)
    for numa, names in ((0, ("mlx5_1", "mlx5_2")), (1, ("mlx5_7", "mlx5_8"))):
        port = h.root_port(0x10 * (1 + 2 * numa))
        bus = h._next_bus()
        for fn, name in enumerate(names):  # one card on the root port, a function per port
            h.nic(port, name, "mlx5_core", numa, link="Ethernet", chain=port + [f"0000:{bus:02x}:00.{fn}"])
    return h, gpus


def p5en(root) -> tuple[Host, list[str], list[tuple[str, str]]]:
    """AWS p5en: 8 H200 and 16 EFA devices, a GPU and two EFAs under each PCIe switch."""
    h = Host(root)
    gpus, pairs = [], []
    for i in range(8):
        sw = h.switch(h.root_port(0x20 * (1 + i // 2)))
        gpus.append(h.gpu(sw, i // 4))
        names = []
        for _ in range(2):
            bus = h._bus + 2
            name = f"rdmap{bus}s0"
            h.nic(sw, name, "efa", i // 4, link="Unspecified", vendor=AMAZON)
            names.append(name)
        pairs.append(tuple(names))
    return h, gpus, pairs


def mi300x_thor2(root) -> tuple[Host, list[str]]:
    """8 MI300X (processing accelerators) and 8 Broadcom Thor-2 (bnxt_re), a pair under each switch; the
    NICs are numbered against the GPUs' order to show the choice follows the topology, not names."""
    h = Host(root)
    gpus = []
    for i in range(8):
        sw = h.switch(h.root_port(0x40 + 0x10 * i))
        gpus.append(h.gpu(sw, i // 4, vendor=AMD, cls=0x120000))
        h.nic(sw, f"bnxt_re{7 - i}", "bnxt_en", i // 4, link="Ethernet", vendor=BROADCOM)
    return h, gpus


@pytest.fixture(autouse=True)
def _no_setting(monkeypatch):
    for var in ("UCCL_EP_NICS", "UCCL_EP_TRANSPORT", "LOCAL_RANK", "UCCL_EP_VERBS_DEVICE", "FI_PROVIDER"):
        monkeypatch.delenv(var, raising=False)


def _map(root, setting=None):
    gpus = N.read_gpus(root)
    return {g.bus_id: N.choose_nics(g.bus_id, i, root=root, setting=setting) for i, g in enumerate(gpus)}


# -- the GPU -> NIC map ---------------------------------------------------------------------------------------
def test_dgx_h100_each_gpu_takes_the_cx7_of_its_switch_and_never_a_storage_nic(tmp_path):
    _, gpus = dgx_h100(tmp_path)
    got = _map(str(tmp_path))
    assert [got[g].devices for g in gpus] == [(n,) for n in DGX_COMPUTE]
    assert all(c.reason == N.REASON_SWITCH and c.kind == "mlx5" for c in got.values())
    assert len(N.read_nics(str(tmp_path))) == 12
    choice = P.choose_transport(got[gpus[0]], ["fabric", "verbs"], same_host=False, gpu=0)
    assert (choice.transport, choice.devices) == ("verbs", ("mlx5_0",))


def test_p5en_two_efa_devices_per_gpu_and_the_efa_provider(tmp_path):
    _, gpus, pairs = p5en(tmp_path)
    got = _map(str(tmp_path))
    assert [got[g].devices for g in gpus] == pairs
    assert {c.kind for c in got.values()} == {"efa"}
    choice = P.choose_transport(got[gpus[3]], ["fabric", "verbs"], same_host=False, gpu=3)
    assert choice.transport == "fabric" and choice.provider == "efa"
    assert choice.devices == tuple(f"{d}-rdm" for d in pairs[3])  # the efa provider's domain names
    # libibverbs lists EFA devices too, but they have no RC QPs: verbs is refused, saying what to set
    with pytest.raises(ValueError, match="verbs cannot run on EFA.*unset UCCL_EP_TRANSPORT"):
        P.choose_transport(got[gpus[3]], ["fabric", "verbs"], same_host=False, gpu=3, requested="verbs")
    # another provider asked for: no efa domain names handed to it
    tcp = P.choose_transport(got[gpus[3]], ["fabric"], same_host=False, gpu=3, provider="tcp")
    assert (tcp.provider, tcp.devices) == ("tcp", ())


def test_mi300x_with_thor2_follows_the_switches_not_the_names(tmp_path):
    _, gpus = mi300x_thor2(tmp_path)
    assert [g.vendor for g in N.read_gpus(str(tmp_path))] == ["amd"] * 8
    got = _map(str(tmp_path))
    assert [got[g].devices for g in gpus] == [(f"bnxt_re{7 - i}",) for i in range(8)]
    choice = P.choose_transport(got[gpus[5]], ["fabric", "verbs"], same_host=False, gpu=5)
    assert (choice.transport, choice.devices, choice.provider) == ("verbs", ("bnxt_re2",), None)


def test_nics_on_the_other_socket_are_a_fallback_shared_fairly(tmp_path):
    h = Host(tmp_path)
    gpus = [h.gpu(h.switch(h.root_port(0x10 + i)), 0) for i in range(2)]      # socket 0
    gpus += [h.gpu(h.switch(h.root_port(0x80 + i)), 1) for i in range(2)]     # socket 1
    for i in range(2):
        h.nic(h.root_port(0xa0 + i), f"mlx5_{i}", "mlx5_core", 1)            # socket 1, own root ports
    got = _map(str(tmp_path))
    assert [got[g].devices for g in gpus] == [("mlx5_0",), ("mlx5_1",), ("mlx5_0",), ("mlx5_1",)]
    assert [got[g].reason for g in gpus] == [N.REASON_FALLBACK] * 2 + [N.REASON_NUMA] * 2


def test_gpus_sharing_a_switch_share_its_nics_fairly(tmp_path):
    h = Host(tmp_path)
    sw = h.switch(h.root_port(0x10))
    gpus = [h.gpu(sw, 0), h.gpu(sw, 0)]
    h.nic(sw, "mlx5_1", "mlx5_core", 0)
    h.nic(sw, "mlx5_0", "mlx5_core", 0)
    got = _map(str(tmp_path))
    assert [got[g].devices for g in gpus] == [("mlx5_0",), ("mlx5_1",)]


def test_a_nic_whose_port_is_down_is_skipped(tmp_path):
    h = Host(tmp_path)
    gpus = []
    for i, state in enumerate(("DOWN", "ACTIVE")):
        sw = h.switch(h.root_port(0x10 + i))
        gpus.append(h.gpu(sw, 0))
        h.nic(sw, f"mlx5_{i}", "mlx5_core", 0, state=state)
    got = _map(str(tmp_path))
    assert got[gpus[0]].devices == ("mlx5_1",) and got[gpus[0]].reason == N.REASON_NUMA
    assert got[gpus[1]].devices == ("mlx5_1",) and got[gpus[1]].reason == N.REASON_SWITCH
    assert "mlx5_0 (mlx5, no ACTIVE port)" in got[gpus[0]].found
    with pytest.raises(ValueError, match="UCCL_EP_NICS: local rank 0's mlx5_0 has no ACTIVE port"):
        N.choose_nics(gpus[0], 0, root=str(tmp_path), setting="*=mlx5_0")


def test_no_rdma_nic_means_fabric_over_tcp_across_hosts_and_ipc_on_one(tmp_path):
    h = Host(tmp_path)
    gpu = h.gpu(h.switch(h.root_port(0x10)), 0)
    c = N.choose_nics(gpu, 0, root=str(tmp_path))
    assert (c.devices, c.kind, c.reason) == ((), "", N.REASON_NONE)
    across = P.choose_transport(c, ["fabric", "ipc", "verbs"], same_host=False, gpu=0)
    assert (across.transport, across.provider, across.devices) == ("fabric", "tcp", ())
    assert P.choose_transport(c, ["fabric", "ipc", "verbs"], same_host=True, gpu=0).transport == "ipc"
    asked = P.choose_transport(c, ["fabric", "ipc"], same_host=True, gpu=0, requested="fabric")
    assert (asked.transport, asked.provider) == ("fabric", None)  # asked for: libfabric's choice (or FI_PROVIDER)
    with pytest.raises(ValueError, match="verbs found no RDMA devices with an ACTIVE port.*UCCL_EP_TRANSPORT=fabric"):
        P.choose_transport(c, ["fabric", "verbs"], same_host=False, gpu=0, requested="verbs")


def test_unknown_gpu_or_cpu_ranks_spread_over_the_nics_by_local_rank(tmp_path):
    dgx_h100(tmp_path)
    root = str(tmp_path)
    picks = [N.choose_nics(None, r, root=root).devices[0] for r in range(3)]
    assert picks == ["mlx5_0", "mlx5_1", "mlx5_10"] and len(set(picks)) == 3
    assert N.choose_nics("0000:ff:00.0", 1, root=root).reason == N.REASON_UNKNOWN_GPU


# -- transport choice -----------------------------------------------------------------------------------------
def test_transport_not_compiled_in_names_the_fix():
    rc = N.NicChoice(("mlx5_0",), "mlx5", N.REASON_SWITCH)
    with pytest.raises(ValueError, match="transport verbs .*not compiled in.*infiniband/verbs.h"):
        P.choose_transport(rc, ["fabric"], same_host=False, gpu=0)
    with pytest.raises(ValueError, match="must be one of fabric, ipc, verbs, got 'rdma'"):
        P.choose_transport(rc, ["fabric"], same_host=False, gpu=0, requested="rdma")
    unknown = P.choose_transport(N.NicChoice(("qedr0",), "qede", N.REASON_NUMA), ["verbs"], False, 0)
    assert unknown.transport == "verbs" and "assumed RC" in unknown.reason


def test_a_bad_nics_setting_fails_only_the_transports_that_open_nics():
    """ipc opens no NIC: UCCL_EP_NICS may be wrong for it (one setting for a job that also runs across hosts);
    verbs and fabric open the NICs it names, so there it is an error, with the setting's own message."""
    bad = N.NicChoice((), "", "not chosen", error="UCCL_EP_NICS names no_such_nic0, not an RDMA device of this host")
    every = ["fabric", "ipc", "verbs"]
    assert P.choose_transport(bad, every, same_host=True, gpu=0).transport == "ipc"
    asked = P.choose_transport(bad, every, same_host=False, gpu=-1, requested="ipc")
    assert (asked.transport, asked.devices, asked.provider) == ("ipc", (), None)
    for requested in (None, "fabric", "verbs"):
        with pytest.raises(ValueError, match="^UCCL_EP_NICS names no_such_nic0"):
            P.choose_transport(bad, every, same_host=False, gpu=0, requested=requested)
    with pytest.raises(ValueError, match="^UCCL_EP_NICS names no_such_nic0"):  # one host, but CPU ranks: fabric
        P.choose_transport(bad, every, same_host=True, gpu=-1)


def test_an_ipc_group_runs_with_a_bad_nics_setting_and_logs_it(monkeypatch, caplog):
    """The setting's error travels to the transport choice, not ahead of it: an ipc ProxyGroup gets past the
    choice with one log line (here it then stops at the native ipc transport, which needs a GPU: that error, not
    the setting's), while a verbs group fails on the setting, naming it."""
    if not P.available():
        pytest.skip("native module not built")
    monkeypatch.setattr(P, "compiled_transports", lambda: ["fabric", "ipc", "verbs"])
    monkeypatch.setenv("UCCL_EP_NICS", "1=no_such_nic0")   # this rank is local rank 0: no entry for it
    choices = P._local_choices(-1, "ipc", None)
    assert all(c[0].transport == "ipc" and "no entry for local rank 0" in c[1].error for c in choices.values())
    with caplog.at_level("INFO", logger="uccl_ep_train"), \
            pytest.raises(RuntimeError, match="needs a GPU|not compiled in|needs CUDA") as got:
        P.ProxyGroup(0, 1, {0: np.zeros(64, np.uint8)}, transport="ipc", gpu=-1, pin_threads=False)
    assert "UCCL_EP_NICS" not in str(got.value)
    assert any("ipc transport opens no NIC; ignored: UCCL_EP_NICS has no entry for local rank 0" in r.getMessage()
               for r in caplog.records), caplog.text
    with pytest.raises(RuntimeError, match="no usable transport: rank 0: UCCL_EP_NICS has no entry for local rank 0"):
        P.ProxyGroup(0, 1, {0: np.zeros(64, np.uint8)}, transport="verbs", pin_threads=False)


def test_ranks_that_disagree_or_fail_raise_the_same_error_everywhere():
    rc = N.NicChoice(("mlx5_0",), "mlx5", N.REASON_SWITCH)
    efa = N.NicChoice(("rdmap1s0",), "efa", N.REASON_SWITCH)
    per_rank = [(P.choose_transport(c, ["fabric", "verbs"], False, 0), c) for c in (rc, efa)]
    for rank in (0, 1):
        with pytest.raises(RuntimeError, match="ranks chose different transports: rank 0: verbs.*rank 1: fabric"):
            P._agree(per_rank, rank)
    with pytest.raises(RuntimeError, match="rank 1: UCCL_EP_NICS"):
        P._agree([per_rank[0], "UCCL_EP_NICS has no entry for local rank 1"], 0)
    assert P._agree(per_rank[:1], 0)[0].devices == ("mlx5_0",)


@pytest.mark.parametrize("profile, kind", [("cx7", "mlx5"), ("efa", "efa"), ("thor2", "bnxt_re"),
                                           ("pollara", "ionic")])
def test_launcher_nic_profiles_agree_with_the_automatic_choice(profile, kind):
    from uccl_ep_train.apps.recipes import nic_env
    env = nic_env(profile)
    nics = N.NicChoice(("nic0", "nic1"), kind, N.REASON_SWITCH)
    auto = P.choose_transport(nics, ["fabric", "verbs"], same_host=False, gpu=0)
    assert auto.transport == ("fabric" if kind == "efa" else "verbs")
    assert P.choose_transport(nics, ["fabric", "verbs"], same_host=False, gpu=0,
                              requested=env.get("UCCL_EP_TRANSPORT"), provider=env.get("FI_PROVIDER")) == auto


# -- UCCL_EP_NICS -----------------------------------------------------------------------------------------------
def test_setting_map_ranges_and_default(tmp_path):
    _, gpus = dgx_h100(tmp_path)
    root = str(tmp_path)
    setting = "0=mlx5_3;1-2=mlx5_4,mlx5_5;*=mlx5_0"
    got = [N.choose_nics(gpus[r], r, root=root, setting=setting) for r in range(4)]
    assert [c.devices for c in got] == [("mlx5_3",), ("mlx5_4", "mlx5_5"), ("mlx5_4", "mlx5_5"), ("mlx5_0",)]
    assert {c.reason for c in got} == {N.REASON_SETTING}


def test_setting_filters_restrict_or_exclude_the_automatic_choice(tmp_path):
    _, gpus = dgx_h100(tmp_path)
    root = str(tmp_path)
    # without the compute NICs the GPUs fall back to the storage NICs of their socket, shared fairly
    exclude = "^" + ",".join(DGX_COMPUTE)
    got = [N.choose_nics(g, i, root=root, setting=exclude) for i, g in enumerate(gpus)]
    assert [c.devices for c in got] == [("mlx5_1",), ("mlx5_1",), ("mlx5_2",), ("mlx5_2",),
                                        ("mlx5_7",), ("mlx5_7",), ("mlx5_8",), ("mlx5_8",)]
    assert got[0].reason == N.REASON_NUMA + " (UCCL_EP_NICS filter)"
    only = N.choose_nics(gpus[2], 2, root=root, setting="mlx5_4,mlx5_9")
    assert only.devices == ("mlx5_4",) and only.reason.startswith(N.REASON_SWITCH)


@pytest.mark.parametrize("setting, message", [
    ("", "set but empty"),
    ("0=mlx5_0;0=mlx5_1", "local rank 0 is given twice"),
    ("gpu0=mlx5_0", "'gpu0' in entry 'gpu0=mlx5_0' is not a local rank"),
    ("3-1=mlx5_0", "range '3-1' is empty"),
    ("0=", "must be LOCAL_RANK=DEVICE"),
    ("0=mlx5 0", "'mlx5 0' is not an RDMA device name"),
    ("*=mlx5_0;*=mlx5_1", "'\\*' is given twice"),
    ("mlx5_0,mlx5_0", "named twice"),
])
def test_setting_syntax_errors(setting, message):
    with pytest.raises(ValueError, match=message):
        N.parse_nics_setting(setting)


def test_setting_errors_against_the_host(tmp_path):
    _, gpus = dgx_h100(tmp_path)
    root = str(tmp_path)
    with pytest.raises(ValueError, match="names mlx5_99, not an RDMA device of this host.*mlx5_0 \\(mlx5"):
        N.choose_nics(gpus[0], 0, root=root, setting="*=mlx5_99")
    with pytest.raises(ValueError, match="no entry for local rank 5; add `5=DEVICE` or `\\*=DEVICE`"):
        N.choose_nics(gpus[5], 5, root=root, setting="0-4=mlx5_0")
    with pytest.raises(ValueError, match="names mlx5_42"):
        N.choose_nics(gpus[0], 0, root=root, setting="^mlx5_42")


def test_setting_mixing_kinds_is_refused(tmp_path):
    h = Host(tmp_path)
    sw = h.switch(h.root_port(0x10))
    gpu = h.gpu(sw, 0)
    h.nic(sw, "mlx5_0", "mlx5_core", 0)
    h.nic(sw, "rdmap9s0", "efa", 0, vendor=AMAZON)
    with pytest.raises(ValueError, match="mixes NIC kinds"):
        N.choose_nics(gpu, 0, root=str(tmp_path), setting="0=mlx5_0,rdmap9s0")
    # the automatic choice keeps one kind
    assert N.choose_nics(gpu, 0, root=str(tmp_path)).devices == ("mlx5_0",)


def test_verbs_device_setting_means_one_device_for_every_rank(tmp_path, monkeypatch):
    _, gpus = dgx_h100(tmp_path)
    monkeypatch.setenv("UCCL_EP_VERBS_DEVICE", "mlx5_9")
    c = N.choose_nics(gpus[0], 0, root=str(tmp_path))
    assert c.devices == ("mlx5_9",) and c.reason == N.REASON_SETTING
    monkeypatch.setenv("UCCL_EP_NICS", "mlx5_0")
    with pytest.raises(ValueError, match="both UCCL_EP_NICS and UCCL_EP_VERBS_DEVICE are set"):
        N.choose_nics(gpus[0], 0, root=str(tmp_path))


def test_setting_key_is_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert N.local_rank(0) == 3
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK='x' is not an int"):
        N.local_rank(0)
    monkeypatch.delenv("LOCAL_RANK")
    assert N.local_rank(2) == 2 and N.local_rank(-1) == 0


# -- doctor --------------------------------------------------------------------------------------------------------
def test_doctor_prints_each_gpus_nics_with_the_reason_and_the_transport(tmp_path, monkeypatch):
    from uccl_ep_train.apps import doctor
    _, gpus, pairs = p5en(tmp_path)
    m = doctor._nic_map(["fabric", "ipc", "verbs"], root=str(tmp_path))
    assert [g["devices"] for g in m["gpus"]] == [list(p) for p in pairs]
    text = "\n".join(doctor._render_nics(m))
    assert f"[0] {gpus[0]} -> {', '.join(pairs[0])} (efa): same PCIe switch" in text
    assert f"transport across hosts: fabric (provider efa), threads open {pairs[0][0]}-rdm" in text
    assert "on one host: ipc" in text
    monkeypatch.setenv("UCCL_EP_NICS", "0=rdmap1s0")
    text = "\n".join(doctor._render_nics(doctor._nic_map(["fabric"], root=str(tmp_path))))
    assert f"[0] {gpus[0]}: ERROR UCCL_EP_NICS names rdmap1s0" in text
    assert f"[1] {gpus[1]}: ERROR UCCL_EP_NICS has no entry for local rank 1" in text


# -- devices reach the native proxy threads ---------------------------------------------------------------------
needs_fabric = pytest.mark.skipif(not P.available() or "fabric" not in P.compiled_transports(),
                                  reason="native module with the fabric transport not built")


@needs_fabric
def test_native_proxy_threads_open_devices_round_robin_and_report_them(monkeypatch):
    from uccl_ep_train import _native
    monkeypatch.setenv("FI_TCP_IFACE", "lo")
    with pytest.raises(RuntimeError, match=r"devices\[1\] is empty"):
        _native.Proxy(0, 1, transport="fabric", provider="tcp", devices=["lo", ""], pin_threads=False)
    p = _native.Proxy(0, 1, transport="fabric", provider="tcp", devices=["lo"], num_threads=3, pin_threads=False)
    try:
        assert p.config()["devices"] == ["lo"] and p.config()["thread_devices"] == ["lo"] * 3
    finally:
        p.stop()
    p = _native.Proxy(0, 1, transport="fabric", provider="tcp", num_threads=2, pin_threads=False)
    try:
        assert p.config()["thread_devices"] == ["", ""]
    finally:
        p.stop()


@needs_fabric
def test_proxy_group_hands_its_choice_to_the_native_threads(monkeypatch):
    """The TransportChoice's devices travel ProxyGroup -> native Proxy -> each thread's TransportOptions
    (here the tcp provider's domain `lo`: a real name for the one libfabric provider that runs here)."""
    monkeypatch.setenv("FI_TCP_IFACE", "lo")
    monkeypatch.setenv("FI_PROVIDER", "tcp")
    real = P.choose_transport
    monkeypatch.setattr(P, "choose_transport", lambda *a, **k: P.TransportChoice(
        "fabric", "tcp", ("lo",), real(*a, **k).reason))
    buf = np.zeros(4096, np.uint8)
    with P.ProxyGroup(0, 1, {0: buf}, num_threads=2, pin_threads=False) as g:
        assert g.transport == "fabric" and g.devices == ("lo",)
        assert g.config()["thread_devices"] == ["lo", "lo"] and g.config()["provider"] == "tcp"
        g.push(1, P.make_commands([(P.OP_WRITE_IMM, 0, 1, 0, 8, 0, 64)]))
        g.wait_seq(0, 1, 1, timeout_s=20)


def _bad_setting_rank(rank, world, device):
    from uccl_ep_train import proxy as Q
    if rank == 1:  # a map without an entry for local rank 1
        os.environ["UCCL_EP_NICS"] = "0=mlx5_0"
    try:
        Q.ProxyGroup(rank, world, {0: np.zeros(64, np.uint8)}, transport="fabric", num_threads=1,
                     pin_threads=False)
    except RuntimeError as e:
        return str(e)
    return "no error"


@needs_fabric
def test_a_bad_setting_on_one_rank_fails_every_rank():
    from dist_utils import run_ranks
    out = run_ranks(_bad_setting_rank, 2, env={"FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo"}, timeout=120)
    assert out[0] == out[1]
    assert out[0].startswith("ProxyGroup: no usable transport: rank 1: UCCL_EP_NICS"), out[0]


# -- on a GPU machine --------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_bus_ids_match_sysfs_and_respect_cuda_visible_devices():
    real = {g.bus_id for g in N.read_gpus()}
    ids = [N.gpu_bus_id(i) for i in range(torch.cuda.device_count())]
    assert ids and all(i in real for i in ids), (ids, real)
    last = torch.cuda.device_count() - 1
    code = "from uccl_ep_train.nics import gpu_bus_id; print(gpu_bus_id(0))"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(last))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == ids[last], out.stderr
    for i, bus in enumerate(ids):  # the real host's choice is well formed, whatever NICs it has
        c = N.choose_nics(bus, i)
        assert (c.devices == ()) == (c.reason == N.REASON_NONE)


@pytest.mark.gpu
def test_native_ipc_proxy_reports_each_threads_device():
    if not P.available() or "ipc" not in P.compiled_transports():
        pytest.skip("native module without the ipc transport")
    from uccl_ep_train import _native
    p = _native.Proxy(0, 1, gpu=0, transport="ipc", job=f"nics-{os.getpid()}", devices=["mlx5_0", "mlx5_3"], num_threads=3,
                      pin_threads=False)
    try:
        assert p.config()["thread_devices"] == ["mlx5_0", "mlx5_3", "mlx5_0"]
    finally:
        p.stop()
