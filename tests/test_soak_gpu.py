"""Soak / churn of native Buffers on GPUs (ranks share one GPU under MPS, gloo group): 1000 create / dispatch /
combine / destroy cycles on one node (NVLink/IPC kernels), 100 on 2 emulated nodes (CPU proxies, the ipc
transport's copy agents: processes started and stopped with every Buffer), and 10,000 mixed HT and LL calls on one Buffer; each rank's device memory in use,
live torch tensors, file descriptors, threads and child processes must not grow beyond
tests/soak_utils.Bounds (measured after a warm-up, at a barrier). The CPU variant: tests/test_soak.py."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from soak_utils import growth, held
from test_soak import EXPERTS, TOKENS, _inputs, _round

pytestmark = [pytest.mark.gpu]


def _on(dev, *tensors):
    return tuple(t.to(dev) for t in tensors)


def _measure(dev, group):
    import torch.distributed as dist

    dist.barrier(group)  # every rank idle: device memory (shared by the ranks) measured at one point
    return held(dev)


def _grown(before, dev, group) -> dict:
    import torch.distributed as dist

    dist.barrier(group)
    out = growth(before, dev)
    dist.barrier(group)
    return out


def _cycles(rank: int, world: int, device: str, cycles: int) -> dict:
    import torch.distributed as dist

    from uccl_ep_train import Buffer

    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(list(range(world)), backend="gloo")
    inputs = [_on(dev, *_inputs(rank, i)) for i in range(4)]

    def cycle(i: int) -> None:
        buf = Buffer(group)
        assert buf.backend_name == "native", buf.backend_name
        _round(buf, *inputs[i % 4])
        buf.destroy()

    for i in range(3):  # warm-up: the CUDA context, torch's allocator, gloo's pools
        cycle(i)
    before = _measure(dev, group)
    for i in range(cycles):
        cycle(i)
    return _grown(before, dev, group)


def _mixed(rank: int, world: int, device: str, calls: int) -> dict:
    import torch.distributed as dist

    from uccl_ep_train import Buffer

    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(list(range(world)), backend="gloo")
    buf = Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(TOKENS, 128, world, EXPERTS), low_latency_mode=True)
    assert buf.backend_name == "native" and type(buf.low_latency_backend).__name__ == "NativeLowLatencyBackend"
    x, idx, w = _on(dev, *_inputs(rank, 0))
    x128 = torch.randn(TOKENS, 128, device=dev).to(torch.bfloat16)
    zeros = None

    def calls_of_one_pass():  # layout + dispatch + combine (3), cached dispatch, combine, LL dispatch + combine
        nonlocal zeros
        h = _round(buf, x, idx, w)
        buf.dispatch(x, handle=h)
        zeros = torch.zeros(h.num_recv_tokens, x.size(1), dtype=x.dtype, device=dev) if zeros is None else zeros
        buf.combine(zeros, h)
        recv, _, lh, _, _ = buf.low_latency_dispatch(x128, idx, TOKENS, EXPERTS, use_fp8=False)
        buf.low_latency_combine(recv, idx, w, lh)
        return 7

    for _ in range(20):
        calls_of_one_pass()
    before, done = _measure(dev, group), 0
    while done < calls:
        done += calls_of_one_pass()
    buf.check_errors()
    grown = _grown(before, dev, group)
    buf.destroy()
    return grown


# 2 x 1 makes 100: every cycle there starts and stops the proxies and their ipc copy agents, each a process
# of its own that opens a CUDA context (~0.5 s or more per cycle), so 1000 would take 10+ minutes
@pytest.mark.parametrize("nodes,per_node,cycles", [(1, 2, 1000), (2, 1, 100)])
def test_native_buffer_churn_holds_nothing(mps, nodes, per_node, cycles):
    """Each cycle: a native Buffer made, a fresh dispatch + combine checked, destroyed. At 2 x 1 every cycle
    starts and stops the proxies and their copy agents (child processes)."""
    from uccl_ep_train.backends.native import native_available
    from test_internode_gpu import _ready

    if not native_available() or (nodes > 1 and _ready()):
        pytest.skip("native module without the kernels this layout needs")
    env = {"UCCL_EP_RANKS_PER_NODE": str(per_node), "UCCL_EP_TIMEOUT_S": "30"}
    got = run_ranks(_cycles, nodes * per_node, cycles, device="cuda", backend="gloo", ranks_per_gpu=nodes * per_node,
                    timeout=900, env=env)
    assert len(got) == nodes * per_node


@pytest.mark.parametrize("calls", [10_000])
def test_native_mixed_calls_hold_nothing(mps, calls):
    """2 emulated nodes x 1 rank: HT (fresh, cached, combine) and LL calls on one Buffer, 10,000 in all."""
    from test_internode_gpu import _ready
    from uccl_ep_train.backends.low_latency import low_latency_available

    if _ready() or not low_latency_available():
        pytest.skip("native module without the internode / low-latency kernels")
    env = {"UCCL_EP_RANKS_PER_NODE": "1", "UCCL_EP_TIMEOUT_S": "30"}
    got = run_ranks(_mixed, 2, calls, device="cuda", backend="gloo", ranks_per_gpu=2, timeout=600, env=env)
    assert len(got) == 2
