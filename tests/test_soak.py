"""Soak / churn on CPU (CI): 1000 create / dispatch / combine / destroy cycles of reference-backend Buffers,
10,000 mixed calls on one, and proxy groups on the fabric transport (libfabric tcp, host memory) made,
used and closed again and again; no rank may hold more file descriptors, threads or child processes after
than before beyond tests/soak_utils.Bounds. (The GPU variant, native Buffers and their proxies:
tests/test_soak_gpu.py.)"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dist_utils import run_ranks
from soak_utils import growth, held

EXPERTS, HIDDEN, TOPK, TOKENS = 8, 64, 2, 16


def _inputs(rank: int, step: int):
    g = torch.Generator().manual_seed(step * 17 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(TOKENS)])
    return x, idx, torch.rand(TOKENS, TOPK, generator=g)


def _round(buf, x, idx, w):
    """Fresh dispatch + combine without weights: each token comes back once per rank it went to."""
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, EXPERTS)
    rx, _, _, _, h, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                                     is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
                                     topk_weights=w)
    out, _, _ = buf.combine(rx, h)
    torch.testing.assert_close(out.float(), x.float() * in_rank.sum(1, keepdim=True), rtol=2e-2, atol=2e-2)
    return h


def _cycles(rank: int, world: int, device: str, cycles: int) -> dict:
    import torch.distributed as dist

    from uccl_ep_train import Buffer

    group = dist.new_group(list(range(world)))
    dev = torch.device("cpu")
    for i in range(3):  # warm-up: gloo's and torch's lazily made pools
        buf = Buffer(group)
        _round(buf, *_inputs(rank, i))
        buf.destroy()
    before = held(dev)
    for i in range(cycles):
        buf = Buffer(group)
        _round(buf, *_inputs(rank, i))
        buf.destroy()
    dropped = Buffer(group)  # dropped without destroy(): parked, freed at the next creation (agreement.py)
    _round(dropped, *_inputs(rank, 0))
    del dropped
    Buffer(group).destroy()
    return growth(before, dev)


def _mixed(rank: int, world: int, device: str, calls: int) -> dict:
    import torch.distributed as dist

    from uccl_ep_train import Buffer

    group = dist.new_group(list(range(world)))
    dev = torch.device("cpu")
    buf = Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(TOKENS, 128, world, EXPERTS),
                 low_latency_mode=True)
    x, idx, w = _inputs(rank, 0)
    x128 = torch.randn(TOKENS, 128).to(torch.bfloat16)
    h = _round(buf, x, idx, w)
    before, done = held(dev), 0
    while done < calls:  # layout+dispatch+combine (3), cached dispatch, combine, LL dispatch + combine (2)
        h = _round(buf, x, idx, w)
        buf.dispatch(x, handle=h)
        buf.combine(x.new_zeros(h.num_recv_tokens, HIDDEN), h)
        recv, _, lh, _, _ = buf.low_latency_dispatch(x128, idx, TOKENS, EXPERTS, use_fp8=False)
        buf.low_latency_combine(recv, idx, w, lh)
        done += 7
    buf.destroy()
    return growth(before, dev)


@pytest.mark.parametrize("cycles", [1000])
def test_buffer_churn_holds_nothing(cycles):
    """2 ranks, one per node (internode handles): each cycle a Buffer made, used (fresh dispatch + combine,
    checked) and destroyed; then one dropped without destroy(), freed by the next creation."""
    got = run_ranks(_cycles, 2, cycles, timeout=600, env={"UCCL_EP_RANKS_PER_NODE": "1"})
    assert len(got) == 2


@pytest.mark.parametrize("calls", [10_000])
def test_mixed_calls_hold_nothing(calls):
    got = run_ranks(_mixed, 2, calls, timeout=600)
    assert len(got) == 2


def test_growth_names_each_leak():
    """The measurement sees a leaked descriptor, thread and child process (else the soaks could not fail)."""
    import subprocess
    import sys
    import threading

    dev = torch.device("cpu")
    before = held(dev)
    files = [open(os.devnull) for _ in range(10)]
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait) for _ in range(6)]
    for t in threads:
        t.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(AssertionError, match="grew past the bounds") as exc:
            growth(before, dev, settle_s=0)
        for name in ("'fds': 1", "'threads': 6", "'children': 1"):
            assert name in str(exc.value), (name, str(exc.value))
    finally:
        child.kill()
        child.wait()
        stop.set()
        for t in threads:
            t.join()
        for f in files:
            f.close()
    growth(before, dev)


def _proxy_churn(rank: int, world: int, device: str, cycles: int) -> dict:
    from uccl_ep_train import proxy as P

    os.environ.update(FI_PROVIDER="tcp", FI_TCP_IFACE="lo")
    buf = np.zeros(8192, np.uint8)
    dev = torch.device("cpu")

    def cycle(i: int) -> None:
        buf[:4096] = (rank + i) % 251
        g = P.ProxyGroup(rank, world, {0: buf}, transport="fabric", num_threads=1, pin_threads=False)
        try:
            g.push(0, P.make_commands([(P.OP_WRITE_IMM, 1 - rank, 0, 0, 4096, 0, 4096)]))
            g.wait_seq(1 - rank, 0, 1, timeout_s=30, phase=f"cycle {i}")
            g.check()
            assert (buf[4096:] == (1 - rank + i) % 251).all(), f"cycle {i}: wrong bytes"
        finally:
            import torch.distributed as dist

            dist.barrier()  # the peer read what it needed before this side closes
            g.close()

    cycle(0)
    before = held(dev)
    for i in range(1, cycles + 1):
        cycle(i)
    return growth(before, dev)


@pytest.mark.parametrize("cycles", [200])
def test_fabric_proxy_churn_holds_nothing(cycles):
    """Proxy groups on libfabric tcp (host memory) between 2 ranks: made, one checked write each way, closed."""
    from uccl_ep_train import proxy as P

    if not P.available() or "fabric" not in P.compiled_transports():
        pytest.skip("fabric transport not built")
    got = run_ranks(_proxy_churn, 2, cycles, timeout=600)
    assert len(got) == 2
