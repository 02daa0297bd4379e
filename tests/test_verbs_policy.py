"""The verbs transport's NIC-free decisions, on CPU: GID choice over GID tables of real hosts, the UCCL_IB_*
QP settings, CQ / SRQ depths for the worst case in flight, vendor flow-control defaults, the GPU-memory
registration report of `doctor`, and the connect barrier of ProxyGroup (every rank hears of a failed
connect before any rank starts). What needs a NIC (QPs reaching RTS, registrations) is not tested here."""
import ipaddress
import threading

import pytest

from uccl_ep_train import proxy as P
from uccl_ep_train.apps import doctor
from uccl_ep_train.apps.recipes import NIC_PROFILES
from uccl_ep_train.config import NIC_FLOW_CONTROL, SETTINGS, nic_flow_control

native = pytest.importorskip("uccl_ep_train._native")
needs_policy = pytest.mark.skipif(not hasattr(native, "verbs_choose_gid"), reason="native module without verbs policy")

V1, V2 = "IB/RoCE v1", "RoCE v2"  # sysfs gid_attrs/types text
EMPTY = bytes(16)


def gid(addr: str) -> bytes:
    a = ipaddress.ip_address(addr)
    return (a if a.version == 6 else ipaddress.IPv6Address(f"::ffff:{addr}")).packed


def entries(*rows):
    return [(i, gid(a) if a else EMPTY, t if a else "") for i, (a, t) in enumerate(rows)]


# ConnectX-7 RoCE port with one IPv4 address: the usual v1 / v2 pairs, link-local first.
CX7_ROCE = entries(("fe80::b8ce:f6ff:fe01:2345", V1), ("fe80::b8ce:f6ff:fe01:2345", V2),
                   ("10.10.1.5", V1), ("10.10.1.5", V2))
# Thor-2 port with a global IPv6 address ahead of the IPv4 one: index 3 is RoCE v2 but IPv6.
THOR2_V6_FIRST = entries(("fe80::1", V1), ("fe80::1", V2), ("2001:db8::5", V1), ("2001:db8::5", V2),
                         ("10.20.0.7", V1), ("10.20.0.7", V2))
IPV6_ONLY = entries(("fe80::2", V1), ("fe80::2", V2), ("2001:db8:1::9", V1), ("2001:db8:1::9", V2))
# Address not configured yet: only link-local entries, then empty ones (reads as zeros through ibv_query_gid).
NO_ADDRESS = entries(("fe80::3", V1), ("fe80::3", V2), (None, None), (None, None))
V1_ONLY = entries(("fe80::4", V1), ("10.30.0.2", V1))


@needs_policy
@pytest.mark.parametrize("table, index, why", [
    (CX7_ROCE, 3, "IPv4"), (THOR2_V6_FIRST, 5, "IPv4"), (IPV6_ONLY, 3, "IPv6")])
def test_roce_gid_is_found_by_type_and_address(table, index, why):
    got, reason = native.verbs_choose_gid(table, True, -1, "mlx5_0 port 1")
    assert got == index and why in reason


@needs_policy
def test_infiniband_uses_gid_0():
    ib = [(0, bytes.fromhex("fe800000000000000c42a10300aabbcc"), "IB")]
    assert native.verbs_choose_gid(ib, False, -1, "mlx5_0 port 1")[0] == 0


@needs_policy
@pytest.mark.parametrize("table", [NO_ADDRESS, V1_ONLY, entries((None, None), (None, None))])
def test_no_routable_roce_v2_entry_is_an_error_naming_the_device_and_the_way_out(table):
    with pytest.raises(ValueError, match=r"bnxt_re0 port 1 has no RoCE v2 GID.*UCCL_IB_GID_INDEX"):
        native.verbs_choose_gid(table, True, -1, "bnxt_re0 port 1")


@needs_policy
def test_gid_index_override_is_checked():
    assert native.verbs_choose_gid(V1_ONLY, True, 1, "x")[0] == 1  # the user may pick RoCE v1 on purpose
    assert native.verbs_choose_gid(THOR2_V6_FIRST, True, 3, "x")[0] == 3
    with pytest.raises(ValueError, match=r"UCCL_IB_GID_INDEX=3: GID 3 of ionic_0 port 1 is empty"):
        native.verbs_choose_gid(NO_ADDRESS, True, 3, "ionic_0 port 1")
    with pytest.raises(ValueError, match=r"UCCL_IB_GID_INDEX=9: GID 9 of ionic_0 port 1 does not exist"):
        native.verbs_choose_gid(CX7_ROCE, True, 9, "ionic_0 port 1")


