"""Bad input fails on the calling rank, before any communication, with the argument named; peers that
never arrive end in a timeout naming rank and phase; buffers can be destroyed and made again."""
from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from uccl_ep_train import Buffer, Config
from uccl_ep_train.backends.collectives import CommTimeoutError
from uccl_ep_train.errors import RankLocalError
from uccl_ep_train.fp8 import per_token_cast_to_fp8


def _bad_inputs(rank: int, world: int, device: str) -> int:
    """The catalogue of bad inputs, on whichever backend the group's device selects (reference on CPU ranks,
    native on GPUs; across nodes when UCCL_EP_RANKS_PER_NODE says so)."""
    group = dist.new_group(list(range(world)))
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    buf = Buffer(group, int(1e6), 0)
    other = Buffer(group, int(1e6), 0)
    n, h, e = 6, 256, 8
    x = torch.randn(n, h, device=dev).to(torch.bfloat16)
    idx = torch.tensor([[0, 5], [1, -1], [7, 2], [-1, -1], [3, 4], [6, 0]], device=dev)
    w = torch.rand(n, 2, device=dev)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
    layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert)
    cases = [
        (TypeError, "x: dtype", lambda: buf.dispatch(x.int(), **layout)),
        (ValueError, "x: expected 2 dimensions", lambda: buf.dispatch(x.view(-1), **layout)),
        (ValueError, "x: must be contiguous", lambda: buf.dispatch(x.t(), **layout)),
        (TypeError, "topk_idx: dtype", lambda: buf.dispatch(x, topk_idx=idx.float(), topk_weights=w, **layout)),
        (ValueError, "topk_idx: expected 2 dimensions", lambda: buf.get_dispatch_layout(idx.view(-1), e)),
        (TypeError, "topk_weights: dtype", lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w.double(), **layout)),
        (ValueError, "topk_weights: shape", lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w[:, :1].contiguous(), **layout)),
        (ValueError, rf"^topk_idx\[2, 0\] = 8 is outside \[-1, 8\) on rank {rank}: expert ids are -1",
         lambda: buf.get_dispatch_layout(idx.clamp(max=6) + 2, e)),
        (ValueError, r"^topk_idx\[1, 1\] = -2 is outside \[-1, 8\)", lambda: buf.get_dispatch_layout(idx - 1, e)),
        (ValueError, "num_experts: 7 experts cannot be split", lambda: buf.get_dispatch_layout(idx.clamp(max=6), 7)),
        (ValueError, "topk_idx: has 5 rows but x has 6", lambda: buf.dispatch(x, topk_idx=idx[:5], topk_weights=w[:5], **layout)),
        (ValueError, "is_token_in_rank: expected", lambda: buf.dispatch(x[:5], **layout)),
        (ValueError, "num_tokens_per_rank: .* disagrees", lambda: buf.dispatch(
            x, **{**layout, "num_tokens_per_rank": per_rank + 1})),
        (ValueError, r"x\[0\]: hidden \(200\) must be divisible by 128", lambda: buf.dispatch(
            (torch.zeros(n, 200, dtype=torch.float8_e4m3fn, device=dev), torch.ones(n, 1, device=dev)), **layout)),
        (ValueError, r"x\[1\]: scales must be", lambda: buf.dispatch(
            (per_token_cast_to_fp8(x)[0], torch.ones(n, 3, device=dev)), **layout)),
        (TypeError, r"x\[0\]: this device uses float8_e4m3fn", lambda: buf.dispatch(
            (per_token_cast_to_fp8(x)[0].view(torch.float8_e4m3fnuz), per_token_cast_to_fp8(x)[1]), **layout)),
        (ValueError, "expert_alignment", lambda: buf.dispatch(x, expert_alignment=0, **layout)),
        (ValueError, "num_worst_tokens", lambda: buf.dispatch(x, num_worst_tokens=-1, **layout)),
        (ValueError, "num_max_tokens_per_rank: bounds a dispatch with num_worst_tokens only",
         lambda: buf.dispatch(x, num_max_tokens_per_rank=n, **layout)),
        (ValueError, rf"^x: has {n} tokens, more than num_max_tokens_per_rank={n - 1}$",
         lambda: buf.dispatch(x, num_worst_tokens=n * world, num_max_tokens_per_rank=n - 1, **layout)),
        (ValueError, "required without a handle", lambda: buf.dispatch(x)),
        (TypeError, "previous_event", lambda: buf.dispatch(x, previous_event=object(), **layout)),
        (TypeError, "config", lambda: buf.dispatch(x, config=(24, 8, 256), **layout)),
        (RuntimeError, "low_latency_mode=False", lambda: buf.low_latency_dispatch(x, idx, 16, e)),
        (ValueError, "group", lambda: Buffer(None)),
        (NotImplementedError, "allow_mnnvl", lambda: Buffer(group, allow_mnnvl=True)),
        (ValueError, "set_num_sms", lambda: Buffer.set_num_sms(7)),
    ]
    recv_x = handle = None

    def expect(exc, pattern, call) -> None:
        """`call` raises `exc` matching `pattern`. A check of this rank's own values (RankLocalError) aborts the
        call on the peers of a native Buffer (docs/api.md, "Aborts"), which must then be made again; every
        rank raised the same here, so every rank remakes it (and, after the first dispatch, its handle)."""
        nonlocal buf, recv_x, handle
        with pytest.raises(exc, match=pattern) as raised:
            call()
        if isinstance(raised.value, RankLocalError) and buf.backend_name == "native":
            with pytest.raises(RuntimeError, match="unusable after an abort"):
                buf.dispatch(x, **layout)
            buf.destroy()
            buf = Buffer(group, int(1e6), 0)
            if handle is not None:
                recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)

    for exc, pattern, call in cases:
        expect(exc, pattern, call)
    # a valid call still works afterwards: no rank entered a collective above (or the Buffer was remade)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
    handle_cases = [
        (ValueError, "made by another Buffer", lambda: other.combine(recv_x, handle)),
        (ValueError, "made by another Buffer", lambda: other.dispatch(x, handle=handle)),
        (TypeError, "expected the handle", lambda: buf.combine(recv_x, tuple(handle)[:6])),
        (ValueError, "x: has 3 tokens, the handle was made for 6", lambda: buf.dispatch(x[:3], handle=handle)),
        (ValueError, "must be None with a cached handle", lambda: buf.dispatch(x, handle=handle, topk_idx=idx)),
        (ValueError, r"bias\[0\]: expected", lambda: buf.combine(recv_x, handle, bias=torch.zeros(2, h, device=dev))),
        (TypeError, "topk_weights: dtype", lambda: buf.combine(recv_x, handle, topk_weights=torch.zeros(recv_x.size(0), 2, dtype=torch.int32, device=dev))),
    ]
    # every rank adds this case or none does: a native Buffer is remade after it (collective)
    received = torch.tensor([recv_x.size(0)])
    dist.all_reduce(received, op=dist.ReduceOp.MIN, group=group)
    if int(received):
        handle_cases.append((ValueError, "x: has 0 rows", lambda: buf.combine(recv_x[:0], handle)))
    for exc, pattern, call in handle_cases:
        expect(exc, pattern, call)
    combined, _, _ = buf.combine(recv_x, handle)
    assert combined.shape == x.shape

    ll = Buffer(group, 0, 1024, low_latency_mode=True)
    with pytest.raises(ValueError, match="num_rdma_bytes: this Buffer has 1024 bytes"):
        ll.low_latency_dispatch(x, idx, 16, e)
    with pytest.raises(ValueError, match="exceed num_max_dispatch_tokens_per_rank"):
        ll.low_latency_dispatch(x, idx, 4, e)
    with pytest.raises(ValueError, match="use_ue8m0"):
        ll.low_latency_dispatch(x, idx, 16, e, use_fp8=True, use_ue8m0=True)
    ll_ok = Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(16, h, 2, e), low_latency_mode=True)
    _, _, ll_handle, _, _ = ll_ok.low_latency_dispatch(x, idx, 16, e, use_fp8=False)
    with pytest.raises(ValueError, match="topk_weights: required"):
        ll_ok.low_latency_combine(torch.zeros(e // 2, 32, h, dtype=torch.bfloat16, device=dev), idx, None, ll_handle)
    with pytest.raises(ValueError, match="made by another Buffer"):
        ll.low_latency_combine(torch.zeros(e // 2, 32, h, dtype=torch.bfloat16, device=dev), idx, w, ll_handle)
    with pytest.raises(NotImplementedError, match="dispatch_wait_recv_cost_stats"):
        ll.low_latency_dispatch(x, idx, 16, e, dispatch_wait_recv_cost_stats=torch.zeros(2, 2, dtype=torch.int64, device=dev))

    # destroy releases; a destroyed Buffer refuses work; a new one works in the same process
    buf.destroy()
    buf.destroy()
    with pytest.raises(RuntimeError, match="after destroy"):
        buf.dispatch(x, **layout)
    again = Buffer(group, int(1e6), 0)
    recv2, *_ = again.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
    assert torch.equal(recv2, recv_x)
    return len(cases) + len(handle_cases)


def test_bad_inputs_raise_named_errors():
    counts = run_ranks(_bad_inputs, 2)
    assert counts[0] >= 30


@pytest.mark.gpu
@pytest.mark.parametrize("ranks_per_node", [None, "1"], ids=["intranode", "internode-2x1"])
def test_bad_inputs_raise_named_errors_on_the_native_backend(mps, ranks_per_node):
    # the catalogue's value errors are the host's checks (opt-in where the kernels check the values:
    # tests/test_cuda_graphs.py checks the GPU's)
    env = {"UCCL_EP_BACKEND": "native", "UCCL_EP_CHECK_VALUES": "1",
           **({"UCCL_EP_RANKS_PER_NODE": ranks_per_node} if ranks_per_node else {})}
    counts = run_ranks(_bad_inputs, 2, device="cuda", backend="gloo", ranks_per_gpu=2, env=env, timeout=300)
    assert counts[0] >= 30


def _mismatch(rank: int, world: int, device: str) -> str:
    group = dist.new_group(list(range(world)))
    buf = Buffer(group, int(1e6), 0)
    h = 128 if rank == 0 else 256  # ranks disagree: caught in the notify phase on every rank
    x = torch.randn(4, h).to(torch.bfloat16)
    idx = torch.tensor([[0], [1], [2], [3]])
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    with pytest.raises(ValueError, match="ranks disagree on hidden: rank 0=128, rank 1=256"):
        buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    # same shapes for the dispatch; then combine / cached dispatch with a per-rank hidden size
    x = torch.randn(4, 128).to(torch.bfloat16)
    recv, *_, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                       num_tokens_per_expert=per_expert)
    wide = torch.randn(recv.size(0), 128 if rank == 0 else 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match="combine: ranks disagree on hidden: rank 0=128, rank 1=256"):
        buf.combine(wide, handle)
    with pytest.raises(ValueError, match="cached dispatch: ranks disagree on x dtype"):
        buf.dispatch(x if rank == 0 else x.float(), handle=handle)
    with pytest.raises(NotImplementedError, match="get_local_buffer_tensor: the reference backend"):
        buf.get_local_buffer_tensor(torch.bfloat16)
    return "ok"


def test_cross_rank_mismatch_is_reported_on_every_rank():
    assert run_ranks(_mismatch, 2) == ["ok", "ok"]


def _native_shape_mismatch(rank: int, world: int, device: str) -> list:
    group = dist.new_group(list(range(world)))
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(group, int(1e8), int(1e8))
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]], device=dev)
    w = torch.rand(4, 2, device=dev)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert, topk_idx=idx)
    x = torch.randn(4, 128, device=dev)
    messages = []
    for call in (lambda: buf.dispatch(torch.randn(4, 128 * (rank + 1), device=dev).to(torch.bfloat16),
                                      topk_weights=w, **layout),
                 lambda: buf.dispatch(x.to(torch.bfloat16 if rank == 0 else torch.float16), topk_weights=w, **layout),
                 lambda: buf.dispatch(x.to(torch.bfloat16), topk_weights=w if rank == 0 else None, **layout)):
        with pytest.raises(ValueError) as err:
            call()
        messages.append(str(err.value))
    recv, *_ = buf.dispatch(x.to(torch.bfloat16), topk_weights=w, **layout)  # agreeing calls go on
    assert recv.size(1) == 128
    buf.destroy()
    return messages


