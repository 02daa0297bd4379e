"""A rank's abort of a collective call, the parts that run without a GPU (issue #42; the kernels' side:
tests/test_abort_gpu.py): the sentences, the message's way through the store, and the Buffer's state after an
abort sent or received (CPU ranks: the reference backend, whose abort/aborted_by are replaced by what a
native backend reports, since its own collectives cannot abort)."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks

REFUSAL = "combine: num_topk 8 without weights"


def _raised(call, kind: type = RuntimeError) -> str:
    """What `call` raised (an exception of `kind`: its text), or "no error"."""
    try:
        call()
    except kind as exc:
        return str(exc)
    return "no error"


def _native():
    return pytest.importorskip("uccl_ep_train._native")


def test_the_aborted_record_reads_as_the_rank_and_call_with_where_to_look():
    n = _native()
    code = n.ERROR_CODES["aborted"]
    op = n.ABORT_OPS.index("combine")
    msg = n.describe_error(code, 3, 3, op, 0, 0, 0, reader=0)
    assert msg.startswith("rank 3 aborted 'combine': see rank 3's log for its error"), msg
    assert "must be recreated" in msg and "need" not in msg, msg
    assert n.rank_aborted(3, "combine", REFUSAL).startswith(f"rank 3 aborted 'combine': {REFUSAL} ("), REFUSAL
    assert n.describe_error(code, 1, 1, 99, 0, 0, 0, reader=1).startswith("rank 1 aborted 'the call'")


def _store_round_trip(rank: int, world: int, device: str) -> tuple:
    from uccl_ep_train import aborts

    group = dist.new_group(list(range(world)))
    if rank == 1:
        aborts.publish_message(group, 5, 1, REFUSAL)
    dist.barrier()
    start = time.monotonic()
    missing = aborts.read_message(group, 5, 0, bound_s=0.2)  # rank 0 left nothing
    took = time.monotonic() - start
    return aborts.read_message(group, 5, 1), aborts.read_message(group, 6, 1, bound_s=0.05), missing, took


def test_the_message_travels_through_the_store_and_its_absence_is_bounded():
    got = run_ranks(_store_round_trip, 2, timeout=60)
    for text, other_buffer, missing, took in got:
        assert text == REFUSAL and other_buffer is None and missing is None, (text, other_buffer, missing)
        assert 0.15 < took < 2.0, took


def test_a_stalled_store_delays_the_abort_by_the_write_bound_only(monkeypatch, caplog):
    """The message is written before the abort record leaves: a store that is up but stalls may hold that back
    only WRITE_BOUND_S (the record then goes on; the peers read "see rank R's log")."""
    from uccl_ep_train import aborts

    class Stalled:
        def set(self, key, value):
            time.sleep(3.0)

    monkeypatch.setattr(aborts, "_store", lambda: Stalled())
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="uccl_ep_train"):
        aborts.publish_message(None, 1, 2, REFUSAL, bound_s=0.2)
    assert 0.15 < time.monotonic() - start < 1.5
    assert "rank 2's abort message was not written to the store within 0.2 s" in caplog.text


def _buffer_after_abort(rank: int, world: int, device: str) -> tuple:
    from uccl_ep_train import Buffer

    buf = Buffer(dist.new_group(list(range(world))), int(1e6), 0)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(8)])
    w = torch.rand(8, 2, generator=g)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                                                   is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                                   topk_idx=idx, topk_weights=w)
    # a refusal every rank makes before entering the backend leaves the Buffer usable
    before = _raised(lambda: buf.combine(recv_x.int(), handle), TypeError)
    buf.combine(recv_x, handle, topk_weights=recv_w)

    backend = buf.backend
    told: list = []
    if rank == 1:  # refuses inside the backend: publishes its abort (a native backend writes the peers' boards)
        def refuse(*args, **kwargs):
            raise RuntimeError(REFUSAL)

        backend.combine = refuse
        backend.abort = lambda op: told.append(op) or True
    else:  # its kernels stopped on rank 1's record (what a native backend reports then)
        def stopped():
            raise RuntimeError("native backend: rank 1 aborted 'combine': see rank 1's log for its error")

        backend.check_errors = stopped
        backend.aborted_by = lambda: (1, "combine")
    dist.barrier()
    raised = _raised(lambda: buf.combine(recv_x, handle, topk_weights=recv_w) if rank == 1 else buf.check_errors())
    dist.barrier()  # rank 1's message is in the store before rank 0 reads it in a later call
    later = _raised(lambda: buf.combine(recv_x, handle, topk_weights=recv_w))
    return before, told, raised, later


def test_a_buffer_refuses_calls_after_an_abort_sent_or_received():
    (before0, told0, raised0, later0), (before1, told1, raised1, later1) = run_ranks(_buffer_after_abort, 2,
                                                                                    timeout=120)
    for before in (before0, before1):
        assert before.startswith("x: dtype"), before
    assert told1 == ["combine"] and told0 == [], (told0, told1)
    assert raised1 == REFUSAL, raised1  # the refusing rank raises its own error unchanged
    assert raised0.startswith(f"rank 1 aborted 'combine': RuntimeError: {REFUSAL} ("), raised0
    for later in (later0, later1):
        assert later.startswith("combine: this Buffer is unusable after an abort (") and \
            "make a new Buffer on every rank" in later, later


# ---- a proxy thread's failure record (issue #44) and a peer's abort across the proxies: what the kernels poll ----

def _record(g) -> list:
    import ctypes

    return list((ctypes.c_int * 8).from_address(g.failure_record(device=False)))


def _wait_record(g, rank: int) -> list:
    """The record once it is set (at most 5 s), as the kernels would read it."""
    import time

    deadline = time.monotonic() + 5
    while g.failure_code() == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    return _record(g)


def _proxy_group(rank: int, world: int, transport: str, fault: str = ""):
    import numpy as np

    from uccl_ep_train import proxy as P

    os.environ.update(FI_PROVIDER="tcp", FI_TCP_IFACE="lo")
    dist.init_process_group("gloo")
    return P.ProxyGroup(rank, world, {0: np.zeros(1 << 16, np.uint8)}, transport=transport, num_threads=2,
                        pin_threads=False, timeout_s=5, gpu=-1, fault=fault)


def _failure_record_worker(rank: int, world: int) -> tuple:
    """Rank 1's proxy thread 1 dies after its second command (die_after=2) while writing to rank 0: its record,
    and rank 0's (told by the dying thread), with how long rank 0 waited for it; rank 1's error text."""
    import time

    from uccl_ep_train import proxy as P

    g = _proxy_group(rank, world, "fabric", "die_after=2" if rank == 1 else "")
    before = g.failure_code()
    dist.barrier()
    start = time.monotonic()
    if rank == 1:
        g.push(1, P.make_commands([(P.OP_WRITE, 0, 1, 0, 4096, 0, 4096) for _ in range(4)]))
    fields = _wait_record(g, rank)
    took = time.monotonic() - start
    error = _raised(g.check) if rank == 1 else ""
    dist.barrier()
    g.close()
    return before, fields, took, error


def test_a_dying_proxy_thread_fills_its_record_and_its_peers():
    from uccl_ep_train.apps.launch import spawn

    n = _native()
    res = spawn(_failure_record_worker, 2, timeout=120)
    (before0, fields0, took0, _), (before1, fields1, _, error1) = res
    assert before0 == before1 == 0
    code = n.ERROR_CODES["proxy_failed"]
    assert fields1[:4] == [code, 1, 1, 1], fields1  # code, rank, peer, thread 1
    assert fields0[:4] == [code, 1, 1, 1], fields0  # told by rank 1's dying thread
    assert took0 < 1.0, took0
    assert "rank 1 proxy thread 1" in error1 and "die_after" in error1, error1
    text = n.describe_error(*fields1[:7], reader=1, ranks_per_node=1, timeout_s=300)
    assert text.startswith("rank 1 (node 1): proxy thread 1 stopped") and "own error follows" in text, text
    text = n.describe_error(*fields0[:7], reader=0, ranks_per_node=1, timeout_s=300)
    assert text.endswith("[rank 1 reported it; rank 0 stopped with it]"), text


def _abort_worker(rank: int, world: int, transport: str) -> tuple:
    g = _proxy_group(rank, world, transport)
    dist.barrier()
    if rank == 2:
        g.abort("combine")
    fields = _wait_record(g, rank) if rank != 2 else _record(g)
    dist.barrier()
    g.close()
    return fields


def test_an_abort_reaches_every_peers_proxy():
    """Over fabric (tcp on loopback); ipc needs a GPU: tests/test_abort_gpu.py's cases run over it."""
    from uccl_ep_train.apps.launch import spawn

    n = _native()
    got = spawn(_abort_worker, 3, "fabric", timeout=120)
    told = [n.ERROR_CODES["aborted"], 2, 2, n.ABORT_OPS.index("combine"), 0, 0, 0, 0]
    assert got == [told, told, [0] * 8], got  # the aborting rank's own record stays clear (NVLink tells its node)