@needs_policy
def test_qp_settings_defaults_agree_with_the_settings_table():
    got = native.verbs_settings({})
    for name, value in got.items():
        assert SETTINGS[name][0].split()[0] == str(value), name
    assert got["UCCL_IB_TIMEOUT"] == 20 and got["UCCL_IB_RNR_RETRY"] < 7  # NCCL's timeout; finite RNR retries


@needs_policy
def test_qp_settings_are_read_and_bad_ones_named():
    got = native.verbs_settings({"UCCL_IB_TIMEOUT": "22", "UCCL_IB_RETRY_CNT": "5", "UCCL_IB_SL": "3",
                                 "UCCL_IB_TC": "106", "UCCL_IB_GID_INDEX": "3", "UCCL_IB_RNR_RETRY": "7"})
    assert got == {"UCCL_IB_TIMEOUT": 22, "UCCL_IB_RETRY_CNT": 5, "UCCL_IB_RNR_RETRY": 7, "UCCL_IB_SL": 3,
                   "UCCL_IB_TC": 106, "UCCL_IB_GID_INDEX": 3}
    for name, bad in [("UCCL_IB_TIMEOUT", "32"), ("UCCL_IB_RETRY_CNT", "8"), ("UCCL_IB_SL", "x"),
                      ("UCCL_IB_TC", "256"), ("UCCL_IB_RNR_RETRY", "-1"), ("UCCL_IB_GID_INDEX", "3a")]:
        with pytest.raises(ValueError, match=rf"{name}={bad} must be an integer in \["):
            native.verbs_settings({name: bad})


CX7_LIMITS = dict(max_cqe=4194303, max_srq_wr=32767, max_qp_wr=32768)


@needs_policy
def test_queues_hold_the_worst_case_in_flight_at_ep256():
    d = native.verbs_queue_depths(256, 32, **CX7_LIMITS, device="mlx5_0")  # low-latency proxies at EP256
    assert d["srq"] >= 256 * 32  # every peer's in-flight operations consume one receive here (was 1024)
    assert d["cq"] >= 256 * 32 + d["srq"] > 8192  # a send completion per operation + a receive per arrival
    assert d["send_wr"] == 64  # a native atomic is two WRs
    assert d["cq"] <= CX7_LIMITS["max_cqe"] and d["srq"] <= CX7_LIMITS["max_srq_wr"]


@needs_policy
def test_queue_depths_are_clamped_and_a_device_too_small_is_named():
    need = 64 * 8 + 64 * 8 + 256
    assert native.verbs_queue_depths(64, 8, max_cqe=need + 10, max_srq_wr=32767, max_qp_wr=4096)["cq"] == need + 10
    with pytest.raises(ValueError, match=r"bnxt_re0 allows max_srq_wr=8191, the worst case needs 8448 .*"
                                         r"256 ranks and 32 .*UCCL_IB_MAX_INFLIGHT_NORMAL"):
        native.verbs_queue_depths(256, 32, max_cqe=1 << 20, max_srq_wr=8191, max_qp_wr=4096, device="bnxt_re0")
    with pytest.raises(ValueError, match=r"max_cqe=4096"):
        native.verbs_queue_depths(256, 8, max_cqe=4096, max_srq_wr=32767, max_qp_wr=4096, device="x")
    with pytest.raises(ValueError, match=r"in-flight limit \(0\)"):
        native.verbs_queue_depths(8, 0, **CX7_LIMITS)


def test_vendor_flow_control_comes_from_the_device_and_the_user_wins():
    thor = [{"name": "bnxt_re0", "vendor_id": 0x14E4}, {"name": "bnxt_re1", "vendor_id": 0x14E4}]
    pollara = [{"name": "ionic_0", "vendor_id": 0x1DD8}]
    cx7 = [{"name": "mlx5_0", "vendor_id": 0x02C9}]
    assert nic_flow_control(thor, env={})[0] == {"max_inflight_bytes": 1572864, "max_inflight": 1}
    assert nic_flow_control(pollara, env={})[0] == {"max_inflight_bytes": 2097152, "max_inflight": 1}
    assert nic_flow_control([{"name": "rdma0", "vendor_id": 0x1DD8}], env={})[0]["max_inflight_bytes"] == 2097152
    assert nic_flow_control(cx7, env={}) == ({}, "")
    assert nic_flow_control(pollara, low_latency=True, env={})[0] == {"max_inflight_bytes": 2097152}
    assert nic_flow_control(thor, env={"UCCL_IB_MAX_INFLIGHT_BYTES": "1048576"})[0] == {"max_inflight": 1}
    assert nic_flow_control(cx7 + thor, env={"UCCL_EP_VERBS_DEVICE": "mlx5_0"})[0] == {}
    assert nic_flow_control(cx7 + thor + pollara, env={})[0]["max_inflight_bytes"] == 1572864  # the strictest
    assert "Broadcom Thor-2" in nic_flow_control(thor, env={})[1]