@pytest.mark.gpu
@pytest.mark.parametrize("ranks_per_node", [None, "1"], ids=["intranode", "internode-2x1"])
def test_native_ranks_disagreeing_on_a_dispatch_get_the_same_error(mps, ranks_per_node):
    """A fresh dispatch carries its shape with the counts: ranks that differ in row size, dtype or weights all
    raise the same error, before any row moves, and the next agreeing call works."""
    env = {"UCCL_EP_BACKEND": "native", "UCCL_EP_TIMEOUT_S": "30",
           **({"UCCL_EP_RANKS_PER_NODE": ranks_per_node} if ranks_per_node else {})}
    per_rank = run_ranks(_native_shape_mismatch, 2, device="cuda", backend="gloo", ranks_per_gpu=2, env=env,
                         timeout=180)
    assert per_rank[0] == per_rank[1]
    rows, dtype, weights = per_rank[0]
    assert "dispatch: ranks disagree on x row bytes: rank 0=256, rank 1=512" in rows
    assert "dispatch: ranks disagree on x dtype: rank 0=1, rank 1=2" in dtype
    assert "dispatch: ranks disagree on top-k format (+1 weights, +2 expert-major ids): rank 0=1, rank 1=0" in weights


def _native_expert_major_format_mismatch(rank: int, world: int, device: str) -> list:
    """Rank 0's Config expands a fresh expert-major dispatch inside the kernel (its senders pack positions into
    the id words), rank 1's runs the separate permute kernels (its receivers would read plain ids): host-sized
    (the host compares the headers: the next agreeing call goes on) and sync-free (notify compares them)."""
    group = dist.new_group(list(range(world)))
    dev = torch.device("cuda", torch.cuda.current_device())
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]], device=dev)
    w = torch.rand(4, 2, device=dev)
    x = torch.randn(4, 128, device=dev).to(torch.bfloat16)
    mine = Config(fuse_max_width=1e9) if rank == 0 else Config(fuse_max_width=0, expand_blocks=0)
    messages = []
    buf = Buffer(group, int(1e8))
    with pytest.raises(ValueError) as err:
        buf.dispatch_expert_major(x, idx, w, 4, config=mine)
    messages.append(str(err.value))
    x_em, *_ = buf.dispatch_expert_major(x, idx, w, 4, config=Config(fuse_max_width=1e9))  # agreeing: goes on
    assert x_em.size(1) == 128
    buf.destroy()
    buf = Buffer(group, int(1e8))  # (a kernel's report leaves a native Buffer unusable)
    with pytest.raises(RuntimeError) as err:
        buf.dispatch_expert_major(x, idx, w, 4, config=mine, num_worst_tokens=4 * world, expert_capacity=4)
        torch.cuda.synchronize()
        buf.check_errors()
    messages.append(str(err.value))
    buf.destroy()
    return messages


