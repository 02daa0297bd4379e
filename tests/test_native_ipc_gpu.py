"""GPU test: CUDA warps push commands into the rings, CPU proxies execute them over the ipc transport
(copy engine into the peer GPU's IPC-mapped buffer), data and counters verified on the receiver.

Two processes, one per GPU (both on GPU 0 when only one exists), each protocol of publishing a slot
(`vector`: one 16-byte store; `fence`: body + release store of the header) in turn. Needs the native module
built with CUDA.
"""
import os

import numpy as np
import pytest
import torch

from uccl_ep_train import proxy as P
from uccl_ep_train.apps.launch import spawn

pytestmark = [pytest.mark.gpu]

THREADS, K, S = 2, 64, 4096          # rings, chunks per (src, dst, channel), chunk slot bytes
CHANNELS = [0, 1, 2, 3]
PUBLISH = ["vector", "fence"]       # ring publish protocols (UCCL_EP_RING_PUBLISH), one ProxyGroup each


def _ready():
    if not torch.cuda.is_available():
        return "needs CUDA"
    if not P.available() or "ipc" not in P.compiled_transports():
        return "native module without the ipc transport (build with nvcc)"
    from uccl_ep_train import _native
    if not hasattr(_native, "gpu_push_commands"):
        return "native module without GPU producers"
    return None


def _len(k):
    return 0 if k % 9 == 8 else S - (k % 4) * 100


def _worker(rank, world):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    import torch.distributed as dist
    from uccl_ep_train import _native
    dev = rank % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    slot = lambda s, c, k: ((s * len(CHANNELS) + c) * K + k) * S  # noqa: E731
    half = world * len(CHANNELS) * K * S
    pad = torch.empty(12345, dtype=torch.uint8, device="cuda")  # the region is a sub-allocation
    region = torch.zeros(2 * half, dtype=torch.uint8, device="cuda")
    idx = torch.arange(half, device="cuda", dtype=torch.int64)
    region[:half] = ((idx * 3 + rank * 101) % 251 + 1).to(torch.uint8)
    results = {}
    for publish in PUBLISH:
        # one ProxyGroup per ring publish protocol, in the same processes (UCCL_EP_RING_PUBLISH)
        region[half:].zero_()
        counters = np.zeros(world * len(CHANNELS), np.int64)
        g = P.ProxyGroup(rank, world, {0: region, 1: counters}, transport="ipc", gpu=dev, num_threads=THREADS,
                         timeout_s=60, ring_publish=publish)
        assert g.config()["ring_publish"] == publish
        per_ring = {t: [] for t in range(THREADS)}
        for d in range(world):
            for c in CHANNELS:
                for k in range(K):
                    op = P.OP_WRITE_IMM if k % 2 else P.OP_WRITE
                    per_ring[c % THREADS].append((op, d, c, 0, _len(k), slot(d, c, k), half + slot(rank, c, k)))
                    per_ring[c % THREADS].append((P.OP_ATOMIC_ADD, d, c, 1, k + 1, 0, 8 * (rank * len(CHANNELS) + c)))
        rows, offsets = [], [0]
        for t in range(THREADS):
            rows += per_ring[t]
            offsets.append(len(rows))
        cmds = torch.from_numpy(P.make_commands(rows).view(np.uint8).copy()).cuda()
        torch.cuda.synchronize()
        dist.barrier()
        _native.gpu_push_commands(g._native, cmds.data_ptr(), offsets, 4, torch.cuda.current_stream().cuda_stream)
        for s in range(world):
            for c in CHANNELS:
                g.wait_seq(s, c, 2 * K, timeout_s=60, phase="gpu-ipc")
        g.check()
        expect = torch.zeros(half, dtype=torch.uint8, device="cuda")
        for s in range(world):
            src_pattern = ((torch.arange(half, device="cuda") * 3 + s * 101) % 251 + 1).to(torch.uint8)
            for c in CHANNELS:
                assert g.imm_count(s, c) == K // 2
                assert counters[s * len(CHANNELS) + c] == K * (K + 1) // 2
                for k in range(K):
                    n = _len(k)
                    so = slot(rank, c, k)   # where s read from: its send area for destination `rank`
                    expect[slot(s, c, k): slot(s, c, k) + n] = src_pattern[so: so + n]
        got = region[half:]
        mismatch = int((got != expect).sum())
        # every pickup probe variant (4: the one-store vector publish, 5: an owned ring) round-trips here
        rtt = [min(_native.gpu_pickup_latency(g._native, 0, 50, mode)) for mode in range(6)]
        stats = g.stats()
        dist.barrier()
        g.close()
        results[publish] = (mismatch, min(rtt), stats)
    del pad
    return results


def test_gpu_kernel_pushes_commands_proxies_execute_over_ipc():
    why = _ready()
    if why:
        pytest.skip(why)
    res = spawn(_worker, 2, timeout=240)
    for rank, per_mode in enumerate(res):
        assert sorted(per_mode) == sorted(PUBLISH)
        for publish, (mismatch, rtt_min, stats) in per_mode.items():
            assert mismatch == 0, f"rank {rank} ({publish} publish): {mismatch} bytes differ"
            assert rtt_min > 0
            assert stats["rejected"] == 0 and stats["writes"] == 2 * len(CHANNELS) * K, (publish, stats)


def test_pinned_proxy_groups_take_cores_of_their_own():
    """Each proxy group of a process (a low-latency Buffer runs two) and each GPU of a NUMA node pins its
    threads to cores of its own near the GPU: spinning threads sharing a core time-slice it, milliseconds per
    command."""
    if not torch.cuda.is_available() or not P.available():
        pytest.skip("needs CUDA and the native module")
    from uccl_ep_train import _native
    near, (_, gpus) = _native.cpus_near_gpu(0), _native.gpu_place_on_node(0)
    if len(near) < 2 * 2 * gpus:
        pytest.skip(f"{len(near)} cores near GPU 0: two groups of two threads for each of its node's {gpus} GPUs "
                    f"need {4 * gpus}")
    transport = "fabric" if "fabric" in P.compiled_transports() else "ipc"
    groups = [_native.Proxy(0, 1, gpu=0, transport=transport, provider="tcp", num_threads=2, pin_threads=True)
              for _ in range(2)]
    cpus = [set(g.thread_cpus()) for g in groups]
    assert len(cpus[0]) == len(cpus[1]) == 2 and not cpus[0] & cpus[1] and cpus[0] | cpus[1] <= set(near)
    for g in groups:
        g.stop()
    places = [_native.gpu_place_on_node(d) for d in range(torch.cuda.device_count())]
    assert all(0 <= i < n for i, n in places)
    by_node = {}
    for d, (i, n) in enumerate(places):  # GPUs whose nodes hold equally many GPUs: one place each
        by_node.setdefault((n, tuple(_native.cpus_near_gpu(d))), []).append(i)
    assert all(len(set(i)) == len(i) for i in by_node.values())
