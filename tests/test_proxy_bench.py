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
               "--total-bytes", str(1 << 20), "--latency-iters", "50", "--provider", "tcp", "--json", str(out)])
    assert rc == 0
    recs = json.loads(out.read_text())
    ops = {r["op"] for r in recs}
    assert {"pickup_rtt", "fabric_cmds", "fabric_write"} <= ops
    assert_complete(recs)  # what tests/test_records.py asks of committed records
    assert all(r["timing"] == "api" and (r["device"], r["gpus"]) == ("cpu", 0) for r in recs)  # host clocks
    for r in recs:
        for key in ("bench", "op", "ranks", "gbps", "us", "device", "sms"):
            assert key in r, (key, r)
        assert r["bench"] == "proxy" and r["us"] > 0
    writes = [r for r in recs if r["op"] == "fabric_write"]
    assert all(r["chunk_bytes"] == 4096 and r["commands"] == 256 for r in writes)