@pytest.mark.gpu
def test_native_ranks_whose_configs_disagree_on_the_expert_major_wire_format_raise(mps):
    """Config.fuse_max_width / expand_blocks are per call, so no check at Buffer creation covers them: the
    decision they make travels in the call's shape header (top-k format), compared before any row moves."""
    per_rank = run_ranks(_native_expert_major_format_mismatch, 2, device="cuda", backend="gloo", ranks_per_gpu=2,
                         env={"UCCL_EP_BACKEND": "native", "UCCL_EP_TIMEOUT_S": "30"}, timeout=180)
    field = re.escape("top-k format (+1 weights, +2 expert-major ids)")
    for host_sized, sync_free in per_rank:
        assert "dispatch: ranks disagree on top-k format (+1 weights, +2 expert-major ids): rank 0=3, rank 1=1" \
            in host_sized
        assert re.search(rf"dispatch: ranks disagree on {field}: rank \d=[13], rank \d=[13]", sync_free), sync_free


def _native_cached_mismatch(rank: int, world: int, device: str) -> list:
    """Per case a fresh Buffer (an error leaves a native Buffer unusable): an agreeing fresh dispatch, then a
    cached dispatch or a combine on which the ranks disagree. Neither has a notify: the kernels compare the
    shape each peer published with its rows."""
    group = dist.new_group(list(range(world)))
    dev = torch.device("cuda", torch.cuda.current_device())
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]], device=dev)
    w = torch.rand(4, 2, device=dev)
    x = torch.randn(4, 128, device=dev).to(torch.bfloat16)
    messages = []
    for bad in (lambda buf, h, recv, rw: buf.dispatch(torch.randn(4, 128 * (rank + 1), device=dev).to(torch.bfloat16),
                                                      handle=h),
                lambda buf, h, recv, rw: buf.combine(recv if rank == 0 else recv.to(torch.float16), h),
                lambda buf, h, recv, rw: buf.combine(recv, h, topk_weights=rw if rank == 0 else None)):
        buf = Buffer(group, int(1e8))
        assert buf.backend_name == "native"
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
        recv, _, rw, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        with pytest.raises(RuntimeError) as err:
            bad(buf, handle, recv, rw)
            torch.cuda.synchronize()
            buf.check_errors()
        messages.append(str(err.value))
        buf.destroy()
    return messages


