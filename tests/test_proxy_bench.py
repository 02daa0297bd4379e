"""`uccl-ep-train bench proxy --mode cpu` runs end to end and writes DESIGN.md-style JSON records.

The provider is tcp: libfabric fixes its provider set (FI_PROVIDER) at its first use in a process, and
the other tests in this process use tcp."""
import json

import pytest

from record_check import assert_complete
from uccl_ep_train import proxy as P

pytestmark = pytest.mark.skipif(not P.available() or "fabric" not in P.compiled_transports(),
                                reason="native module with the fabric transport not built")


def test_bench_proxy_cpu_writes_records(tmp_path, monkeypatch):
    from uccl_ep_train.apps.cli import main
    monkeypatch.setenv("FI_TCP_IFACE", "lo")
    out = tmp_path / "proxy.json"
    rc = main(["bench", "proxy", "--mode", "cpu", "--threads", "1", "--chunk-bytes", "4096",
               "--total-bytes", str(1 << 20), "--latency-iters", "50", "--provider", "tcp", "--json", str(out),
               "--num-tokens", "16", "--hidden", "256", "--num-experts", "16", "--num-topk", "4"])
    assert rc == 0
    recs = json.loads(out.read_text())
    ops = {r["op"] for r in recs}
    assert {"pickup_rtt", "fabric_cmds", "fabric_write", "batching"} <= ops
    assert_complete(recs)  # what tests/test_records.py asks of committed records
    assert all(r["timing"] == "api" and (r["device"], r["gpus"]) == ("cpu", 0) for r in recs)  # host clocks
    for r in recs:
        for key in ("bench", "op", "ranks", "gbps", "us", "device", "sms"):
            assert key in r, (key, r)
        assert r["bench"] == "proxy" and r["us"] > 0
    writes = [r for r in recs if r["op"] == "fabric_write"]
    assert all(r["chunk_bytes"] == 4096 and r["commands"] == 256 for r in writes)
    batching = {r["pattern"]: r for r in recs if r["op"] == "batching"}
    assert sorted(batching) == ["per-expert", "per-rank", "signal"]
    assert batching["signal"]["writes"] == 0 and batching["per-rank"]["writes"] == 1
    assert batching["per-expert"]["writes"] == batching["per-expert"]["experts_with_rows"] > 1
    # the same routing: per-expert writes every (token, expert) row, per-rank each token once
    assert batching["per-expert"]["rows"] == batching["per-rank"]["rows"] > batching["per-rank"]["tokens"] > 0
    assert batching["per-expert"]["block_bytes"] > batching["per-rank"]["block_bytes"] > 0
    assert all(r["transport"] == "fabric" and r["iters"] > 0 for r in batching.values())


def test_batching_patterns_model_the_kernels_block_and_per_expert_rows():
    """`bench proxy`'s batching op: `per-rank` is one write of the kernels' block (header, row index, each token
    once), `per-expert` one write per expert with rows, contiguous, a message per (token, expert) row; one
    atomic last; both fit the span each side reserves."""
    import argparse

    from uccl_ep_train.apps.bench.proxy import BATCHING_SHAPE, batching_commands
    from uccl_ep_train.backends.low_latency import low_latency_layout
    args = argparse.Namespace(**BATCHING_SHAPE)
    lay = low_latency_layout(args.num_tokens, args.hidden, 2, args.num_experts)
    whole, shape = batching_commands(args, "per-rank", peer=1)
    pieces, pshape = batching_commands(args, "per-expert", peer=1)
    assert shape["rows"] == pshape["rows"] and 0 < shape["rows"] <= args.num_tokens * args.num_topk
    # top-8 of 256 experts: a token has ~4 experts on the peer, so its rows outnumber its tokens
    assert 0 < shape["tokens"] <= args.num_tokens and shape["rows"] > 2 * shape["tokens"]
    assert shape["block_bytes"] == lay.hdr_bytes + lay.idx_bytes + shape["tokens"] * lay.msg_bytes
    assert pshape["block_bytes"] == lay.hdr_bytes + shape["rows"] * lay.msg_bytes
    assert shape["span"] == pshape["span"] >= max(shape["block_bytes"], pshape["block_bytes"])
    for cmds in (whole, pieces):
        assert cmds[-1]["op"] == P.OP_ATOMIC_ADD and cmds[-1]["remote_off"] == 8 and cmds[-1]["region"] == 1
        writes = cmds[:-1]
        assert (writes["op"] == P.OP_WRITE).all() and (writes["dst"] == 1).all() and (writes["channel"] == 0).all()
        assert writes["local_off"][0] == 0 and writes["remote_off"][0] == shape["span"]
        assert (writes["remote_off"][1:] == writes["remote_off"][:-1] + writes["length"][:-1]).all()
        assert (writes["remote_off"] - writes["local_off"] == shape["span"]).all()
    assert len(whole) == 2
    assert len(pieces) - 1 == pshape["experts_with_rows"] > 100  # 256 experts, top-8 of 128 tokens
    assert (pieces["length"][1:-1] % lay.msg_bytes == 0).all()