# ---- a value check that fails on one rank's own data (errors.RankLocalError) aborts; an alike one does not ----

def _rank_local_error(rank: int, world: int, device: str) -> tuple:
    """Rank 1 passes an out-of-range expert id to get_dispatch_layout (a RankLocalError, still a ValueError)
    after both ranks passed an invalid num_experts (alike: no abort). Returns what each rank's backend was told to
    abort, what rank 1 raised (type, text) and what rank 0's check_errors raised once its kernels saw the abort
    (the native backend's report, replaced here as in _buffer_after_abort)."""
    from uccl_ep_train import Buffer
    from uccl_ep_train.errors import RankLocalError

    buf = Buffer(dist.new_group(list(range(world))), int(1e6), 0)
    told: list = []
    buf.backend.abort = lambda op: told.append(op) or True
    idx = torch.zeros(4, 2, dtype=torch.int64)
    try:
        buf.get_dispatch_layout(idx, 3)  # 3 experts over 2 ranks: every rank raises this alike
        alike = "no error"
    except ValueError as exc:
        alike = f"{type(exc).__name__}: {exc}"
    told_after_alike = list(told)
    raised = ("no error", "")
    if rank == 1:
        idx[2, 1] = 9
        try:
            buf.get_dispatch_layout(idx, 4)
        except ValueError as exc:
            raised = (isinstance(exc, RankLocalError), str(exc))
    else:
        def stopped():
            raise RuntimeError("native backend: rank 1 aborted 'get_dispatch_layout': see rank 1's log")

        buf.backend.check_errors = stopped
        buf.backend.aborted_by = lambda: (1, "get_dispatch_layout")
    dist.barrier()  # rank 1's message is in the store
    seen = _raised(buf.check_errors) if rank == 0 else "no error"
    return alike, told_after_alike, told, raised, seen