@pytest.mark.gpu
def test_native_ranks_disagreeing_on_a_cached_dispatch_or_combine_raise(mps, monkeypatch):
    """Without the check the rows land at offsets of the wrong size in the peer's buffer and come out as
    garbage, silently."""
    monkeypatch.delenv("UCCL_EP_CHECK_VALUES", raising=False)
    per_rank = run_ranks(_native_cached_mismatch, 2, device="cuda", backend="gloo", ranks_per_gpu=2,
                         env={"UCCL_EP_BACKEND": "native", "UCCL_EP_TIMEOUT_S": "30"}, timeout=180)
    for messages in per_rank:
        rows, dtype, weights = messages
        assert re.search(r"dispatch: ranks disagree on x row bytes: rank \d=(256|512), rank \d=(256|512)", rows), rows
        assert re.search(r"combine: ranks disagree on (x row bytes|x dtype): rank \d=\d+, rank \d=\d+", dtype), dtype
        assert re.search(r"combine: ranks disagree on num_topk: rank \d=[02], rank \d=[02]", weights), weights


def _missing_peer(rank: int, world: int, device: str, error: type, pattern: str, bound_s: float) -> str:
    group = dist.new_group(list(range(world)))
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    buf = Buffer(group, int(1e6), int(1e6))
    if rank == 1:
        time.sleep(bound_s + 2)  # never calls dispatch
        return "absent"
    x = torch.randn(4, 128, device=dev).to(torch.bfloat16)
    idx = torch.tensor([[0], [1], [2], [3]], device=dev)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    start = time.monotonic()
    with pytest.raises(error, match=pattern):
        buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                     num_tokens_per_expert=per_expert)
    assert time.monotonic() - start < bound_s
    return "timed out"


def test_missing_peer_times_out_with_rank_and_phase():
    results = run_ranks(_missing_peer, 2, CommTimeoutError,
                        r"rank 0 timed out after 1s in phase 'dispatch: notify header'", 3,
                        env={"UCCL_EP_TIMEOUT_S": "1"}, timeout=60, hard_exit=True)
    assert results == ["timed out", "absent"]


@pytest.mark.gpu
@pytest.mark.parametrize("ranks_per_node,pattern", [
    (None, r"rank 0 timed out after 1 s in 'dispatch \(notify\)' waiting for rank 1: rank 1 never started"),
    ("1", r"rank 0 \(node 0\) timed out after 1 s in 'dispatch \(notify\)' waiting for rank 1 \(node 1\)"),
], ids=["intranode", "internode-2x1"])
def test_missing_peer_times_out_on_the_native_backend(mps, ranks_per_node, pattern):
    env = {"UCCL_EP_TIMEOUT_S": "1", "UCCL_EP_BACKEND": "native",
           **({"UCCL_EP_RANKS_PER_NODE": ranks_per_node} if ranks_per_node else {})}
    results = run_ranks(_missing_peer, 2, (RuntimeError, CommTimeoutError), pattern, 6, device="cuda",
                        backend="gloo", ranks_per_gpu=2, env=env, timeout=120, hard_exit=True)
    assert results == ["timed out", "absent"]


def test_config_positional_like_deepep():
    c = Config(24, 8, 256, 16, 128)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (24, 8, 256)
    with pytest.raises(ValueError, match="num_max_nvl_chunked_send_tokens must be <="):
        Config(24, 512, 256)


@pytest.mark.parametrize("module, cls, prefix", [
    ("native", "NativeBackend", "native backend"),
    ("internode", "NativeInternodeBackend", "native internode backend"),
    ("low_latency", "NativeLowLatencyBackend", "native low-latency kernels"),
])
def test_a_recorded_error_makes_a_native_backend_unusable(module, cls, prefix):
    """The first error a native buffer's kernels or proxies recorded is raised, then every later call raises
    it as 'unusable after an earlier error'; a destroyed backend says so (one mechanism for all three)."""
    import importlib

    backend_cls = getattr(importlib.import_module(f"uccl_ep_train.backends.{module}"), cls)

    class Kernels:
        msg = ""

        def error(self):
            return self.msg

    class Proxies:
        def check(self):
            raise RuntimeError("rejected command to rank 1")

    b = object.__new__(backend_cls)
    b._buf, b._failed = Kernels(), None
    b.check_errors()  # nothing recorded
    b._buf.msg = "timeout on rank 0 waiting for rank 1 (dispatch)"
    if module != "native":
        b._proxy = Proxies()
    with pytest.raises(RuntimeError) as first:
        b.check_errors()
    want = f"{prefix}: timeout on rank 0 waiting for rank 1 (dispatch)"
    assert str(first.value) == want + ("; proxy: rejected command to rank 1" if module != "native" else "")
    b._buf.msg = ""
    with pytest.raises(RuntimeError, match=f"^{prefix}: unusable after an earlier error: timeout on rank 0"):
        b.check_errors()
    b._failed, b._buf = None, None
    with pytest.raises(RuntimeError, match=f"^{prefix}: destroyed$"):
        b.check_errors()


def _grow_verdict(rank: int, world: int, device: str, recorder: int) -> list:
    """A native backend's agreement before a grow, on CPU ranks: rank `recorder` (-1: none) holds a kernel
    error record. Returns what this rank raised ("" when nothing) and what check_errors says after it."""
    from uccl_ep_train.backends import native

    class Kernels:
        def error(self):
            return "topk_idx[0, 1] = 9 is outside [-1, 8) on rank 1" if rank == recorder else ""

    native.quiesce = lambda device, group: dist.barrier(group=group)  # (no GPU here: the barrier alone)
    b = object.__new__(native.NativeBackend)
    b._buf, b._failed, b.device = Kernels(), None, torch.device("cpu")
    b.group = dist.new_group(list(range(world)))
    out = []
    for step in (b._quiesce_before_grow, b.check_errors):  # the raise, then the backend unusable
        try:
            step()
            out.append("")
        except RuntimeError as exc:
            out.append(str(exc))
    return out


@pytest.mark.parametrize("recorder", [-1, 1])
def test_a_grow_needs_every_rank_without_an_error_record(recorder):
    """A grow replaces the buffers holding the kernels' error records: before it, every rank's record is
    gathered and every rank raises when any rank has one (its own, or the first rank's), so no rank goes on
    into the grow's collectives alone and no recorded error is dropped (the GPU test: test_a_grow_raises_...)."""
    got = run_ranks(_grow_verdict, 3, recorder)
    if recorder < 0:
        assert got == [["", ""]] * 3
        return
    own = "native backend: topk_idx[0, 1] = 9 is outside [-1, 8) on rank 1"
    theirs = ("native backend: rank 1 recorded an error before the buffers could grow: topk_idx[0, 1] = 9 is "
              "outside [-1, 8) on rank 1")
    assert [g[0] for g in got] == [theirs, own, theirs]
    assert all(g[1].startswith("native backend: unusable after an earlier error: ") for g in got), got


