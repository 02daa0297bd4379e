"""Runs fuzz cases (tests/fuzz_cases.py) on spawned ranks and compares every output with the reference backend.

One spawn per seed (one node layout): the ranks share the GPU(s) under MPS over a gloo group (CUDA tensors,
UCCL_EP_RANKS_PER_NODE for the emulated nodes, so bytes between nodes go through the CPU proxies), and each
runs the seed's cases in order on native Buffers, the same calls on a reference Buffer over CPU copies of its
inputs, and compares: dispatch outputs and handle items bit for bit, combine within the dtype's reduction
tolerance. Both are also checked against a dense oracle computed from every rank's inputs (which every rank
regenerates from the case): received row counts, per-expert counts, capacity-layout rows, LL rows and combine
sums; a case whose expert capacity overflows a block (fuzz_cases.OVERFLOWS "error") must raise the capacity
error on every rank, naming a block the oracle says overflows. On CPU (`sut="reference"`) the same cases run
with the reference backend as the system under test, so CI covers the generator, the runner and the oracle
without a GPU.

A failing case raises AssertionError starting with its one-line repro (`scripts/fuzz_gpu.sh --seed S --case
K`); the ranks stop at the first failure of a seed (their state no longer agrees). Consecutive HT and
expert-major cases of a seed share one native Buffer (growth and reuse are part of what is tested; an LL,
fault-injection or capacity "error" case runs on Buffers of its own, beside the shared one on up to
KEEP_SHARED_UP_TO ranks, the shared one destroyed first above that), so a
failure that does not reproduce alone reproduces with `--seed S` (every case of the seed).

Command line (scripts/fuzz_gpu.sh wraps it, with MPS):
    python tests/fuzz_runner.py --seeds N [--first S] [--minutes M] [--cases C] [--gpus G]
    python tests/fuzz_runner.py --seed S [--case K]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as a script: dist_utils, fuzz_cases, ...

from dist_utils import env_set, run_ranks  # noqa: E402
from fuzz_cases import CASES_PER_SEED, COMBINE_DTYPES, FuzzCase, case, generate, rank_inputs, rank_routing  # noqa: E402
from oracle import capacity_overflows, expected_capacity_rows  # noqa: E402
from test_internode_gpu import _check_handle, _same, reference_buffer  # noqa: E402

# Ranks in a seed up to which the shared HT Buffer stays beside a case's own Buffer (all of them may share one GPU,
# as with --gpus >= 2): three MPS clients per rank then (the rank, two Buffers' copy agents), 24 of the 48 clients
# MPS serves per GPU. Buffer creation and destruction took about half of a seed's time when every such case
# replaced the shared one.
KEEP_SHARED_UP_TO = 8
TIMEOUT_S = "30"  # UCCL_EP_TIMEOUT_S in the ranks: a rank failing alone fails its peers' kernels in seconds
INTRANODE_HANDLE_ITEMS = ("rank_prefix_matrix", "send_head", "channel_prefix_matrix", "recv_channel_prefix_matrix")
# combine: max abs / rel difference per output dtype (float32 sums in a different order, then one rounding)
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-4}
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
# what every rank raises when a source overflows a capacity block (native notify's report, the reference's check)
CAPACITY_ERROR = re.compile(r"dispatch_expert_major: rank (\d+) sends (\d+) tokens to local expert (\d+) of rank "
                            r"(\d+), more than expert_capacity=(\d+)")


class Ranks:
    """This rank's Buffers for one seed: the system under test (native on GPUs, or the reference on CPU) and
    the reference on CPU, over one gloo group."""

    def __init__(self, rank: int, world: int, sut: str) -> None:
        import torch.distributed as dist

        self.rank, self.world, self.sut = rank, world, sut
        self.buffer_s = 0.0  # time spent making and destroying the Buffers under test (buffer, retire)
        self.group = dist.new_group(list(range(world)), backend="gloo")
        self.dev = torch.device("cuda", torch.cuda.current_device()) if sut == "native" else torch.device("cpu")
        self.ref = reference_buffer(self.group)
        self._shared = None

    def buffer(self, **kw):
        """A new Buffer under test (the caller destroys it)."""
        from uccl_ep_train import Buffer

        start = time.monotonic()
        try:
            if self.sut == "native":
                with env_set(UCCL_EP_BACKEND="native"):
                    buf = Buffer(self.group, **kw)
                assert buf.backend_name == "native", buf.backend_name
                return buf
            return reference_buffer(self.group, **kw)
        finally:
            self.buffer_s += time.monotonic() - start

    def retire(self, *buffers) -> None:
        """Destroy Buffers under test (collective), timed with their making."""
        start = time.monotonic()
        for buf in buffers:
            buf.destroy()
        self.buffer_s += time.monotonic() - start

    def shared(self):
        """The HT Buffer under test every case without fault injection uses (made at first use)."""
        if self._shared is None:
            self._shared = self.buffer()
        return self._shared

    def make_room(self) -> None:
        """Before a case on a Buffer of its own (LL, fault injection, capacity error): with more than
        KEEP_SHARED_UP_TO ranks in the seed the shared Buffer is destroyed (collective), so that no rank runs two
        sets of proxies and copy agents (each agent is an MPS client of its own, and 16 ranks sharing a GPU with
        two Buffers each would pass its clients limit); with fewer it stays, and the two Buffers coexist."""
        if self.world > KEEP_SHARED_UP_TO:
            self.drop_shared()

    def drop_shared(self) -> None:
        """Destroy the shared Buffer (collective)."""
        if self._shared is not None:
            self.retire(self._shared)
            self._shared = None

    def settle(self, buf, what: str) -> None:
        """Waits for the call's kernels; a kernel or proxy error raises here, naming the call."""
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        try:
            buf.check_errors()
        except RuntimeError as exc:
            raise AssertionError(f"{what}: {exc}") from exc

    def close(self) -> None:
        self.drop_shared()
        self.ref.destroy()


