"""Buffer lifetimes and cross-rank agreement: settings that peers must share are checked at creation (the same
error on every rank); destroy() is collective and idempotent; a dropped Buffer runs no collective in its
destructor and is freed once every rank dropped it; create/destroy churn leaks nothing (measured)."""
from __future__ import annotations

import gc
import os
import threading

import pytest
import torch
import torch.distributed as dist

from dist_utils import env_set, run_ranks
from uccl_ep_train import Buffer
from uccl_ep_train.agreement import _disagreements


def test_disagreements_name_the_setting_and_every_rank():
    same = {"num_nvl_bytes": 1, "UCCL_EP_TRANSPORT": None}
    assert _disagreements([same, dict(same)]) == []
    out = _disagreements([same, {"num_nvl_bytes": 2, "UCCL_EP_TRANSPORT": None}])
    assert out == ["num_nvl_bytes (rank 0: 1, rank 1: 2)"]


def _mismatch(rank: int, world: int, device: str) -> list:
    group = dist.new_group(list(range(world)))
    messages = []
    for kwargs, env in (({"num_nvl_bytes": 1 << 20 if rank == 0 else 2 << 20}, {}),
                        ({"low_latency_mode": rank == 1, "num_rdma_bytes": 1 << 20}, {}),
                        ({}, {"UCCL_EP_RDMA_CHUNK_BYTES": str(1 << (20 + rank))}),
                        ({}, {"UCCL_EP_VERBS_NATIVE_ATOMICS": "1" if rank else None})):
        with env_set(**env):
            try:
                Buffer(group, **kwargs)
                messages.append("no error")
            except ValueError as exc:
                messages.append(str(exc))
    buf = Buffer(group, 1 << 20)  # agreeing ranks go on: no rank was left in a collective
    buf.destroy()
    return messages


def test_disagreeing_ranks_get_the_same_error_before_any_data_moves():
    _check_mismatch_messages(run_ranks(_mismatch, 2))


@pytest.mark.gpu
def test_disagreeing_native_ranks_get_the_same_error(mps):
    _check_mismatch_messages(run_ranks(_mismatch, 2, device="cuda", backend="gloo", ranks_per_gpu=2))


def _check_mismatch_messages(per_rank: list) -> None:
    assert per_rank[0] == per_rank[1]  # the same message on every rank
    nvl, ll, chunk, atomics = per_rank[0]
    assert "num_nvl_bytes (rank 0: 1048576, rank 1: 2097152)" in nvl
    assert "low_latency_mode (rank 0: False, rank 1: True)" in ll
    assert "UCCL_EP_RDMA_CHUNK_BYTES (rank 0: '1048576', rank 1: '2097152')" in chunk
    assert "UCCL_EP_VERBS_NATIVE_ATOMICS (rank 0: None, rank 1: '1')" in atomics  # set on one rank only


def _parked(rank: int, world: int, device: str) -> list:
    group = dist.new_group(list(range(world)))
    released: list = []
    first = Buffer(group, 1 << 20)
    first._backend.release = lambda: released.append("first")  # noqa: SLF001 (observe the local release)
    if rank == 0:  # rank 0 drops it; rank 1 still holds it: the destructor must not wait for rank 1
        del first
        gc.collect()
    steps = [list(released)]
    second = Buffer(group, 1 << 20)  # rank 1 has not dropped `first`: nobody frees it yet
    steps.append(list(released))
    if rank == 1:
        del first
        gc.collect()
    third = Buffer(group, 1 << 20)  # now every rank dropped it: freed on both
    steps.append(list(released))
    second.destroy()
    second.destroy()  # idempotent
    third.destroy()
    return steps


def test_a_dropped_buffer_is_freed_once_every_rank_dropped_it():
    assert run_ranks(_parked, 2) == [[[], [], ["first"]], [[], [], ["first"]]]


def _group_outlives_destroy(rank: int, world: int, device: str) -> bool:
    import weakref

    group = dist.new_group(list(range(world)))
    buf = Buffer(group, 1 << 20)
    buf.destroy()
    del buf
    alive = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    return alive() is not None  # no gc.collect(): what frees it at exit without a collection


def test_buffer_bookkeeping_does_not_keep_a_destroyed_group_alive():
    """A gloo group joins its worker threads only in its destructor: kept alive past destroy_process_group
    (by agreement's tables), it reached interpreter finalization, where a worker still freeing the last
    collective's tensors aborted the process (std::terminate, SIGABRT at exit)."""
    assert run_ranks(_group_outlives_destroy, 2) == [False, False]


def _children() -> int:
    """Live child processes (the ipc transport's copy agents are some)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                n += len(f.read().split())
        except OSError:  # the thread ended meanwhile
            pass
    return n


def _resources() -> dict:
    """What a leak would grow: threads, child processes, open file descriptors, /dev/shm entries, GPU memory,
    IPC mappings."""
    out = {"threads": threading.active_count(), "tasks": len(os.listdir("/proc/self/task")), "children": _children(),
           "fds": len(os.listdir("/proc/self/fd")),
           # /dev/shm is the machine's: count the segments our transports and copy agents name (uccl_ep_*)
           "shm": len([n for n in os.listdir("/dev/shm") if n.startswith("uccl_ep")])}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        out["gpu_allocated"] = torch.cuda.memory_allocated()
        out["gpu_used"] = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
        try:
            from uccl_ep_train import _native
            out["ipc_mappings"] = int(_native.ipc_mappings_open())
        except (ImportError, AttributeError):
            pass
    return out


def _churn(rank: int, world: int, device: str, cycles: int, dispatch: bool) -> tuple:
    group = dist.new_group(list(range(world)))
    dev = torch.device("cuda") if device == "cuda" else torch.device("cpu")
    x = torch.randn(64, 256, device=dev).to(torch.bfloat16)
    idx = torch.randint(0, 8, (64, 2), device=dev)

    def cycle() -> None:
        buf = Buffer(group, 8 << 20, 8 << 20 if os.environ.get("UCCL_EP_RANKS_PER_NODE") else 0)
        if dispatch:
            per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 8)
            buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                         is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        buf.destroy()

    for _ in range(3):  # warm: lazily created modules, streams, allocator pools, the gloo pairs
        cycle()
    before = _resources()
    for _ in range(cycles):
        cycle()
    gc.collect()
    after = _resources()
    return before, after


def _assert_no_growth(results: list, cycles: int) -> None:
    for before, after in results:
        for key, value in before.items():
            slack = 4 << 20 if key == "gpu_used" else 0  # the driver's own bookkeeping moves a little
            assert after[key] <= value + slack, f"{key} grew over {cycles} cycles: {value} -> {after[key]}"


def test_create_destroy_churn_leaks_nothing_on_cpu_ranks():
    cycles = 1000
    _assert_no_growth(run_ranks(_churn, 2, cycles, True), cycles)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks,ranks_per_node,cycles", [(2, None, 1000), (2, 1, 30)],
                         ids=["intranode", "internode-2x1"])
def test_create_destroy_churn_leaks_nothing_on_gpu(mps, ranks, ranks_per_node, cycles):
    env = {"UCCL_EP_RANKS_PER_NODE": str(ranks_per_node)} if ranks_per_node else {}
    results = run_ranks(_churn, ranks, cycles, True, device="cuda", backend="gloo", ranks_per_gpu=ranks,
                        env=env, timeout=540)
    _assert_no_growth(results, cycles)