def test_buffer_check_errors_covers_the_low_latency_calls():
    """Buffer.check_errors raises what the LL calls' backend recorded too, not only the HT backend's (a
    low-latency Buffer across nodes opens its HT backend only in its first HT dispatch)."""
    from uccl_ep_train import Buffer

    class Quiet:
        def check_errors(self) -> None:
            pass

    class Failed:
        def check_errors(self) -> None:
            raise RuntimeError("native low-latency kernels: timeout on rank 0 waiting for rank 1 (dispatch recv)")

        def aborted_by(self) -> None:  # a timeout, not a peer's abort
            return None

    buf = object.__new__(Buffer)
    buf._backend, buf._ll_backend = Quiet(), None
    buf.check_errors()
    buf._ll_backend = Failed()
    with pytest.raises(RuntimeError, match="^native low-latency kernels: timeout on rank 0"):
        buf.check_errors()
    buf._backend = buf._ll_backend = None  # (nothing for __del__ to release)


# ---- every error record reads as a sentence (csrc/common/errors.h, through _native.describe_error) --------

def _native_or_skip():
    from uccl_ep_train.backends.native import _module

    try:
        m = _module()
    except ImportError as exc:
        pytest.skip(f"native module missing: {exc}")
    if not hasattr(m, "describe_error"):
        pytest.skip("native module built before describe_error")
    return m


# (code, phase, ranks_per_node, record (rank, peer, block, need, have), reader, what the sentence must say)
_SENTENCES = [
    ("timeout", "intranode_notify", 0, (0, 1, 3, 5, 4), 0,
     [r"^rank 0 timed out after 2 s in 'dispatch \(notify\)' waiting for rank 1: rank 1 never started this "
      r"dispatch \(its counts did not arrive\)\. Is every rank calling dispatch", "raised earlier, or exited",
      r"raise UCCL_EP_TIMEOUT_S if rank 1 is only slow \(block 3, need 5, have 4\)$"]),
    ("timeout", "intranode_dispatch", 0, (2, 1, 0, 9, 7), 2,
     [r"^rank 2 timed out after 2 s in 'dispatch' waiting for rank 1: rank 1 did not deliver its dispatch rows",
      r"\(block 0, need 9, have 7\)$"]),
    ("timeout", "intranode_combine", 0, (0, 3, 1, 2, 1), 0,
     [r"in 'combine' waiting for rank 3: rank 3 did not send back its combine rows",
      "Is every rank calling combine with the handle of the same dispatch?"]),
    ("timeout", "intranode_combine", 0, (1, 1, 4, 6, -1), 1,  # a rank's own side blocks
     [r"^rank 1 timed out .* waiting for rank 1: this rank's own side blocks did not finish \(another kernel may "
      r"hold the SMs they need"]),
    ("timeout", "internode_notify", 2, (0, 3, 0, 5, 4), 0,
     [r"^rank 0 \(node 0\) timed out after 2 s in 'dispatch \(notify\)' waiting for rank 3 \(node 1\) on channel "
      r"0: rank 3 \(node 1\) never started this dispatch", r"a dead proxy thread or link stops it too",
      r"uccl-ep-train doctor --peers", r"\(need 5, have 4\)$"]),
    ("timeout", "internode_dispatch_send", 2, (0, 2, 1, 1, 0), 0, ["never became ready for this dispatch"]),
    ("timeout", "internode_dispatch_forward", 2, (1, 2, 3, 5, 4), 1,
     [r"in 'dispatch \(forward\)' waiting for rank 2 \(node 1\) on channel 3: the dispatch rows from rank 2"]),
    ("timeout", "internode_dispatch_copy_out", 2, (1, 0, 2, 5, 4), 1, ["the dispatch rows forwarded by rank 0"]),
    ("timeout", "internode_combine_stage", 2, (1, 2, 0, 5, 4), 1,
     ["never became ready for this combine", "combine with the handle of the same dispatch"]),
    ("timeout", "internode_combine_forward", 2, (1, 2, 5, 5, 4), 1, ["the combine rows from rank 2"]),
    ("timeout", "internode_combine_reduce", 2, (1, 0, 5, 5, 4), 1, ["the combine rows forwarded by rank 0"]),
    ("timeout", "low_latency_dispatch_send", 1, (0, 1, 2, 5, 4), 0,
     [r"in 'low_latency_dispatch \(send\)' waiting for rank 1 \(node 1\) on channel 2: rank 1 \(node 1\) never "
      r"became ready", "the same num_max_dispatch_tokens_per_rank and num_experts", "doctor --peers"]),
    ("timeout", "low_latency_dispatch_recv", 0, (0, 1, -1, 5, 4), 0,  # one node: over NVLink, no proxies
     [r"^rank 0 timed out .* waiting for rank 1 over NVLink: the low_latency_dispatch tokens of rank 1 did not "
      r"arrive", r"\(need 5, have 4\)$"]),
    ("timeout", "low_latency_combine_send", 1, (0, 1, 2, 5, 4), 0, ["never became ready for this low_latency_combine"]),
    ("timeout", "low_latency_combine_recv", 1, (0, 1, 2, 5, 4), 0, ["the low_latency_combine rows of rank 1"]),
    ("capacity", "intranode_dispatch", 0, (0, 1, 0, 900, 512), 0,
     [r"^dispatch on rank 0: the buffer of rank 1 holds 512 rows, the call needs 900: .*larger num_nvl_bytes$"]),
    ("capacity", "intranode_combine", 0, (1, 0, 0, 900, 512), 1, [r"^combine on rank 1: the buffer of rank 0"]),
    ("worst_tokens", "intranode_notify", 0, (1, -1, 0, 70, 64), 1,
     [r"^dispatch: rank 1 receives 70 tokens, more than num_worst_tokens=64: pass a num_worst_tokens of at least"]),
    ("bad_counts", "intranode_notify", 0, (0, 1, 0, 3, 2), 0,
     [r"^dispatch on rank 0: num_tokens_per_rank\[1\] = 3 but is_token_in_rank sends 2 tokens to rank 1: pass the "
      r"num_tokens_per_rank that get_dispatch_layout returned", "UCCL_EP_CHECK_VALUES=1"]),
    ("bad_expert", "intranode_layout", 0, (0, 5, 1, 261, 256), 0,
     [r"^topk_idx\[5, 1\] = 261 is outside \[-1, 256\) on rank 0: expert ids are -1 \(no expert\) or in "
      r"\[0, num_experts\); found on the GPU by get_dispatch_layout, which left it out of the counts"]),
    ("bad_expert", "low_latency_dispatch_send", 0, (1, 0, 2, -7, 8), 1,
     [r"^topk_idx\[0, 2\] = -7 is outside \[-1, 8\) on rank 1: .* found on the GPU by low_latency_dispatch, which "
      r"moved nothing for it"]),
    ("shape", "intranode_notify", 0, (0, 1, 1, 256, 512), 0,
     [r"^dispatch: ranks disagree on x row bytes: rank 0=256, rank 1=512; every rank must make the same call"]),
    ("shape", "intranode_combine", 0, (0, 1, 6, 1, 2), 0, [r"^combine: ranks disagree on x dtype: rank 0=1, rank 1=2"]),
    ("expert_capacity", "intranode_notify", 0, (1, 0, 3, 24, 1), 1,
     [r"^dispatch_expert_major: rank 0 sends 24 tokens to local expert 3 of rank 1, more than expert_capacity=1: "
      r"pass a larger expert_capacity"]),
    ("node_rows", "internode_notify", 2, (0, 3, 1, 900, 512), 0,
     [r"^dispatch: rank 3 sends 900 tokens to node 1, more than the 512 this dispatch without a host sync sized its "
      r"buffers for .*: its num_tokens_per_rdma_rank disagrees with its num_tokens_per_rank"]),
    ("bad_row", "internode_dispatch_forward", 2, (2, 1, 1, 700, 64), 2,
     [r"^dispatch \(forward\) on rank 2 \(node 1\): a row from rank 1 \(node 0\) that landed here names receive "
      r"row 700 on local rank 1, outside the 64 rows that rank receives from it, and was not forwarded: either "
      r"that rank's num_tokens_per_rank disagrees with its is_token_in_rank"]),
    ("bad_row", "internode_dispatch_forward", 2, (2, 1, 0, -2, 64), 2, [r"names another source rank, and was not"]),
    ("ring_full", "internode_combine_forward", 2, (0, 3, 4, 2, 0), 0,
     [r"^rank 0 \(node 0\): the proxy ring of channel 4 stayed full for 2 s in 'combine \(forward\)' \(sending to "
      r"rank 3 \(node 1\)\): the proxy thread stopped draining it", r"\(need 2, have 0\)$"]),
    ("ring_full", "low_latency_combine_send", 1, (1, 0, 1, 2, 0), 1, ["stayed full for 2 s in 'low_latency_combine"]),
    ("expert_full", "low_latency_dispatch_send", 0, (0, 7, 0, 96, 32), 0,
     [r"^low_latency_dispatch on rank 0: expert 7 gets 96 rows from this rank, more than "
      r"num_max_dispatch_tokens_per_rank=32: some token lists that expert more than once in topk_idx; the rows "
      r"past 32 were dropped"]),
]