@contextlib.contextmanager
def destroyed_after(r: Ranks, *buffers):
    """Destroys `buffers` (collective, r.retire) when the block succeeds. After a failure nothing collective
    runs here: the failing rank's peers may be inside another collective (the reference calls it skipped), so a
    destroy's barrier would hang every rank instead of reporting the failure; the Buffers are dropped (their
    resources parked, Buffer.__del__) and the error reaches the runner."""
    yield
    r.retire(*buffers)


def _stream_kw(buf, mode: str) -> dict:
    if mode == "async":
        return {"async_finish": True}
    if mode == "previous_event":
        return {"previous_event": buf.capture(), "async_finish": True, "allocate_on_comm_stream": True}
    return {}


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, what: str,
           magnitude: Optional[torch.Tensor] = None) -> None:
    """a within the dtype's tolerance of b. `magnitude` (elementwise, float32): the sum of the absolute values
    of everything summed into b, for a combine across nodes, whose per-node partial sums make the trip between
    nodes in the combine dtype (docs/internode.md): each rounding adds up to the dtype's unit roundoff times
    its partial's size, which a result that cancels to a small value does not bound (seed 25 case 1: a 2 x 3
    bf16 combine with two biases, one element 0.031 off at 0.2)."""
    tol = TOLERANCE[dtype]
    a, b = a.cpu().float(), b.cpu().float()
    if magnitude is None:
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
        return
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    allowed = tol + tol * b.abs() + 2 * UNIT_ROUNDOFF[dtype] * magnitude
    bad = (~((a - b).abs() <= allowed)).nonzero()  # NaN anywhere is off too
    if len(bad):
        i = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {len(bad)} of {b.numel()} elements off; first at {i}: {a[i].item()} vs "
                             f"{b[i].item()} (allowed {allowed[i].item():.4g} with partial sums up to "
                             f"{magnitude[i].item():.4g})")


