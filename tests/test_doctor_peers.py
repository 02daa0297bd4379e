"""`uccl-ep-train doctor --peers` (uccl_ep_train/apps/preflight.py): local ranks over the fabric transport (tcp on
loopback, host memory) write a pattern to each other through the proxies, check every byte, time a bulk transfer,
and rank 0 prints one table. A rank that cannot build its proxies puts its error in the table, the others stop
without hanging, and the exit code says so. On GPUs: ranks sharing one GPU under MPS over the ipc transport."""
import json
import os
import time

import pytest

from uccl_ep_train import proxy as P
from uccl_ep_train.apps import preflight
from uccl_ep_train.apps.cli import main as cli_main
from uccl_ep_train.apps.launch import spawn

needs_fabric = pytest.mark.skipif(not P.available() or "fabric" not in P.compiled_transports(),
                                  reason="native module with the fabric transport not built")

# small and quick on a shared CPU: 2 proxy threads per rank, 4 MiB per peer
LOOPBACK = {"FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo", "GLOO_SOCKET_IFNAME": "lo", "UCCL_EP_PROXY_THREADS": "2",
            "UCCL_EP_DISABLE_CPU_AFFINITY": "1"}
ARGS = ["--transport", "fabric", "--mib", "4", "--rounds", "2", "--timeout", "10"]


@pytest.fixture
def loopback(monkeypatch):
    for k, v in LOOPBACK.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("UCCL_EP_NICS", raising=False)


def _table_lines(text):
    return [line for line in text.splitlines() if line[:1].isdigit()]