@pytest.mark.parametrize("code,phase,per_node,record,reader,want", _SENTENCES,
                         ids=[f"{c}-{p}" for c, p, *_ in _SENTENCES])
def test_an_error_record_reads_as_a_sentence(code, phase, per_node, record, reader, want):
    m = _native_or_skip()
    rank, peer, block, need, have = record
    text = m.describe_error(m.ERROR_CODES[code], rank, peer, block, m.ERROR_PHASES[phase], need, have, reader,
                            per_node, 2.0)
    for pattern in want:
        assert re.search(pattern, text), f"{pattern!r} not in: {text}"
    assert not re.search(r"error (code )?\d|phase \d", text), text  # no raw code reaches a user


def test_every_code_and_phase_has_its_words():
    """Each code the kernels record, in each phase, names a known call and phase (no 'unknown'); a peer's
    record read on another rank says whose it is; a code this Python does not know says to rebuild."""
    m = _native_or_skip()
    for code in m.ERROR_CODES.values():
        for phase in m.ERROR_PHASES.values():
            text = m.describe_error(code, 1, 2, 0, phase, 5, 4, 1, 0, 2.0)
            assert text and "unknown" not in text, (code, phase, text)
            assert "[rank" not in text, text
    peer = m.describe_error(m.ERROR_CODES["timeout"], 0, 1, 0, m.ERROR_PHASES["intranode_dispatch"], 5, 4, 1)
    assert re.search(r"\[rank 0 reported it; rank 1 stopped with it\] \(block 0, need 5, have 4\)$", peer), peer
    assert m.describe_error(0, 0, 0, 0, 1, 0, 0, 0) == ""
    odd = m.describe_error(42, 0, 0, 0, 99, 1, 2, 0)
    assert odd.startswith("unknown error code 42 on rank 0 in 'an unknown phase'") and "rebuild" in odd, odd


def test_host_timeouts_say_what_to_do():
    from uccl_ep_train import errors

    text = errors.exchange_timed_out(2, "combine: rows", "3", 300.0)
    assert text.startswith("uccl_ep_train: rank 2 timed out after 300s in phase 'combine: rows' (channel 3): a peer "
                           "rank never arrived. Is every rank making the same Buffer calls in the same order?"), text
    assert "raise UCCL_EP_TIMEOUT_S" in text
    failed = errors.exchange_failed(0, "dispatch: notify header", "-", ConnectionError("Connection closed by peer"))
    assert "failed in phase 'dispatch: notify header' (channel -): Connection closed by peer" in failed
    assert "look for its own error first" in failed