def _goes_to(idx: torch.Tensor, experts: int, world: int) -> torch.Tensor:
    """[T, world] bool: token t has an expert on rank r."""
    local = experts // world
    hit = torch.zeros((idx.size(0), world), dtype=torch.bool)
    valid = idx >= 0
    rows = torch.arange(idx.size(0)).unsqueeze(1).expand_as(idx)
    hit[rows[valid], idx[valid] // local] = True
    return hit


def _fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from uccl_ep_train.fp8 import per_token_cast_to_fp8

    return per_token_cast_to_fp8(x.float())


def _values(recv) -> torch.Tensor:
    """Received rows as float32 (FP8 pairs dequantised)."""
    from uccl_ep_train.fp8 import per_token_cast_back

    return per_token_cast_back(*recv).float() if isinstance(recv, tuple) else recv.float()


def run_ht(c: FuzzCase, r: Ranks, buf) -> int:
    """get_dispatch_layout + dispatch, cached dispatch, combine (with the case's weights, biases, dtype and
    stream mode) against the reference and the dense oracle. Returns the rows this rank received."""
    rank, world, dev = r.rank, r.world, r.dev
    x, idx, w = rank_inputs(c, rank)
    dt = COMBINE_DTYPES[c.combine_dtype]
    data = _fp8(x) if c.fp8 else x
    wt = w if c.weights else None
    kw = {"expert_alignment": c.expert_alignment, "num_worst_tokens": c.num_worst_tokens}

    def dispatch(b, device, mode):
        on = (lambda t: None if t is None else t.to(device))
        per_rank, per_node, per_expert, in_rank, _ = b.get_dispatch_layout(idx.to(device), c.experts)
        return b.dispatch(tuple(t.to(device) for t in data) if c.fp8 else data.to(device),
                          num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                          num_tokens_per_expert=per_expert, topk_idx=on(idx), topk_weights=on(wt), **kw,
                          **_stream_kw(b, mode))

    rx, ridx, rw, counts, h, event = dispatch(buf, dev, c.stream)
    if c.stream != "sync":
        event.current_stream_wait()
    r.settle(buf, "dispatch")
    ex, eidx, ew, ecounts, eh, _ = dispatch(r.ref, "cpu", "sync")

    # the dense oracle: what every rank's routing sends here
    routes = [rank_routing(c, s) for s in range(world)]
    n = sum(int(_goes_to(t, c.experts, world)[:, rank].sum()) for t in routes)
    local = c.experts // world
    per_expert = [sum(int((t == e).sum()) for t in routes) for e in range(rank * local, (rank + 1) * local)]
    rows = (ex[0] if c.fp8 else ex).size(0)
    assert rows == (c.num_worst_tokens or n), f"reference received {rows} rows, the oracle says {n}"
    want = [] if c.num_worst_tokens else [-(-v // c.expert_alignment) * c.expert_alignment for v in per_expert]
    assert ecounts == want, f"reference per-expert counts {ecounts}, the oracle says {want}"

    def first(t):
        return tuple(p[:n] for p in t) if isinstance(t, tuple) else t[:n]

    _same(first(rx), first(ex), "recv_x")
    assert (rx[0] if c.fp8 else rx).size(0) == rows, "recv_x rows"
    _same(ridx[:n], eidx[:n], "recv_topk_idx")
    _same(rw[:n], ew[:n], "recv_topk_weights")
    assert counts == ecounts, f"per-expert counts {counts} vs {ecounts}"
    if hasattr(eh, "rank_prefix_matrix"):
        for name in INTRANODE_HANDLE_ITEMS:
            _same(getattr(h, name), getattr(eh, name), f"handle.{name}")
        _same(h.recv_src_idx[:n], eh.recv_src_idx[:n], "handle.recv_src_idx")
    else:
        _check_handle(h, eh, "handle")

    if c.cached:
        again = _fp8(x * 2) if c.fp8 else x * 2
        cx, *_, event = buf.dispatch(tuple(t.to(dev) for t in again) if c.fp8 else again.to(dev), handle=h,
                                     **_stream_kw(buf, c.stream))
        if c.stream != "sync":
            event.current_stream_wait()
        r.settle(buf, "cached dispatch")
        ecx = r.ref.dispatch(again, handle=eh)[0]
        _same(first(cx), first(ecx), "cached recv_x")

    # expert outputs: the received rows x (rank + 1) in the combine dtype, the same tensor on both sides
    y = (_values(ex) * (rank + 1)).to(dt)
    g = torch.Generator().manual_seed(c.seed * 31 + c.index * 7 + rank)
    bias = [torch.randn(x.shape, generator=g).to(dt) for _ in range(c.bias)]
    bias_arg = None if not bias else bias[0] if len(bias) == 1 else tuple(bias)
    on_dev = None if bias_arg is None else bias_arg.to(dev) if len(bias) == 1 else tuple(b.to(dev) for b in bias)
    out, out_w, event = buf.combine(y.to(dev), h, topk_weights=rw if c.weights else None, bias=on_dev,
                                    **_stream_kw(buf, c.stream))
    if c.stream != "sync":
        event.current_stream_wait()
    r.settle(buf, "combine")
    eout, eout_w, _ = r.ref.combine(y, eh, topk_weights=ew if c.weights else None, bias=bias_arg)
    assert out.dtype == eout.dtype == dt, (out.dtype, eout.dtype)
    # each token's rows come back once per rank it went to, multiplied by (that rank + 1)
    value = _values(data if c.fp8 else x)
    rows = [(value * (d + 1)).to(dt).float() * hit.unsqueeze(1)
            for d, hit in enumerate(_goes_to(idx, c.experts, world).t())]
    biases = [b.float() for b in bias]
    magnitude = sum((t.abs() for t in rows), sum((b.abs() for b in biases), torch.zeros(x.shape)))
    _close(out, eout, dt, "combine", magnitude if c.nodes > 1 else None)
    assert (out_w is None) == (eout_w is None) == (not c.weights), "combined weights given iff weights"
    if c.weights:
        torch.testing.assert_close(out_w.cpu(), eout_w, rtol=1e-5, atol=1e-5, msg=lambda m: f"combined weights: {m}")
        torch.testing.assert_close(eout_w, w * (idx >= 0), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"reference combined weights vs the oracle: {m}")
    dense = sum(rows, torch.zeros(x.shape)) + sum(biases, torch.zeros(x.shape))  # the dense oracle
    _close(eout, dense.to(dt), dt, "reference combine vs the dense oracle")
    return n


def _expect_capacity_error(c: FuzzCase, r: Ranks, buf, overflows: set, call) -> None:
    """`call` (a dispatch_expert_major on `buf`) must fail on this rank, as on every rank, with the capacity
    error naming a block that does overflow (`overflows`: capacity_overflows of every rank's routing)."""
    try:
        call()
        r.settle(buf, "dispatch_expert_major")
    except (RuntimeError, ValueError, AssertionError) as exc:
        m = CAPACITY_ERROR.search(str(exc))
        assert m, f"expected the expert_capacity error, got {type(exc).__name__}: {exc}"
        *named, cap = (int(v) for v in m.groups())
        assert cap == c.expert_capacity and tuple(named) in overflows, \
            f"the error names {tuple(named)} / capacity {cap}; the oracle's overflows: {sorted(overflows)[:8]}"
        return
    raise AssertionError(f"dispatch_expert_major with expert_capacity={c.expert_capacity} did not fail; the oracle's "
                         f"overflows (source, tokens, local expert, rank): {sorted(overflows)[:8]}")


def run_expert_major(c: FuzzCase, r: Ranks, buf) -> int:
    """dispatch_expert_major (exact counts or a capacity layout), its cached form and combine_expert_major
    against the reference and the dense oracle (x_em of a capacity layout, combine sums). A routing that
    overflows a capacity block (overflow "error") must fail on every rank, in the system under test and the
    reference, naming an overflowing block. Returns the expert-major rows of this rank (0 after an error)."""
    rank, dev, world = r.rank, r.dev, r.world
    x, idx, w = rank_inputs(c, rank)
    dt = COMBINE_DTYPES[c.combine_dtype]
    xd, wt = x.to(dt), (w if c.weights else None)
    kw = {"num_worst_tokens": c.num_worst_tokens, "expert_capacity": c.expert_capacity}
    routes = [rank_routing(c, s) for s in range(world)]
    overflows = capacity_overflows(routes, c.experts, c.expert_capacity) if c.expert_capacity else set()
    assert not overflows or c.overflow == "error", f"the generator's routing overflows: {sorted(overflows)[:8]}"
    if overflows:
        _expect_capacity_error(c, r, buf, overflows, lambda: buf.dispatch_expert_major(
            xd.to(dev), idx.to(dev), None if wt is None else wt.to(dev), c.experts, **kw))
        _expect_capacity_error(c, r, r.ref, overflows, lambda: r.ref.dispatch_expert_major(xd, idx, wt, c.experts,
                                                                                           **kw))
        return 0
    x_em, ridx, rw, counts, em_map, h, event = buf.dispatch_expert_major(
        xd.to(dev), idx.to(dev), None if wt is None else wt.to(dev), c.experts, **kw, **_stream_kw(buf, c.stream))
    if c.stream != "sync":
        event.current_stream_wait()
    r.settle(buf, "dispatch_expert_major")
    ex_em, eidx, ew, ecounts, eem_map, eh, _ = r.ref.dispatch_expert_major(xd, idx, wt, c.experts, **kw)
    n = eh.num_recv_tokens if c.num_worst_tokens == 0 else int((eem_map >= 0).any(1).sum())
    _same(x_em, ex_em, "x_em")
    _same(ridx[:n], eidx[:n], "recv_topk_idx")
    _same(rw[:n], ew[:n], "recv_topk_weights")
    _same(em_map, eem_map, "em_map")
    assert counts == ecounts, f"tokens_per_expert {counts} vs {ecounts}"
    local = c.experts // r.world
    if c.expert_capacity:
        assert ecounts == [r.world * c.expert_capacity] * local, ecounts
        xs = [rank_inputs(c, s)[0].to(dt) for s in range(world)]
        _same(ex_em, expected_capacity_rows(xs, routes, rank, c.experts, c.expert_capacity),
              "reference x_em vs the dense oracle (capacity layout)")
    else:
        want = [sum(int((t == e).sum()) for t in routes) for e in range(rank * local, (rank + 1) * local)]
        assert ecounts == want, f"reference tokens_per_expert {ecounts}, the oracle says {want}"
    rows = sum(ecounts)
    if c.cached:
        cx, event = buf.dispatch_expert_major_cached((xd * 2).to(dev), h, em_map, rows,
                                                     expert_capacity=c.expert_capacity, **_stream_kw(buf, c.stream))
        if c.stream != "sync":
            event.current_stream_wait()
        r.settle(buf, "dispatch_expert_major_cached")
        ecx, _ = r.ref.dispatch_expert_major_cached(xd * 2, eh, eem_map, rows, expert_capacity=c.expert_capacity)
        _same(cx, ecx, "cached x_em")
    y = (ex_em.float() * (rank + 1)).to(dt)
    out, out_w, event = buf.combine_expert_major(y.to(dev), h, em_map, topk_weights=rw if c.weights else None,
                                                 expert_capacity=c.expert_capacity, **_stream_kw(buf, c.stream))
    if c.stream != "sync":
        event.current_stream_wait()
    r.settle(buf, "combine_expert_major")
    eout, eout_w, _ = r.ref.combine_expert_major(y, eh, eem_map, topk_weights=ew if c.weights else None,
                                                 expert_capacity=c.expert_capacity)
    _close(out, eout, dt, "combine_expert_major")
    if c.weights:
        torch.testing.assert_close(out_w.cpu(), eout_w, rtol=1e-5, atol=1e-5, msg=lambda m: f"combined weights: {m}")
    # dense oracle: each slot the routing sends (after a drop) comes back as the token x (its rank + 1)
    dense = torch.zeros(x.shape)
    for j in range(c.topk):
        ok = idx[:, j] >= 0
        dense[ok] += (xd[ok].float() * (idx[ok, j] // local + 1).float().unsqueeze(1)).to(dt).float()
    _close(eout, dense.to(dt), dt, "reference combine_expert_major vs the dense oracle")
    return rows


def run_ll(c: FuzzCase, r: Ranks) -> int:
    """low_latency_dispatch + low_latency_combine on Buffers of this case's shape (fault injection, hook,
    zero-copy, FP8 / round_scale / UE8M0, async) against the reference (dispatched in BF16; the FP8 rows it
    should hold are cast where the data lives) and the dense oracle. Returns the rows this rank received."""
    from uccl_ep_train import Buffer
    from uccl_ep_train.fp8 import per_token_cast_back, per_token_cast_to_fp8

    rank, world, dev = r.rank, r.world, r.dev
    x, idx, w = rank_inputs(c, rank)
    M, H, E = c.max_tokens, c.hidden, c.experts
    local = E // world
    size = Buffer.get_low_latency_rdma_size_hint(M, H, world, E)
    with env_set(UCCL_EP_FAULT=c.fault):
        buf = r.buffer(num_rdma_bytes=size, low_latency_mode=True)
    ref = reference_buffer(r.group, num_rdma_bytes=size, low_latency_mode=True)
    with destroyed_after(r, buf):
        stats = torch.zeros(local, dtype=torch.int32, device=dev)
        recv, count, handle, event, hook = buf.low_latency_dispatch(
            x.to(dev), idx.to(dev), M, E, cumulative_local_expert_recv_stats=stats, use_fp8=c.fp8,
            round_scale=c.round_scale, use_ue8m0=c.ue8m0, async_finish=c.stream == "async", return_recv_hook=c.hook)
        if c.hook:
            hook()
        if c.stream == "async":
            event.current_stream_wait()
        r.settle(buf, "low_latency_dispatch")
        erecv, ecount, ehandle, _, _ = ref.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        routes = [rank_routing(c, s) for s in range(world)]
        want = [sum(int((t == e).sum()) for t in routes) for e in range(rank * local, (rank + 1) * local)]
        assert ecount.tolist() == want, f"reference recv_count {ecount.tolist()}, the oracle says {want}"
        assert count.tolist() == want == stats.tolist(), f"recv_count {count.tolist()} / stats {stats.tolist()} " \
                                                         f"vs {want}"
        _same(handle[1], ehandle[1], "handle layout_range")
        expect = torch.zeros((local, world * M, H), dtype=torch.bfloat16)  # what the experts compute on
        for e in range(local):
            k = want[e]
            _same(handle[0][e, :k], ehandle[0][e, :k], f"handle src_info of expert {e}")
            rows = erecv[e, :k]
            if c.fp8 and k:  # the FP8 rows the kernels must produce: the cast where the data lives, bit for bit
                q, s = per_token_cast_to_fp8(rows.to(dev), round_scale=c.round_scale, use_ue8m0=c.ue8m0)
                _same(recv[0][e, :k], q, f"FP8 rows of expert {e}")
                rows = per_token_cast_back(q, s).cpu()
                _same(per_token_cast_back(recv[0][e, :k], recv[1][e, :k]), rows, f"FP8 rows x scales of expert {e}")
            elif k:
                _same(recv[e, :k], rows, f"rows of expert {e}")
            expect[e, :k] = rows
        factor = (torch.arange(local) + rank * local + 1).float().view(local, 1, 1)
        y = (expect.float() * factor).to(torch.bfloat16)
        if c.zero_copy:
            buf.get_next_low_latency_combine_buffer(handle).copy_(y.to(dev))
            y_in = buf.get_next_low_latency_combine_buffer(handle)
        else:
            y_in = y.to(dev)
        out, event, hook = buf.low_latency_combine(y_in, idx.to(dev), w.to(dev), handle, zero_copy=c.zero_copy,
                                                   async_finish=c.stream == "async", return_recv_hook=c.hook)
        if c.hook:
            hook()
        if c.stream == "async":
            event.current_stream_wait()
        r.settle(buf, "low_latency_combine")
        eout, _, _ = ref.low_latency_combine(y, idx, w, ehandle)
        _close(out, eout, torch.bfloat16, "low_latency_combine")
        # dense oracle: every (token, slot) of a valid expert adds weight x the expert's output of that token
        value = x.float()
        if c.fp8 and x.size(0):
            q, s = per_token_cast_to_fp8(x.to(dev), round_scale=c.round_scale, use_ue8m0=c.ue8m0)
            value = per_token_cast_back(q, s).float().cpu()
        dense = torch.zeros(x.shape)
        for j in range(c.topk):
            ok = idx[:, j] >= 0
            dense[ok] += ((value[ok] * (idx[ok, j] + 1).float().unsqueeze(1)).to(torch.bfloat16).float()
                          * w[ok, j].unsqueeze(1))
        _close(eout, dense.to(torch.bfloat16), torch.bfloat16, "reference low_latency_combine vs the dense oracle")
        ref.destroy()  # (collective: only after success, as destroyed_after; not a Buffer under test)
        return sum(want)


def run_case(c: FuzzCase, r: Ranks) -> int:
    """Case `c` on this rank; AssertionError naming the repro on any difference."""
    try:
        if c.kind == "ll":
            r.make_room()
            return run_ll(c, r)
        if c.fault or c.overflow == "error":  # (a native capacity error leaves its Buffer unusable)
            r.make_room()
            with env_set(UCCL_EP_FAULT=c.fault):
                buf = r.buffer()
            with destroyed_after(r, buf):
                return (run_ht if c.kind == "ht" else run_expert_major)(c, r, buf)
        return (run_ht if c.kind == "ht" else run_expert_major)(c, r, r.shared())
    except Exception as exc:
        raise AssertionError(f"{c.repro} failed on rank {r.rank}: {type(exc).__name__}: {exc}\n"
                             f"  case: {c.describe()}") from exc


def _ranks_main(rank: int, world: int, device: str, cases: list[FuzzCase], sut: str,
                cpus: Optional[set] = None) -> list[int]:
    """A spawned rank: every case in order; per case the rows it received. cpus: the cores it keeps to, with
    the threads and processes it starts from here on (its proxy threads and copy agents, which size themselves
    by this affinity; the group's own threads, started before, are idle waiters)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    start = time.monotonic()
    r = Ranks(rank, world, sut)
    rows = [run_case(c, r) for c in cases]
    r.close()  # only after success: see destroyed_after
    if rank == 0:  # where the seed's time goes (measured: Buffers were about half of it on GPUs)
        print(f"seed {cases[0].seed} rank 0: {len(cases)} cases in {time.monotonic() - start:.1f} s, "
              f"{r.buffer_s:.1f} s of it making and destroying the Buffers under test", flush=True)
    return rows


def each_rank_tail(text: str, per_rank: int = 2000) -> str:
    """A failed spawn's text with each rank's part cut to its last `per_rank` characters (where its error and
    repro line are): a cut of the whole text would keep the last rank's traceback and drop the first rank's,
    which is usually the cause (the others fail because it left)."""
    parts = re.split(r"(?=^--- rank \d+ ---$)", text, flags=re.M)
    if len(parts) == 1:  # no per-rank parts (a timeout's text): its tail
        return text if len(text) <= 2 * per_rank else f"[...]{text[-2 * per_rank:]}"
    cut = []
    for p in parts:
        head, _, body = p.partition("\n")
        cut.append(p if len(p) <= per_rank else f"{head}\n[...]{body[-per_rank:]}")
    return "".join(cut)


def run_cases(cases: list[FuzzCase], sut: str = "native", timeout: float = 600, gpu: Optional[str] = None,
              cpus: Optional[set] = None) -> list[list[int]]:
    """Spawn the cases' layout (all cases share it) and run them; per rank, per case the rows received.
    sut "native": ranks on the GPU(s) (several per GPU: under MPS, which the caller provides), or all on GPU
    `gpu` (its UUID, visible_gpu_uuid) when given; "reference": CPU ranks, the reference backend under test.
    cpus: the cores the ranks keep to (seeds run side by side get disjoint ones)."""
    layouts = {c.layout for c in cases}
    if len(layouts) != 1:
        raise ValueError(f"run_cases: one layout per spawn, got {sorted(layouts)}")
    nodes, per_node = layouts.pop()
    world = nodes * per_node
    env = {"UCCL_EP_RANKS_PER_NODE": str(per_node), "UCCL_EP_TIMEOUT_S": TIMEOUT_S}
    if sut == "native":
        gpus = torch.cuda.device_count()
        if gpu is not None:  # the ranks see that one GPU only
            env["CUDA_VISIBLE_DEVICES"] = gpu
            gpus = 1
        return run_ranks(_ranks_main, world, cases, sut, cpus, device="cuda", backend="gloo",
                         ranks_per_gpu=-(-world // gpus), timeout=timeout, env=env)
    if sut != "reference":
        raise ValueError(f"run_cases: sut must be native or reference, got {sut!r}")
    return run_ranks(_ranks_main, world, cases, sut, cpus, timeout=timeout, env=env)


def visible_gpu_uuid(i: int, smi: Optional[str] = None) -> str:
    """The UUID of the i-th GPU this process sees (CUDA_VISIBLE_DEVICES, by index or UUID, else all): what a
    rank names to see that GPU alone. A UUID, not an index: an MPS daemon started with CUDA_VISIBLE_DEVICES set
    numbers its GPUs from 0, so a client's index would name another GPU or none. smi: `nvidia-smi
    --query-gpu=index,uuid --format=csv,noheader` output (asked here when None; the parent stays off the CUDA
    driver)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    entry = visible[i] if visible else str(i)
    if not entry.isdigit():
        return entry  # already a UUID
    if smi is None:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], check=True,
                             capture_output=True, text=True, timeout=60).stdout
    uuids = dict(tuple(v.strip() for v in line.split(",", 1)) for line in smi.splitlines() if "," in line)
    if entry not in uuids:
        raise RuntimeError(f"GPU {entry} (visible GPU {i}) is not in nvidia-smi's list {sorted(uuids)}")
    return uuids[entry]


def cpu_slices(cpus: set, n: int) -> list[set]:
    """`cpus` cut into n disjoint slices of consecutive ids, as even as they come (n <= len(cpus)). Seeds run
    side by side each get one: every rank sizes its spinning proxy threads and copy agents by the cores it may
    use, so ranks of different seeds sharing all cores would oversubscribe them n times (four seeds at once on
    4 H200, all sharing the 64 cores, took 4 to 10 times as long each as a seed of their layout alone)."""
    ids = sorted(cpus)
    return [set(ids[len(ids) * i // n:len(ids) * (i + 1) // n]) for i in range(n)]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, help="run this seed's cases only (with --case: that one case)")
    p.add_argument("--case", type=int, help="with --seed: the case index of a repro line")
    p.add_argument("--seeds", type=int, default=0, help="run this many seeds from --first (each one spawn)")
    p.add_argument("--first", type=int, default=0, help="first seed of --seeds (default 0)")
    p.add_argument("--minutes", type=float, default=0, help="stop starting seeds after this many minutes")
    p.add_argument("--cases", type=int, default=CASES_PER_SEED, help=f"cases per seed (default {CASES_PER_SEED})")
    p.add_argument("--gpus", type=int, default=1,
                   help="seeds run at once, each on a GPU of its own that its ranks share (default 1: one seed at a "
                        "time, its ranks spread over the GPUs)")
    p.add_argument("--cpu", action="store_true", help="CPU ranks, the reference backend under test (no GPU)")
    a = p.parse_args(argv)
    if a.case is not None and a.seed is None:
        p.error("--case needs --seed")
    if (a.seed is None) == (a.seeds <= 0):
        p.error("give --seed S (one seed) or --seeds N (a run)")
    if a.cases < 1:
        p.error("--cases must be >= 1")
    sut = "reference" if a.cpu else "native"
    if sut == "native" and not torch.cuda.is_available():
        p.error("no CUDA GPU here: run with --cpu to exercise the reference backend on CPU ranks")
    if a.gpus > 1 and sut != "native":
        p.error("--gpus runs seeds side by side on GPUs: not with --cpu")
    if a.gpus < 1 or a.gpus > max(1, torch.cuda.device_count()):
        p.error(f"--gpus must be between 1 and the GPUs here ({torch.cuda.device_count()}), got {a.gpus}")
    if a.gpus > len(os.sched_getaffinity(0)):
        p.error(f"--gpus {a.gpus}: more seeds at once than the {len(os.sched_getaffinity(0))} cores here")
    slices = cpu_slices(os.sched_getaffinity(0), a.gpus)
    uuids = [visible_gpu_uuid(g) for g in range(a.gpus)] if a.gpus > 1 else []
    seeds = [a.seed] if a.seed is not None else list(range(a.first, a.first + a.seeds))
    start, failures, ran = time.monotonic(), [], []
    todo, lock, stop = iter(seeds), threading.Lock(), threading.Event()

    def run_seed(seed: int, gpu: Optional[int]) -> None:
        cases = [case(seed, a.case)] if a.case is not None else generate(seed, a.cases)
        t0 = time.monotonic()
        failure = None
        try:
            run_cases(cases, sut, gpu=None if gpu is None else uuids[gpu], cpus=None if gpu is None else slices[gpu])
        except Exception as exc:  # noqa: BLE001 (a failing seed is reported, the run goes on)
            if stop.is_set():  # Ctrl-C reached its ranks too (one process group): not the seed's failure
                print(f"seed {seed}: interrupted", flush=True)
                return
            found = [line[line.index("scripts/fuzz_gpu.sh"):].split(" failed")[0]
                     for line in str(exc).splitlines() if "scripts/fuzz_gpu.sh" in line]
            failure = (seed, found[0] if found else f"scripts/fuzz_gpu.sh --seed {seed}", str(exc))
        n, per_node = cases[0].layout
        on = "" if gpu is None else f" on GPU {gpu}"
        with lock:
            ran.append(seed)
            failures.extend([failure] if failure else [])
            print(f"seed {seed} ({n}x{per_node}, {len(cases)} cases){on}: {'FAILED' if failure else 'ok'} in "
                  f"{time.monotonic() - t0:.1f} s", flush=True)

    def worker(gpu: Optional[int]) -> None:
        """Takes the next seed until none is left, the minutes are up or the run is interrupted."""
        while not stop.is_set() and not (a.minutes and time.monotonic() - start > a.minutes * 60):
            with lock:
                seed = next(todo, None)
            if seed is None:
                return
            run_seed(seed, gpu)

    threads: list = []
    try:
        if a.gpus == 1:
            worker(None)  # (the ranks spread over the GPUs: the layout's own placement)
        else:
            threads = [threading.Thread(target=worker, args=(g,), daemon=True) for g in range(a.gpus)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    except KeyboardInterrupt:  # the running seeds' ranks got it too: they stop (spawn), reported as interrupted
        stop.set()
        print("interrupted", flush=True)
        for t in threads:
            t.join()
    ran.sort()
    failures.sort()
    print(f"\nfuzz: {len(ran)} seeds run ({ran[0] if ran else '-'}..{ran[-1] if ran else '-'}), "
          f"{len(failures)} failed, {time.monotonic() - start:.0f} s")
    for seed, repro, text in failures:
        print(f"\nFAILED seed {seed}: {repro.strip()}\n{each_rank_tail(text)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
