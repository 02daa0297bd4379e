"""`uccl-ep-train bench internode` on CPU ranks: records, RDMA bytes from the routing, the CLI listing."""
from __future__ import annotations

import json

import pytest
import torch

from record_check import assert_complete
from uccl_ep_train.apps.bench import _portable

REQUIRED = ("bench", "op", "ranks", "ranks_per_node", "nodes", "gbps", "nvl_gbps", "us", "sms", "sms_occupied",
            "device", "gpus",
            "date", "commit", "command", "timing", "backend", "num_tokens", "hidden", "num_experts", "num_topk",
            "rdma_bytes", "proxy_bytes", "proxy_commands_per_s")
SHAPE = {"num_tokens": 64, "hidden": 256, "num_experts": 16, "num_topk": 4}


def _remote_tokens(rank: int, world: int, per_node: int) -> int:
    """Tokens of `rank` x other nodes holding at least one of their experts, counted token by token."""
    from uccl_ep_train.apps.bench.internode import make_inputs

    _, topk_idx, _ = make_inputs(rank, SHAPE, torch.device("cpu"))
    experts_per_rank = SHAPE["num_experts"] // world
    count = 0
    for experts in topk_idx.tolist():
        nodes = {e // experts_per_rank // per_node for e in experts if e >= 0}
        count += len(nodes - {rank // per_node})
    return count


def test_bench_internode_cpu_records(tmp_path, capfd):  # capfd: the ranks are child processes
    if torch.cuda.is_available():
        pytest.skip("the CPU shape and backend; GPU runs are measured by hand")
    from uccl_ep_train.apps.cli import main

    out = tmp_path / "internode.json"
    argv = ["--ranks", "4", "--ranks-per-node", "2", "--num-tokens", "64", "--hidden", "256", "--num-experts", "16",
            "--num-topk", "4", "--iters", "2", "--warmup", "1", "--json", str(out)]
    assert main(["bench", "internode", *argv]) == 0
    records = json.loads(out.read_text())
    assert [r["op"] for r in records] == ["dispatch_bf16", "dispatch_fresh_bf16", "dispatch_fp8", "combine",
                                          "alltoall"]
    assert_complete(records)  # what tests/test_records.py asks of committed records
    H, K = SHAPE["hidden"], SHAPE["num_topk"]
    payload = {"dispatch_bf16": H * 2 + K * 8, "dispatch_fresh_bf16": H * 2 + K * 8,
               "dispatch_fp8": H + H // 128 * 4 + K * 8, "combine": H * 2 + K * 4}
    remote = [_remote_tokens(r, 4, 2) for r in range(4)]
    assert all(0 < n <= SHAPE["num_tokens"] for n in remote)
    for r in records:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, f"{r['op']}: missing {missing}"
        assert (r["bench"], r["ranks"], r["ranks_per_node"], r["nodes"]) == ("internode", 4, 2, 2)
        assert (r["device"], r["gpus"], r["timing"]) == ("cpu", 0, "api")
        assert {k: r[k] for k in SHAPE} == SHAPE
        env, _, command = r["command"].partition("uccl-ep-train ")
        assert command == "bench internode " + " ".join(_portable(a) for a in argv)
        assert "FI_TCP_IFACE=lo" in env.split()  # tests/conftest.py keeps libfabric tcp on loopback
        assert r["date"] and r["commit"]
        assert r["us"] > 0 and r["gbps"] > 0 and r["nvl_gbps"] > 0
        assert 0 < r["host_us"]  # API timing records the host's time per call too (no kernel timing on CPU)
        assert r["kernel_us"] is None  # each kernel's share: kernel timing only
        assert r["proxy_bytes"] is None and r["proxy_commands_per_s"] is None  # the reference backend has none
        assert r["transport"] is None  # ... and no proxies to name a transport for
        assert r["sms_occupied"] is None  # the reference backend runs torch collectives, no SMs of its own
        if r["op"] == "alltoall":
            assert r["backend"] == "gloo" and r["sms"] == 0
            assert r["rdma_bytes"] == r["nvl_bytes"] // 2  # half of every rank's slices go to the other node
            continue
        assert r["backend"] == "reference" and r["sms"] == 24
        assert r["rdma_bytes_per_rank"] == [n * payload[r["op"]] for n in remote]
        assert r["rdma_bytes"] == sum(r["rdma_bytes_per_rank"]) / 4
    assert "RDMA GB/s" in capfd.readouterr().out


def test_summary_keeps_each_kernels_share(capsys):
    """A kernel-timing record names each kernel's µs (its mean over ranks), summing to the op's µs; the table
    prints them after the op."""
    from uccl_ep_train.apps.bench.internode import _print, summarise

    def record(rank, pack, forward, copy_out):
        split = {"pack": pack, "forward": forward, "copy_out": copy_out}
        return {"op": "dispatch_bf16", "rank": rank, "sms": 8, "timing": "kernel", "us": sum(split.values()),
                "gbps": 1.0, "nvl_gbps": 1.0, "rdma_bytes": 10, "nvl_bytes": 20, "host_us": None, "proxy_bytes": None,
                "proxy_commands_per_s": None, "kernel_us": split, "ranks": 2, "nodes": 2, "ranks_per_node": 1,
                "gpus": 1, "device": "gpu", "group": "gloo", "backend": "native", "num_tokens": 1, "hidden": 128,
                "num_experts": 2, "num_topk": 1}

    (s,) = summarise([record(0, 10.0, 100.0, 30.0), record(1, 20.0, 80.0, 10.0)])
    assert s["kernel_us"] == {"pack": 15.0, "forward": 90.0, "copy_out": 20.0}
    assert s["us"] == sum(s["kernel_us"].values())
    _print([s])
    assert "pack 15 forward 90 copy_out 20" in capsys.readouterr().out


def test_sms_column_counts_what_the_call_occupies():
    """The table's SMs are those the call occupies (sms_occupied), with the requested count before '>' where the
    Buffer gave fewer (ranks sharing a GPU); the requested count where the backend does not say."""
    from uccl_ep_train.apps.bench.internode import sms_column

    assert sms_column({"sms": 8, "sms_occupied": {"communication": 8, "side": 0, "total": 8}}) == "8"
    assert sms_column({"sms": 32, "sms_occupied": {"communication": 16, "side": 0, "total": 16}}) == "32>16"
    assert sms_column({"sms": 24, "sms_occupied": None}) == "24"
    assert sms_column({"sms": 0}) == "0"


def test_bench_help_lists_internode(capsys):
    from uccl_ep_train.apps.cli import main

    assert main(["bench", "--help"]) == 0
    text = capsys.readouterr().out
    for name in ("intranode", "internode", "megatron", "expert-major", "proxy"):
        assert f"  {name} " in text
    assert main(["bench"]) == 2


def test_records_name_no_machine_directory(tmp_path, monkeypatch):
    from uccl_ep_train.apps.bench import run_context

    monkeypatch.chdir(tmp_path)
    for name in ("FI_PROVIDER", "FI_TCP_IFACE", "UCCL_EP_NICS"):
        monkeypatch.delenv(name, raising=False)
    cmd = run_context("bench internode", ["--json", "/elsewhere/out/x.json", f"--json={tmp_path}/sub/y.json",
                                          "--ranks", "2"])["command"]
    assert cmd == "uccl-ep-train bench internode --json x.json --json=sub/y.json --ranks 2"


def test_records_name_the_provider_they_ran_on(monkeypatch):
    """FI_PROVIDER=shm and =tcp measure different copies: a record's command line says which was set."""
    from uccl_ep_train.apps.bench import run_context

    monkeypatch.setenv("FI_PROVIDER", "shm")
    monkeypatch.delenv("FI_TCP_IFACE", raising=False)
    monkeypatch.setenv("UCCL_EP_NICS", "")
    cmd = run_context("bench low-latency", ["--transport", "fabric"])["command"]
    assert cmd == "FI_PROVIDER=shm uccl-ep-train bench low-latency --transport fabric"