def test_host_sentences_match_the_kernels_words():
    """The host's expert-id and shape sentences begin as the kernels' do (one wording for every backend)."""
    from uccl_ep_train import errors

    m = _native_or_skip()
    gpu = m.describe_error(m.ERROR_CODES["bad_expert"], 3, 2, 1, m.ERROR_PHASES["intranode_layout"], 300, 256, 3)
    host = errors.bad_expert_id("topk_idx", 2, 1, 300, 256, 3)
    assert gpu.startswith(host + ";"), (gpu, host)
    gpu = m.describe_error(m.ERROR_CODES["shape"], 0, 1, 3, m.ERROR_PHASES["intranode_combine"], 2, 4, 0)
    assert gpu == errors.ranks_disagree("combine", "num_topk", [2, 4]), gpu


def test_check_expert_range_names_the_first_bad_id_and_its_position():
    from uccl_ep_train.validation import check_expert_range

    idx = torch.tensor([[0, 3], [-1, 2], [4, 9], [-5, 1]])
    with pytest.raises(ValueError, match=r"^topk_idx\[2, 1\] = 9 is outside \[-1, 8\) on rank 3: expert ids are "
                                         r"-1 \(no expert\) or in \[0, num_experts\)$"):
        check_expert_range(idx, 8, 3)
    with pytest.raises(ValueError, match=r"^topk_idx\[3, 0\] = -5 is outside \[-1, 16\)"):
        check_expert_range(idx, 16, 0)
    check_expert_range(idx.clamp(min=-1), 16, 0)  # -1 (no expert) and ids below num_experts pass
    check_expert_range(torch.empty(0, 2, dtype=torch.int64), 8, 0)


# ---- out-of-range expert ids on every call that takes topk_idx ---------------------------------------------

def _bad_expert_ids(rank: int, world: int, device: str) -> list[str]:
    """Each rank routes one bad id of its own (rank r: row r % 4, column 1, value E + r; rank 1 also a -3): every
    call that takes topk_idx refuses it on that rank, naming argument, position, value and range, before any
    communication (a valid call still works afterwards on every rank). The messages come back for the test."""
    group = dist.new_group(list(range(world)))
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    n, h, e = 6, 128, 4 * world
    x = torch.randn(n, h, device=dev).to(torch.bfloat16)
    idx = torch.stack([torch.arange(n) % e, (torch.arange(n) + 1) % e], 1).to(dev)
    w = torch.rand(n, 2, device=dev)
    bad = idx.clone()
    bad[rank % 4, 1] = e + rank
    if rank == 1:
        bad[0, 0] = -3
    row, col, value = (0, 0, -3) if rank == 1 else (rank % 4, 1, e + rank)
    want = rf"^topk_idx\[{row}, {col}\] = {value} is outside \[-1, {e}\) on rank {rank}: expert ids are -1"
    buf = Buffer(group, int(1e6), 0)
    seen = []
    with pytest.raises(ValueError, match=want) as info:
        buf.get_dispatch_layout(bad, e)
    seen.append(str(info.value))
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
    layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert)
    with pytest.raises(ValueError, match=want):
        buf.dispatch(x, topk_idx=bad, topk_weights=w, **layout)
    with pytest.raises(ValueError, match=want):
        buf.dispatch_expert_major(x, bad, w, e)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)  # nobody hangs
    assert buf.combine(recv_x, handle)[0].shape == x.shape
    ll = Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(16, h, world, e), low_latency_mode=True)
    with pytest.raises(ValueError, match=want):
        ll.low_latency_dispatch(x, bad, 16, e, use_fp8=False)
    recv, _, ll_handle, _, _ = ll.low_latency_dispatch(x, idx, 16, e, use_fp8=False)
    with pytest.raises(ValueError, match=want):
        ll.low_latency_combine(recv, bad, w, ll_handle)
    assert ll.low_latency_combine(recv, idx, w, ll_handle)[0].shape == x.shape
    buf.destroy()
    ll.destroy()
    return seen


@pytest.mark.parametrize("world", [2, 4])
def test_out_of_range_expert_ids_are_refused_with_their_position(world):
    seen = run_ranks(_bad_expert_ids, world)
    assert seen[0] == [f"topk_idx[0, 1] = {4 * world} is outside [-1, {4 * world}) on rank 0: expert ids are -1 "
                       f"(no expert) or in [0, num_experts)"]


def _value_check_reads(rank: int, world: int, device: str) -> list[int]:
    """The host reads a fresh dispatch's value checks make (the sizes of what each read), with topk_idx given:
    its expert ids and its counts are read together."""
    import uccl_ep_train.buffer as buffer_module
    import uccl_ep_train.validation as validation_module

    group = dist.new_group(list(range(world)))
    n, e = 6, 4 * world
    x = torch.randn(n, 128).to(torch.bfloat16)
    idx = torch.stack([torch.arange(n) % e, (torch.arange(n) + 1) % e], 1)
    buf = Buffer(group, int(1e6), 0)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
    reads, read = [], buffer_module.host_values

    def counted(t: torch.Tensor) -> list:
        reads.append(t.numel())
        return read(t)

    try:
        buffer_module.host_values = validation_module.host_values = counted
        buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                     num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=torch.rand(n, 2))
    finally:
        buffer_module.host_values = validation_module.host_values = read
    buf.destroy()
    return reads


def test_a_dispatch_reads_its_checked_values_in_one_host_sync():
    # the ids' min and max, then the tokens per rank counted from is_token_in_rank and as passed
    assert run_ranks(_value_check_reads, 2) == [[2 + 2 + 2]] * 2