def test_a_rank_local_value_error_aborts_and_an_alike_one_does_not():
    (alike0, before0, told0, _, seen0), (alike1, before1, told1, raised1, _) = run_ranks(_rank_local_error, 2,
                                                                                          timeout=120)
    for alike in (alike0, alike1):
        assert alike.startswith("ValueError: num_experts"), alike
    assert before0 == before1 == [] and told0 == [], (before0, before1, told0)
    assert told1 == ["get_dispatch_layout"], told1
    assert raised1[0] is True and raised1[1].startswith("topk_idx[2, 1] = 9 is outside [-1, 4) on rank 1"), raised1
    assert seen0.startswith("rank 1 aborted 'get_dispatch_layout': RankLocalError: topk_idx[2, 1] = 9"), seen0


def _rank_local_before_the_backend(rank: int, world: int, device: str) -> tuple:
    """Both ranks dispatch; rank 1 then combines with topk_weights of the wrong row count, a RankLocalError the
    Buffer raises before its backend call: it must abort 'combine' all the same (its peer would wait there)."""
    from uccl_ep_train import Buffer
    from uccl_ep_train.errors import RankLocalError

    buf = Buffer(dist.new_group(list(range(world))), int(1e6), 0)
    told: list = []
    buf.backend.abort = lambda op: told.append(op) or True
    x = torch.randn(4, 8)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]], dtype=torch.int64)
    w = torch.ones(4, 2)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                                                   is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                                   topk_idx=idx, topk_weights=w)
    raised = None
    if rank == 1:
        try:
            buf.combine(recv_x, handle, topk_weights=recv_w[:-1])
        except RankLocalError as exc:
            raised = str(exc)
    dist.barrier()
    return told, raised


def test_a_rank_local_error_before_the_backend_call_aborts_too():
    (told0, raised0), (told1, raised1) = run_ranks(_rank_local_before_the_backend, 2, timeout=120)
    assert told0 == [] and raised0 is None, (told0, raised0)
    assert told1 == ["combine"], told1
    assert raised1 is not None and raised1.startswith("topk_weights: has "), raised1