def test_recipe_nic_profiles_quote_the_one_flow_control_table():
    assert NIC_PROFILES["thor2"] == {"UCCL_IB_MAX_INFLIGHT_BYTES": "1572864", "UCCL_IB_MAX_INFLIGHT_NORMAL": "1"}
    assert NIC_PROFILES["pollara"] == NIC_FLOW_CONTROL["ionic"].env()


def test_doctor_reports_gpu_memory_registration_per_vendor():
    reg = doctor.gpu_memory_registration
    nv = reg("nvidia", ["nvidia_peermem", "nvidia", "mlx5_ib"], True)
    assert nv["ok"] and nv["methods"] == ["peer memory (nvidia_peermem)", "DMA-BUF"]
    assert reg("nvidia", ["nv_peer_mem"], False)["peer_memory"] == "nv_peer_mem"
    bare = reg("nvidia", ["nvidia", "mlx5_ib"], False)
    assert not bare["ok"] and "modprobe nvidia_peermem" in bare["note"]
    # amdgpu (and even a stray nvidia_peermem) is no peer memory for AMD GPUs: DMA-BUF or nothing
    amd = reg("amd", ["amdgpu", "bnxt_re", "nvidia_peermem"], False)
    assert not amd["ok"] and amd["peer_memory"] == "none" and "DMA-BUF only" in amd["note"]
    assert reg("amd", ["amdgpu", "ionic_rdma"], True)["methods"] == ["DMA-BUF"]
    assert reg("none", None, False)["ok"]


def test_doctor_says_when_amd_gpus_cannot_register(monkeypatch):
    monkeypatch.setattr(doctor, "_gpu_vendor", lambda: "amd")
    monkeypatch.setattr(doctor, "_loaded_modules", lambda: ["amdgpu", "bnxt_re"])
    monkeypatch.setattr(doctor, "_verbs_has_dmabuf", lambda: False)
    text = doctor.render(doctor.collect())
    assert "GPU memory registration (amd GPUs)" in text and "cannot register their buffers" in text


class _ThreadExchange:
    """all_gather among threads of this process (one per rank); `tamper(rank, call, result)` may edit a
    rank's view of a round."""

    def __init__(self, world, tamper=lambda rank, call, out: out):
        self.world, self.tamper = world, tamper
        self.barrier = threading.Barrier(world, timeout=60)
        self.rounds: dict = {}
        self.calls = [0] * world

    def for_rank(self, rank):
        def gather(obj):
            call = self.calls[rank]
            self.calls[rank] += 1
            self.rounds.setdefault(call, [None] * self.world)[rank] = obj
            self.barrier.wait()
            out = list(self.rounds[call])
            self.barrier.wait()
            return self.tamper(rank, call, out)
        return gather


@pytest.mark.skipif(not P.available() or "fabric" not in P.compiled_transports(), reason="no fabric transport")
def test_a_failed_connect_on_one_rank_raises_on_every_rank_before_any_starts():
    import numpy as np

    def tamper(rank, call, out):  # rank 1 sees rank 0 with one proxy thread too many: its connect fails
        if rank == 1 and call == 1:
            out[0] = list(out[0]) + [out[0][0]]
        return out

    ex = _ThreadExchange(2, tamper)
    errors, groups = [None, None], [None, None]

    def rank_main(rank):
        try:
            groups[rank] = P.ProxyGroup(rank, 2, {0: np.zeros(4096, np.uint8)}, transport="fabric", provider="tcp",
                                        num_threads=1, pin_threads=False, timeout_s=30, exchange=ex.for_rank(rank))
        except Exception as e:  # noqa: BLE001 - the assertion below is about exactly this
            errors[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    for g in groups:
        if g is not None:
            g.close()
    for rank in range(2):
        assert isinstance(errors[rank], RuntimeError), (rank, errors[rank])
        assert "connect failed on rank 1" in str(errors[rank]) and "proxy threads" in str(errors[rank])
        assert "rank 0:" not in str(errors[rank])