def _routing_with_a_bad_id(rank: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(x [6, 512] bf16, topk_idx [6, 2], 8 experts) on this rank's GPU (512: the hidden size the LL GPU tests
    use); rank 0 routes topk_idx[5, 1] = 11."""
    dev = torch.device("cuda", torch.cuda.current_device())
    n, h, e = 6, 512, 8
    x = torch.randn(n, h, device=dev).to(torch.bfloat16)
    idx = torch.stack([torch.arange(n) % e, (torch.arange(n) + 3) % e], 1).to(dev)
    if rank == 0:
        idx[5, 1] = e + 3
    return x, idx, e


def _fresh_dispatch_error(buf, x: torch.Tensor, idx: torch.Tensor, num_experts: int, **kw) -> str:
    """What a fresh dispatch of this routing (layout, dispatch with `kw`, its kernels, check_errors) raised on
    this rank; "" when nothing."""
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)  # no raise: no sync
    try:
        buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                     num_tokens_per_expert=per_expert, **kw)
        torch.cuda.synchronize()
        buf.check_errors()
    except RuntimeError as exc:
        return str(exc)
    return ""


def _native_bad_expert_id(rank: int, world: int, device: str, low_latency: bool) -> str:
    """Rank 0 routes topk_idx[5, 1] = 11 (8 experts); the native kernels check ids on the GPU (no host sync in
    get_dispatch_layout / low_latency_dispatch): the error comes at the fresh dispatch's count sync, or at
    check_errors() after the LL call. Returns this rank's message ("" where it raised none)."""
    group = dist.new_group(list(range(world)))
    x, idx, e = _routing_with_a_bad_id(rank)
    h = x.size(1)
    msg = ""
    if low_latency:
        buf = Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(16, h, world, e), low_latency_mode=True)
        assert type(buf.low_latency_backend).__name__ == "NativeLowLatencyBackend"
        buf.low_latency_dispatch(x, idx, 16, e, use_fp8=False)
        torch.cuda.synchronize()
        try:
            buf.check_errors()
        except RuntimeError as exc:
            msg = str(exc)
    else:
        buf = Buffer(group, int(1e6), 0)
        assert buf.backend_name == "native", buf.backend_name
        # without topk_idx: the dispatch's own host check of the ids stays out of the way
        msg = _fresh_dispatch_error(buf, x, idx, e)
    buf.destroy()
    return msg


@pytest.mark.gpu
@pytest.mark.parametrize("ranks_per_node,low_latency", [(None, False), ("1", False), (None, True), ("1", True)],
                         ids=["intranode", "internode-2x1", "low-latency", "low-latency-2x1"])
def test_native_out_of_range_expert_id_names_its_position(mps, monkeypatch, ranks_per_node, low_latency):
    monkeypatch.delenv("UCCL_EP_CHECK_VALUES", raising=False)  # the GPU's check, not the host's
    env = {"UCCL_EP_BACKEND": "native", "UCCL_EP_TIMEOUT_S": "5",
           **({"UCCL_EP_RANKS_PER_NODE": ranks_per_node} if ranks_per_node else {}),
           # internode HT: the host checks the ids by default; its kernel's record is what trusted calls rely on
           **({"UCCL_EP_CHECK_VALUES": "0"} if ranks_per_node and not low_latency else {})}
    msgs = run_ranks(_native_bad_expert_id, 2, low_latency, timeout=300, device="cuda", backend="gloo",
                     ranks_per_gpu=2, env=env)
    assert re.search(r"topk_idx\[5, 1\] = 11 is outside \[-1, 8\) on rank 0( \(node 0\))?: expert ids are -1 "
                     r"\(no expert\) or in \[0, num_experts\); found on the GPU by "
                     + ("low_latency_dispatch" if low_latency else "get_dispatch_layout"), msgs[0]), msgs[0]
    # rank 1 routed nothing wrong: it stops with rank 0's record (intranode: the shared board), waits for rank
    # 0 in vain (its deadline names rank 0), or completes (the LL kernels go on past a bad id)
    assert (not msgs[1] or "[rank 0 reported it; rank 1 stopped with it]" in msgs[1]
            or re.search(r"rank 1( \(node 1\))? timed out after 5 s .* waiting for rank 0", msgs[1])), msgs[1]


def _native_bad_expert_id_before_a_grow(rank: int, world: int, device: str) -> str:
    """As _native_bad_expert_id, with the host's value checks off (as the Megatron dispatcher runs) and a
    sync-free dispatch whose num_worst_tokens makes the buffers grow: the grow replaces the buffers holding the
    layout kernel's record, so it must raise first (fuzz seed 41 case 4 was this with a capacity error).
    Returns this rank's message ("" where it raised none)."""
    from uccl_ep_train import sizing, validation

    group = dist.new_group(list(range(world)))
    x, idx, e = _routing_with_a_bad_id(rank)
    worst = 1 << 16
    assert worst * x.size(1) * 2 > sizing.MIN_BYTES  # the outputs' rows alone outgrow the first buffers
    buf = Buffer(group, 0, 0)
    assert buf.backend_name == "native", buf.backend_name
    with validation.trusted_values():
        msg = _fresh_dispatch_error(buf, x, idx, e, topk_idx=idx, num_worst_tokens=worst)
    buf.destroy()
    return msg


@pytest.mark.gpu
@pytest.mark.parametrize("ranks_per_node", [None, "1"], ids=["intranode", "internode-2x1"])
def test_a_grow_raises_the_error_recorded_before_it_on_every_rank(mps, ranks_per_node):
    env = {"UCCL_EP_BACKEND": "native", "UCCL_EP_TIMEOUT_S": "5",
           **({"UCCL_EP_RANKS_PER_NODE": ranks_per_node} if ranks_per_node else {})}
    msgs = run_ranks(_native_bad_expert_id_before_a_grow, 2, timeout=300, device="cuda", backend="gloo",
                     ranks_per_gpu=2, env=env)
    assert re.search(r"topk_idx\[5, 1\] = 11 is outside \[-1, 8\) on rank 0", msgs[0]), msgs[0]
    # rank 1 raises too, before anything is released: rank 0's record (the node's shared board, or the grow's
    # gather of every rank's record)
    assert ("rank 0 recorded an error before the buffers could grow: " in msgs[1]
            or "[rank 0 reported it; rank 1 stopped with it]" in msgs[1]), msgs[1]
    assert "topk_idx[5, 1] = 11" in msgs[1], msgs[1]