@needs_fabric
@pytest.mark.parametrize("ranks", [2, 3])
def test_local_ranks_check_every_byte_and_report_a_rate(ranks, loopback, tmp_path, capsys):
    out = tmp_path / "peers.json"
    start = time.monotonic()
    code = cli_main(["doctor", "--peers", "--ranks", str(ranks), *ARGS, "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert time.monotonic() - start < 120
    rows = json.loads(out.read_text())["rows"]
    assert [r["rank"] for r in rows] == list(range(ranks))
    for r in rows:
        assert r["error"] == "" and r["phase"] == ""
        assert r["peers"] == [p for p in range(ranks) if p != r["rank"]]
        assert r["bytes_verified"] == (ranks - 1) * preflight.CHUNK
        assert r["transport"] == "fabric (tcp;ofi_rxm)" and r["gpu"] == "cpu"   # FI_PROVIDER=tcp: an alias
        assert len(r["nics"]) == 2 and r["gbps"]["total"] > 0
        assert r["registration"].startswith("host")
    lines = _table_lines(text)
    assert len(lines) == ranks and all(line.rstrip().endswith("ok") for line in lines), text
    assert "every byte checked" in text and "FIRST PROBLEM" not in text


@needs_fabric
def test_the_table_shows_the_provider_and_domain_the_endpoints_opened(loopback, monkeypatch, tmp_path):
    """FI_PROVIDER unset: libfabric picks. The table names what the endpoints opened (the transport's own
    selection, which `fabric_probe` runs too), not the empty setting."""
    monkeypatch.delenv("FI_PROVIDER")
    probe = P._native.fabric_probe("", "", False)
    out = tmp_path / "peers.json"
    assert cli_main(["doctor", "--peers", "--ranks", "2", *ARGS, "--json", str(out)]) == 0
    for r in json.loads(out.read_text())["rows"]:
        assert r["transport"] == f"fabric ({probe['provider']})" and r["nics"] == [probe["domain"]] * 2, r
        assert r["registration"] == f"host ({probe['provider']})"


def _rank_1_with(rank, world, opts, name, value):
    """The check with `name`=`value` in rank 1's environment only."""
    if rank == 1:
        os.environ[name] = value
    return preflight.check_rank(rank, world, opts)


@needs_fabric
def test_a_rank_whose_proxies_cannot_start_is_named_and_nobody_hangs(loopback):
    opts = preflight.Options(transport="fabric", mib=4, rounds=2, timeout_s=5)
    start = time.monotonic()
    # rank 1 asks libfabric for a provider that does not exist: its endpoints cannot open
    rows = spawn(_rank_1_with, 3, opts, "FI_PROVIDER", "no-such-provider", env=LOOPBACK, timeout=120)
    assert time.monotonic() - start < 120
    assert [r["phase"] for r in rows] == ["connect"] * 3
    assert "no-such-provider" in rows[1]["error"] and not rows[1]["error"].startswith("stopped:")
    for r in (rows[0], rows[2]):  # the peers: stopped, naming rank 1 and its problem
        assert r["error"].startswith("stopped:") and "rank 1" in r["error"] and "no-such-provider" in r["error"]
        assert r["bytes_verified"] == 0 and not r["gbps"]
    assert preflight.exit_code(rows) == 1
    text = preflight.render(rows, opts)
    assert len(_table_lines(text)) == 3
    assert "FIRST PROBLEM: rank 1" in text and "no-such-provider" in text.split("FIRST PROBLEM")[1]


@needs_fabric
def test_a_rank_failing_mid_transfer_is_the_first_problem_and_its_peers_stop_at_their_deadline(loopback):
    opts = preflight.Options(transport="fabric", mib=4, rounds=2, timeout_s=3)
    start = time.monotonic()
    # rank 1 closes endpoints whose peers' writes its dead threads left half received: they quiesce first
    # (libfabric 1.17's rxm used to crash in fi_close there; tests/test_fabric.py repeats that teardown)
    # rank 1's proxy threads fail (fault injection) once past the pattern's commands: in the bulk rounds
    rows = spawn(_rank_1_with, 3, opts, "UCCL_EP_FAULT", "die_after=3", env=LOOPBACK, timeout=120)
    assert time.monotonic() - start < 90
    assert [r["bytes_verified"] for r in rows] == [2 * preflight.CHUNK] * 3   # the pattern passed everywhere
    assert rows[1]["phase"] == "bulk" and rows[1]["cause"] == "own" and "die_after" in rows[1]["error"]
    for r in (rows[0], rows[2]):
        assert r["phase"] == "bulk" and r["cause"] == "peer" and r["error"], r
    assert preflight.exit_code(rows) == 1
    problem = preflight.first_problem(rows)
    assert problem.startswith("rank 1 ") and "die_after" in problem


@needs_fabric
def test_a_bad_nics_setting_fails_the_check_with_the_setting_named(loopback, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("UCCL_EP_NICS", "1=no_such_nic0")  # rank 0: no entry; rank 1: a device the host lacks
    out = tmp_path / "peers.json"
    start = time.monotonic()
    code = cli_main(["doctor", "--peers", "--ranks", "2", *ARGS, "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 1 and time.monotonic() - start < 120
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(r["phase"] == "connect" and "UCCL_EP_NICS" in r["error"] for r in rows)
    assert "no entry for local rank 0" in rows[0]["error"] and "no_such_nic0" in rows[1]["error"]
    assert "FIRST PROBLEM: rank 0" in text and "UCCL_EP_NICS" in text


def test_peers_are_every_other_rank_or_the_other_hosts_ones():
    hosts = ["a", "a", "b", "b", "c"]
    assert preflight.peers_of(0, hosts, False) == [1, 2, 3, 4]
    assert preflight.peers_of(2, hosts, True) == [0, 1, 4]
    assert preflight.peers_of(4, hosts, True) == [0, 1, 2, 3]
    assert preflight.peers_of(1, ["a", "a"], True) == []
    # the relation is symmetric: what a rank sends lands in the slot its peer keeps for it
    for other in (False, True):
        for r in range(len(hosts)):
            for p in preflight.peers_of(r, hosts, other):
                assert r in preflight.peers_of(p, hosts, other)


def test_bad_options_are_refused_before_any_rank_starts(capsys):
    assert cli_main(["doctor", "--peers", "--ranks", "2", "--mib", "0"]) == 2
    assert "--mib must be >= 1" in capsys.readouterr().err
    assert cli_main(["doctor", "--peers", "--ranks", "1"]) == 2
    assert "--ranks must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["doctor", "--ranks", "2"])       # a --peers option without --peers
    assert "only apply with --peers" in capsys.readouterr().err


def test_without_a_launcher_or_ranks_the_check_says_what_to_give(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli_main(["doctor", "--peers"]) == 2
    assert "--ranks N" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("nics", [None, "1=no_such_nic0"])
def test_ranks_sharing_a_gpu_check_each_other_over_ipc(nics, mps, monkeypatch, tmp_path, capsys):
    """Two ranks on GPU 0 (MPS): GPU regions, commands pushed by a kernel, the ipc transport chosen by itself.
    ipc opens no NIC, so a UCCL_EP_NICS that verbs or fabric would refuse (rank 0: no entry, rank 1: a device
    the host lacks) changes nothing."""
    if "ipc" not in P.compiled_transports():
        pytest.skip("native module without the ipc transport (a CUDA build)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    monkeypatch.setenv("UCCL_EP_PROXY_THREADS", "2")
    monkeypatch.delenv("UCCL_EP_TRANSPORT", raising=False)
    if nics:
        monkeypatch.setenv("UCCL_EP_NICS", nics)
    else:
        monkeypatch.delenv("UCCL_EP_NICS", raising=False)
    out = tmp_path / "peers.json"
    code = cli_main(["doctor", "--peers", "--ranks", "2", "--mib", "64", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    rows = json.loads(out.read_text())["rows"]
    for r in rows:
        assert r["transport"] == "ipc" and r["gpu"].startswith("0 ") and r["registration"].startswith("ipc: CUDA")
        assert r["bytes_verified"] == preflight.CHUNK and r["gbps"]["total"] > 0


def _port(state, link, mtu, gids):
    return {"port": 1, "state": state, "link_layer": link, "active_mtu": mtu, "lid": 0, "speed": "", "gids": gids}


ROCE_GIDS = ["0:RoCE v1:fe80:0000:0000:0000:b8ce:f6ff:fe01:2345", "1:RoCE v2:fe80:0000:0000:0000:b8ce:f6ff:fe01:2345",
             "2:RoCE v1:0000:0000:0000:0000:0000:ffff:0a0a:0105", "3:RoCE v2:0000:0000:0000:0000:0000:ffff:0a0a:0105"]


@pytest.mark.skipif(not P.available() or not hasattr(P._native, "verbs_choose_gid"),
                    reason="native module without the verbs policy")
def test_verbs_gid_and_mtu_are_the_transports_own_choice(monkeypatch):
    """The table's GID column: the first ACTIVE port (as verbs.cpp picks it), the GID the transport's rule picks
    there (RoCE v2 IPv4-mapped; UCCL_IB_GID_INDEX wins), the port's active MTU; '-' for a device not found."""
    devices = [{"name": "mlx5_0", "ports": [_port("PORT_DOWN", "Ethernet", 1024, []),
                                            {**_port("PORT_ACTIVE", "Ethernet", 4096, ROCE_GIDS), "port": 2}]},
               {"name": "mlx5_1", "ports": [_port("PORT_ACTIVE", "InfiniBand", 4096,
                                                  ["0:IB:fe80:0000:0000:0000:0000:0000:0000:0001"])]}]
    monkeypatch.setattr(P._native, "verbs_devices", lambda: devices)
    monkeypatch.delenv("UCCL_IB_GID_INDEX", raising=False)
    assert preflight.verbs_port("mlx5_0") == ("3 RoCE v2 0000:0000:0000:0000:0000:ffff:0a0a:0105", "4096")
    assert preflight.verbs_port("mlx5_1") == ("0 IB fe80:0000:0000:0000:0000:0000:0000:0001", "4096")
    assert preflight.verbs_port("mlx5_9") == ("-", "-")
    monkeypatch.setenv("UCCL_IB_GID_INDEX", "1")
    assert preflight.verbs_port("mlx5_0")[0].startswith("1 RoCE v2 fe80")
    monkeypatch.setenv("UCCL_IB_GID_INDEX", "7")    # not in the table: the transport's own refusal, in the cell
    assert preflight.verbs_port("mlx5_0")[0].startswith("none (")


def test_registration_method_says_what_the_transport_does(monkeypatch):
    from uccl_ep_train.apps import doctor
    assert preflight.registration_method("fabric", True, "efa") == "GPU via FI_HMEM (efa; DMA only)"
    # efa without GPUDirect RDMA refuses to leave the CUDA runtime alone: its copies can stall behind the kernels
    assert preflight.registration_method("fabric", True, "efa", True) == "GPU via FI_HMEM (efa; CUDA-runtime copies)"
    assert preflight.registration_method("fabric", False, "tcp") == "host (tcp)"
    assert preflight.registration_method("verbs", False, "") == "host (ibv_reg_mr)"
    assert preflight.registration_method("ipc", True, "") == "ipc: CUDA/HIP IPC handle"
    monkeypatch.setattr(doctor, "_gpu_vendor", lambda: "nvidia")
    monkeypatch.setattr(doctor, "_loaded_modules", lambda: ["nvidia_peermem"])
    monkeypatch.setattr(doctor, "_verbs_has_dmabuf", lambda: True)
    assert preflight.registration_method("verbs", True, "") == "GPU: peer memory (nvidia_peermem) or DMA-BUF"
    monkeypatch.setattr(doctor, "_loaded_modules", lambda: [])
    monkeypatch.setattr(doctor, "_verbs_has_dmabuf", lambda: False)
    assert preflight.registration_method("verbs", True, "") == "GPU: -"


@pytest.mark.gpu
@pytest.mark.parametrize("provider,shown", [("tcp", "tcp;ofi_rxm"), ("shm", "shm")])
def test_ranks_sharing_a_gpu_check_each_other_over_fabric_with_gpu_memory(mps, monkeypatch, tmp_path, capsys,
                                                                          provider, shown):
    """The fabric transport with GPU regions (FI_HMEM: a CUDA-enabled libfabric, docs/proxy.md), tcp on loopback
    or shm (a libfabric 2.6 built with CUDA carries GPU memory over shm, not over tcp)."""
    if "fabric" not in P.compiled_transports():
        pytest.skip("native module without the fabric transport")
    monkeypatch.setenv("FI_TCP_IFACE", "lo")
    try:
        P._native.fabric_probe(provider, hmem=True)
    except RuntimeError as e:
        pytest.skip(f"this libfabric cannot register GPU memory over {provider}: {e}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    monkeypatch.setenv("FI_PROVIDER", provider)
    monkeypatch.setenv("UCCL_EP_PROXY_THREADS", "2")
    out = tmp_path / "peers.json"
    code = cli_main(["doctor", "--peers", "--ranks", "2", "--transport", "fabric", "--mib", "16", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    for r in json.loads(out.read_text())["rows"]:
        assert r["transport"] == f"fabric ({shown})" and r["registration"].startswith("GPU via FI_HMEM")
        assert r["bytes_verified"] == preflight.CHUNK and r["gbps"]["total"] > 0
