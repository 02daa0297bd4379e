"""GPU tests of the native internode path on ONE GPU: several ranks share it under NVIDIA MPS (gloo group,
CUDA tensors), UCCL_EP_RANKS_PER_NODE splits them into emulated nodes, and the bytes between nodes go
through the CPU proxies (ipc transport) exactly as between hosts.

Every call is compared with the reference backend run on CPU copies of the same inputs in the same ranks
(dispatch: bit-exact outputs and handle items; combine: reduction tolerance), and the proxies' per-destination
byte counters are checked against the bytes the layout says must cross each node boundary.
"""
import os

import pytest
import torch

from dist_utils import env_set, run_ranks

pytestmark = [pytest.mark.gpu]

HIDDEN, EXPERTS, TOPK = 256, 48, 4  # 48 experts: divisible by 2, 4 and 6 ranks


def _ready():
    try:
        from uccl_ep_train.backends.internode import internode_available
    except ImportError as exc:
        return f"internode backend missing: {exc}"
    if not internode_available():
        return "native module without the internode kernels / proxies"
    return None


def _routing(rank, T, mode, world, L, seed):
    """(x bf16 [T, H], topk_idx int64 [T, K], weights float32) on CPU, reproducible from (seed, rank)."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = torch.randn(T, HIDDEN, generator=g).to(torch.bfloat16)
    if mode == "one_node":  # every top-k expert of a token on one node
        node = torch.randint(0, world // L, (T, 1), generator=g)
        per_node = EXPERTS // (world // L)
        idx = node * per_node + torch.stack([torch.randperm(per_node, generator=g)[:TOPK] for _ in range(T)]) \
            if T else torch.empty(0, TOPK, dtype=torch.int64)
    elif mode == "skewed":  # most tokens to node 0's experts
        hot = EXPERTS // (world // L)
        idx = torch.stack([torch.randperm(hot if i % 5 else EXPERTS, generator=g)[:TOPK] for i in range(T)]) \
            if T else torch.empty(0, TOPK, dtype=torch.int64)
    else:
        idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(T)]) \
            if T else torch.empty(0, TOPK, dtype=torch.int64)
        if T:
            drop = torch.rand(T, TOPK, generator=g) < 0.2
            idx[drop] = -1
            idx[T // 2] = -1  # a token routed nowhere
    w = torch.rand(T, TOPK, generator=g) * (idx >= 0)
    return x, idx.to(torch.int64), w.to(torch.float32)


def _buffers(world):
    """(native Buffer on this rank's GPU, reference Buffer on CPU) over the same gloo group."""
    import torch.distributed as dist

    from uccl_ep_train import Buffer

    group = dist.new_group(list(range(world)), backend="gloo")
    native = Buffer(group, num_nvl_bytes=0, num_rdma_bytes=0)
    assert native.backend_name == "native" and type(native.backend).__name__ == "NativeInternodeBackend", \
        type(native.backend).__name__
    return native, reference_buffer(group)


def reference_buffer(group, **buffer_kwargs):
    """A reference-backend Buffer on CPU over `group` (the oracle the native calls are compared with), or over
    a new gloo group of the same ranks when `group` is NCCL's (one rank per GPU): CPU tensors need gloo.
    buffer_kwargs go to Buffer (e.g. low_latency_mode, num_rdma_bytes for LL calls)."""
    import torch.distributed as dist

    from uccl_ep_train import Buffer

    if dist.get_backend(group) != "gloo":
        group = dist.new_group(list(range(dist.get_world_size(group))), backend="gloo")

    with env_set(UCCL_EP_DEVICE="cpu", UCCL_EP_BACKEND="reference"):
        ref = Buffer(group, **buffer_kwargs)
    assert ref.device.type == "cpu"
    return ref


def _gpu(t, dev):
    """t on `dev`; to a GPU from page-locked memory, as a training loop with calls in flight must copy: a copy
    from pageable memory holds the CUDA driver until the ops queued before it ran, and the fabric transport's
    proxies on shm copy GPU memory through the driver, so ops waiting for them would wait until they time out
    (docs/internode.md, "Host copies and the fabric transport")."""
    dev = torch.device(dev)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)


def _host(t):
    """t on the host once the ops queued before it ran (awaited first, through an event: see _gpu and
    uccl_ep_train.events.host_values)."""
    from uccl_ep_train.events import await_current_stream

    await_current_stream(t.device)
    return t.cpu()


def _dispatch(buf, x, idx, w, num_experts, dev, **kw):
    x = tuple(_gpu(t, dev) for t in x) if isinstance(x, tuple) else _gpu(x, dev)
    idx, w = _gpu(idx, dev), _gpu(w, dev)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    out = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                       num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, **kw)
    return out, per_node


def _same(a, b, what):
    if isinstance(a, tuple):
        for i, (p, q) in enumerate(zip(a, b)):
            _same(p, q, f"{what}[{i}]")
        return
    a, b = _host(a), _host(b)
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point and a.element_size() == 1 else a,
                       b.view(torch.uint8) if b.dtype.is_floating_point and b.element_size() == 1 else b), what


def _settle(buf, tag):
    """Waits for the call's kernels; a kernel or proxy error raises here, naming the call that failed."""
    torch.cuda.synchronize()
    try:
        buf.backend.check_errors()
    except RuntimeError as exc:
        raise AssertionError(f"{tag}: {exc}") from exc


def _check_handle(h, hr, tag):
    for name in ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                 "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                 "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head"):
        _same(getattr(h, name), getattr(hr, name), f"{tag}: handle.{name}")
    # a sync-free dispatch (num_worst_tokens) sizes send_nvl_head for a bound: its leading rows are the handle's
    forwarded = hr.send_nvl_head.size(0)
    assert h.send_nvl_head.size(0) >= forwarded, f"{tag}: send_nvl_head has {h.send_nvl_head.size(0)} rows"
    _same(h.send_nvl_head[:forwarded], hr.send_nvl_head, f"{tag}: handle.send_nvl_head")
    assert h.num_recv_tokens == hr.num_recv_tokens and h.num_tokens == hr.num_tokens, tag


def _run_suite(rank, world, device, L, fault_seeds):
    import torch.distributed as dist

    from uccl_ep_train import _native
    from uccl_ep_train.fp8 import per_token_cast_to_fp8

    dev = torch.device("cuda", torch.cuda.current_device())
    native, ref = _buffers(world)
    stats = native.backend.proxy_stats
    N = world // L
    node = rank // L
    report = {}
    for case, (mode, T) in enumerate([("random", 96), ("one_node", 64), ("skewed", 80), ("random", 0)]):
        # rank 1 has no tokens in the last case; the others do
        T = (0 if rank == 1 else 48) if T == 0 else T + 7 * rank
        x, idx, w = _routing(rank, T, mode, world, L, seed=case)
        tag = f"rank {rank} case {case} ({mode})"
        before = stats()["bytes_to"]
        (rx, ridx, rw, counts, h, _), per_node = _dispatch(native, x, idx, w, EXPERTS, dev)
        _settle(native, f"{tag}: dispatch")
        # every rank's forward waited for all chunks bound to it, so after this barrier every proxy posted
        # what this dispatch sent (the counters count at post time)
        dist.barrier()
        after = stats()["bytes_to"]
        (ex, eidx, ew, ecounts, eh, _), _ = _dispatch(ref, x, idx, w, EXPERTS, "cpu")
        _same(rx, ex, f"{tag}: recv_x")
        _same(ridx, eidx, f"{tag}: recv_topk_idx")
        _same(rw, ew, f"{tag}: recv_topk_weights")
        assert counts == ecounts, f"{tag}: per-expert counts {counts} vs {ecounts}"
        _check_handle(h, eh, tag)
        # bytes through the proxies: to every other rank one count row; to the RDMA peer of each other node
        # the rows this rank sends there, nothing else (intra-node bytes never touch the proxies)
        row_ints = _native.internode_count_row_ints(world, EXPERTS, L)
        row_bytes = _native.internode_layout([0] * world * N, world, L, rank, HIDDEN * 2, 0, TOPK, 0, 0)["row_bytes"]
        for dst in range(world):
            sent = after[dst] - before[dst]
            want = 0 if dst == rank else 4 * row_ints
            if dst // L != node and dst % L == rank % L:
                want += int(per_node[dst // L]) * row_bytes
            assert sent == want, f"{tag}: {sent} bytes through the proxies to rank {dst}, expected {want}"
        # cached dispatch (same handle), then combine with weights and a bias
        y = (rx.float() * (rank + 1)).to(torch.bfloat16)
        cx, _, _, _, _, _ = native.dispatch(x.to(dev) * 2, handle=h)
        _settle(native, f"{tag}: cached dispatch")
        ecx, _, _, _, _, _ = ref.dispatch(x * 2, handle=eh)
        _same(cx, ecx, f"{tag}: cached recv_x")
        bias = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        out, out_w, _ = native.combine(y, h, topk_weights=rw, bias=bias.to(dev))
        _settle(native, f"{tag}: combine")
        eout, eout_w, _ = ref.combine(y.cpu(), eh, topk_weights=ew, bias=bias)
        torch.testing.assert_close(out.cpu().float(), eout.float(), rtol=2e-2, atol=2e-2, msg=f"{tag}: combine")
        torch.testing.assert_close(out_w.cpu(), eout_w, rtol=1e-5, atol=1e-5, msg=f"{tag}: combined weights")
        report[f"case{case}"] = int(rx.size(0))
    report["transport"] = native.backend.proxy_transport
    report["calls_gpu_runtime"] = native.backend._proxy.calls_gpu_runtime

    # FP8 pairs, num_worst_tokens, async with previous_event, expert alignment
    x, idx, w = _routing(rank, 64, "random", world, L, seed=7)
    q, s = per_token_cast_to_fp8(x.float())
    (rq, ridx, rw, counts, h, _), _ = _dispatch(native, (q, s), idx, w, EXPERTS, dev, num_worst_tokens=64 * world,
                                                expert_alignment=1)
    (eq, eidx, ew, ecounts, eh, _), _ = _dispatch(ref, (q, s), idx, w, EXPERTS, "cpu", num_worst_tokens=64 * world)
    _same(rq, eq, f"rank {rank}: fp8 recv (x, scales)")
    _same(ridx, eidx, f"rank {rank}: fp8 recv_topk_idx")
    assert counts == ecounts == []
    _check_handle(h, eh, f"rank {rank} fp8 worst")
    # the same call again, inputs on the GPU beforehand: no host sync at all (torch raises on any synchronising
    # call in this mode; the host's value checks are off, as the Megatron dispatcher makes them)
    from uccl_ep_train import validation

    xd, idxd, wd = (q.to(dev), s.to(dev)), idx.to(dev), w.to(dev)
    torch.cuda.synchronize()
    with validation.trusted_values():
        torch.cuda.set_sync_debug_mode("error")
        try:
            per_rank, per_node, per_expert, in_rank, _ = native.get_dispatch_layout(idxd, EXPERTS)
            sq, sidx, _, _, sh, _ = native.dispatch(
                xd, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=idxd, topk_weights=wd, num_worst_tokens=64 * world)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    _settle(native, f"rank {rank}: sync-free dispatch")
    _same(sq, eq, f"rank {rank}: sync-free fp8 recv (x, scales)")
    _same(sidx, eidx, f"rank {rank}: sync-free recv_topk_idx")
    _check_handle(sh, eh, f"rank {rank} sync-free")
    prev = native.capture()
    (ax, _, _, acounts, ah, event), _ = _dispatch(native, x, idx, w, EXPERTS, dev, previous_event=prev,
                                                  async_finish=True, allocate_on_comm_stream=True, expert_alignment=8)
    event.current_stream_wait()
    _settle(native, f"rank {rank}: async dispatch")
    (ex, _, _, ecounts, _, _), _ = _dispatch(ref, x, idx, w, EXPERTS, "cpu", expert_alignment=8)
    _same(ax, ex, f"rank {rank}: async recv_x")
    assert acounts == ecounts

    # no weights, no bias: each token comes back once per rank it went to
    ranks_hit = ((idx.unsqueeze(-1) >= 0) & (idx.unsqueeze(-1) // (EXPERTS // world) == torch.arange(world))).any(1)
    expected = x.float() * ranks_hit.sum(-1, keepdim=True)

    # ops queued back to back without a host sync in between (cached dispatch, combine, cached dispatch); the
    # inputs are on the GPU beforehand: no synchronous host-to-device copy waits behind the queued ops
    x1, x3 = x.to(dev), (x.to(dev) * 3)
    (rx, _, _, _, h, _), _ = _dispatch(native, x, idx, w, EXPERTS, dev)
    y1 = native.dispatch(x1, handle=h)[0]
    out1, _, _ = native.combine(y1, h)
    y3 = native.dispatch(x3, handle=h)[0]
    _settle(native, f"rank {rank}: pipelined ops")
    _same(y1, rx, f"rank {rank}: pipelined cached dispatch")
    _same(y3, (rx.float() * 3).to(torch.bfloat16), f"rank {rank}: pipelined cached dispatch after a combine")
    torch.testing.assert_close(out1.cpu().float(), expected, rtol=2e-2, atol=2e-2)
    # the combine in the other element types after the BF16 ones, in the same process: each type has its own
    # kernels (and, with one rank per node on Hopper, its own shared-memory opt-in)
    for dtype in (torch.float32, torch.float16):
        out_t, _, _ = native.combine(rx.to(dtype), h)
        _settle(native, f"rank {rank}: combine in {dtype}")
        assert out_t.dtype == dtype
        torch.testing.assert_close(out_t.cpu().float(), expected, rtol=2e-2, atol=2e-2, msg=f"combine in {dtype}")

    # 200 calls in a row (dispatch + combine), the last one checked
    for i in range(200):
        (rx, _, _, _, h, _), _ = _dispatch(native, x, idx, w, EXPERTS, dev)
        out, _, _ = native.combine(rx, h)
    torch.testing.assert_close(_host(out).float(), expected, rtol=2e-2, atol=2e-2)
    native.backend.check_errors()
    native.destroy()
    ref.destroy()

    # fault injection: the proxies reorder and delay completions; results stay exact
    for seed in fault_seeds:
        os.environ["UCCL_EP_FAULT"] = f"reorder=0.3,delay_us=50,seed={seed}"
        try:
            native, ref = _buffers(world)
        finally:
            os.environ.pop("UCCL_EP_FAULT")
        x, idx, w = _routing(rank, 40, "random", world, L, seed=100 + seed)
        (rx, ridx, _, _, h, _), _ = _dispatch(native, x, idx, w, EXPERTS, dev)
        (ex, eidx, _, _, eh, _), _ = _dispatch(ref, x, idx, w, EXPERTS, "cpu")
        _same(rx, ex, f"rank {rank} fault seed {seed}: recv_x")
        out, _, _ = native.combine(rx, h)
        eout, _, _ = ref.combine(ex, eh)
        torch.testing.assert_close(_host(out).float(), eout.float(), rtol=2e-2, atol=2e-2)
        native.destroy()
        ref.destroy()
    return report


@pytest.mark.parametrize("world,L", [(2, 1), (8, 2), (6, 3), (32, 8)])
def test_layout_and_send_positions_kernels_match_the_reference(world, L):
    """The fresh dispatch's per-token tables come from two kernels (no torch op per call): the layout kernel's
    tokens per node, and the send positions (DeepEP's send_head / send_rdma_head) of every rank and node column,
    in tiles of a block's tokens with a carry: token counts around the tile size, none, one, columns no token
    goes to. Checked against the reference backend's torch definitions (uccl_ep_train.handles), in one process."""
    why = _ready()
    if why:
        pytest.skip(why)
    from uccl_ep_train import _native
    from uccl_ep_train.handles import nodes_of_tokens, send_positions

    dev, N = torch.device("cuda", 0), world // L
    experts = 4 * world
    buf = _native.InternodeBuffer(0, 0, world, L, 1 << 20, 1 << 20, 10.0)
    try:
        for T in (0, 1, 511, 512, 513, 1500, 4096):
            g = torch.Generator().manual_seed(T * 31 + world)
            idx = torch.randint(-1, experts, (T, 3), generator=g)
            idx[idx // 4 == 1] = -1  # rank 1 receives nothing (a node column without hits when L == 1)
            idx = idx.to(dev)
            counts = torch.zeros(world + N + experts, dtype=torch.int32, device=dev)
            per_rank, per_node, per_expert = counts[:world], counts[world:world + N], counts[world + N:]
            in_rank = torch.empty((T, world), dtype=torch.bool, device=dev)
            stream = torch.cuda.current_stream().cuda_stream
            buf.dispatch_layout(idx.data_ptr(), T, 3, experts, per_rank.data_ptr(), per_node.data_ptr(),
                                per_expert.data_ptr(), in_rank.data_ptr(), stream)
            send_pos = torch.empty((T, world), dtype=torch.int32, device=dev)
            node_head = torch.empty((T, N), dtype=torch.int32, device=dev)
            buf.send_positions(in_rank.data_ptr(), T, send_pos.data_ptr(), node_head.data_ptr(), stream)
            torch.cuda.synchronize()
            idx = idx.cpu()
            want_in = torch.zeros((T, world), dtype=torch.bool)
            for t, k in (idx >= 0).nonzero().tolist():
                want_in[t, idx[t, k] // 4] = True
            assert torch.equal(in_rank.cpu(), want_in), f"T={T}: is_token_in_rank"
            assert per_rank.cpu().tolist() == want_in.sum(0).tolist(), f"T={T}: num_tokens_per_rank"
            assert per_expert.cpu().tolist() == torch.bincount(idx[idx >= 0], minlength=experts).tolist()
            nodes = nodes_of_tokens(want_in, N)
            assert per_node.cpu().tolist() == nodes.sum(0).tolist(), f"T={T}: num_tokens_per_rdma_rank"
            assert torch.equal(send_pos.cpu(), send_positions(want_in)), f"T={T}: send positions"
            assert torch.equal(node_head.cpu(), send_positions(nodes)), f"T={T}: node positions"
    finally:
        buf.destroy()


@pytest.mark.parametrize("world,L", [(2, 1), (4, 2), (6, 2), (4, 1)])
def test_internode_one_gpu(mps, world, L):
    why = _ready()
    if why:
        pytest.skip(why)
    seeds = list(range(20)) if (world, L) == (4, 2) else []
    env = {"UCCL_EP_RANKS_PER_NODE": str(L), "UCCL_EP_TIMEOUT_S": "60"}  # auto picks the native backend
    if (world, L) == (2, 1):  # Megatron's setting with tensor-parallel overlap: one hardware queue per process,
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # so anything queued behind the kernels shares it with them
    reports = run_ranks(_run_suite, world, L, seeds, device="cuda", backend="gloo", ranks_per_gpu=world, timeout=600,
                        env=env)
    assert not any(r["calls_gpu_runtime"] for r in reports)  # ipc: the copies run in the copy agents


def fabric_gpu_memory_missing():
    """Why the fabric transport cannot carry GPU memory here (shm provider), or None when it can: it needs a
    libfabric built with CUDA (scripts/build_libfabric.sh, UCCL_EP_LIBFABRIC)."""
    from uccl_ep_train import _native, proxy

    if "fabric" not in proxy.compiled_transports():
        return "fabric transport not compiled in (no libfabric headers; UCCL_EP_LIBFABRIC names a libfabric prefix)"
    try:
        _native.fabric_probe("shm", hmem=True)
    except RuntimeError as exc:
        return str(exc)
    return None


# The fabric transport on libfabric's shm provider: GPU memory registered through FI_HMEM, every inter-node byte
# through libfabric instead of the ipc copy agents.
FABRIC_ENV = {"UCCL_EP_TRANSPORT": "fabric", "FI_PROVIDER": "shm"}


def _run_suite_on_a_stream(rank, world, device, L, fault_seeds):
    """The suite with every call issued from a stream of its own: shm's CUDA copies queue on the default stream
    (Buffer refuses calls from it then)."""
    with torch.cuda.stream(torch.cuda.Stream()):
        return _run_suite(rank, world, device, L, fault_seeds)


@pytest.mark.parametrize("world,L,cq_bytes,per_gpu", [(2, 1, 8, 2), (4, 2, 4, 4), (6, 2, 4, 6), (2, 1, 8, 1)],
                         ids=["2x1", "4x2", "6x2", "2x1-one-rank-per-gpu"])
def test_internode_over_fabric_with_gpu_memory(mps, world, L, cq_bytes, per_gpu):
    """The whole suite above (fresh, cached, FP8, num_worst_tokens, async, combine with weights and bias, 200
    calls, per-destination byte counts exact) with the proxies on the fabric transport, region 0 GPU memory; at
    4 x 2 with the 4-byte CQ-data layout of EFA forced and 20 fault-injection seeds (reorder + delay). `per_gpu`
    ranks share a GPU; one rank per GPU (a host with 2) shows what the ranks sharing one do not cause."""
    why = _ready() or fabric_gpu_memory_missing()
    if not why and torch.cuda.device_count() < world // per_gpu:
        why = f"needs {world // per_gpu} GPUs"
    if why:
        pytest.skip(why)
    seeds = list(range(20)) if (world, L) == (4, 2) else []
    env = dict(FABRIC_ENV, UCCL_EP_RANKS_PER_NODE=str(L), UCCL_EP_TIMEOUT_S="20",
               UCCL_EP_FABRIC_CQ_DATA_BYTES=str(cq_bytes))
    reports = run_ranks(_run_suite_on_a_stream, world, L, seeds, device="cuda", backend="gloo", ranks_per_gpu=per_gpu,
                        timeout=600, env=env)
    assert [r["transport"] for r in reports] == ["fabric (shm)"] * world
    assert all(r["calls_gpu_runtime"] for r in reports)  # shm refuses FI_OPT_CUDA_API_PERMITTED = false


def _from_the_default_stream(rank, world, device):
    import torch.distributed as dist

    from uccl_ep_train import Buffer

    buf = Buffer(dist.new_group(list(range(world)), backend="gloo"), 0, 0)
    x, idx, w = _routing(rank, 32, "random", world, 1, seed=3)
    try:
        _dispatch(buf, x, idx, w, EXPERTS, torch.device("cuda", torch.cuda.current_device()))
        return "no error"
    except RuntimeError as exc:
        return str(exc)
    finally:
        buf.destroy()


def test_fabric_on_shm_refuses_calls_from_the_default_stream(mps):
    """shm's CUDA copies queue on the legacy default stream; a dispatch issued from it would wait for copies
    that wait for it. Every rank refuses it with a sentence instead of hanging until the deadline."""
    why = _ready() or fabric_gpu_memory_missing()
    if why:
        pytest.skip(why)
    env = dict(FABRIC_ENV, UCCL_EP_RANKS_PER_NODE="1", UCCL_EP_TIMEOUT_S="20")
    msgs = run_ranks(_from_the_default_stream, 2, device="cuda", backend="gloo", ranks_per_gpu=2, timeout=120,
                     env=env)
    for rank, msg in enumerate(msgs):
        assert f"rank {rank}:" in msg and "cannot be issued from the default stream" in msg, msg


def _pageable_read_behind_a_combine(rank, world, device):
    import time

    import torch.distributed as dist

    from uccl_ep_train import Buffer

    dev = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(dist.new_group(list(range(world)), backend="gloo"), 0, 0)
    x, idx, w = _routing(rank, 64, "random", world, 1, seed=5)
    with torch.cuda.stream(torch.cuda.Stream()):
        (rx, _, _, _, h, _), _ = _dispatch(buf, x, idx, w, EXPERTS, dev)
        _settle(buf, f"rank {rank}: dispatch")
        dist.barrier()
        if rank == 0:
            time.sleep(0.5)  # rank 1's combine waits for rank 0's rows while rank 1 reads into pageable memory
        out, _, _ = buf.combine(rx, h)
        out.cpu()  # no event awaited first: the pageable copy holds the driver until the combine ran
        try:
            buf.backend.check_errors()
            return "no error"
        except RuntimeError as exc:
            return str(exc)


def test_fabric_on_shm_names_a_pageable_copy_behind_a_combine(mps):
    """What docs/internode.md ("Host copies and the fabric transport") says a training loop must not do: read a
    combine's output into pageable memory while the combine waits for the proxies. It stalls the proxies'
    CUDA copies until the kernels' deadline, and the error then names that cause and the remedy."""
    from uccl_ep_train.backends.native import PAGEABLE_COPY_HINT

    why = _ready() or fabric_gpu_memory_missing()
    if why:
        pytest.skip(why)
    env = dict(FABRIC_ENV, UCCL_EP_RANKS_PER_NODE="1", UCCL_EP_TIMEOUT_S="5")
    msgs = run_ranks(_pageable_read_behind_a_combine, 2, device="cuda", backend="gloo", ranks_per_gpu=2,
                     timeout=120, env=env, hard_exit=True)
    assert "rank 1 (node 1) timed out after 5 s in 'combine" in msgs[1] and PAGEABLE_COPY_HINT in msgs[1], msgs


def _dead_proxy(rank, world, device):
    import time

    import torch.distributed as dist

    from uccl_ep_train import Buffer

    if rank == 1:  # rank 1's proxy thread 0 dies after notify's write + flag and the op's READY (3 commands)
        os.environ["UCCL_EP_FAULT"] = "die_after=3"
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(list(range(world)))
    buf = Buffer(group, int(64e6), int(64e6))
    x, idx, w = _routing(rank, 64, "random", world, 1, seed=7)
    start = time.monotonic()
    try:
        (_, _, _, _, handle, _), _ = _dispatch(buf, x, idx, w, EXPERTS, dev)
        torch.cuda.synchronize()  # rank 1's kernels leave at their deadline; the next call reports why
        buf.dispatch(x.to(dev), handle=handle)  # rank 0: its peer no longer answers
        torch.cuda.synchronize()
        buf.dispatch(x.to(dev), handle=handle)
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_a_dead_proxy_fails_the_gpu_side_within_the_timeout(mps):
    """Rank 1's proxy thread 0 dies (fault injection) during a fresh dispatch: rank 1's next call raises with
    the thread's error; rank 0's kernels, waiting for what rank 1 should have sent, leave at their deadline
    (UCCL_EP_TIMEOUT_S) and its next call raises naming rank, peer, channel and phase; nothing hangs."""
    why = _ready()
    if why:
        pytest.skip(why)
    env = {"UCCL_EP_RANKS_PER_NODE": "1", "UCCL_EP_TIMEOUT_S": "2"}
    results = run_ranks(_dead_proxy, 2, device="cuda", backend="gloo", ranks_per_gpu=2, timeout=120, env=env,
                        hard_exit=True)
    (msg0, took0), (msg1, took1) = results
    # rank 1 learns of its dead thread on its next call (the thread's own error), or from its kernels' deadline
    assert "rank 1 proxy thread 0" in msg1 and "stopped by fault injection after 3 commands" in msg1, msg1
    assert "rank 0 (node 0) timed out after" in msg0 and "waiting for rank 1 (node 1)" in msg0, msg0
    assert took0 < 12 and took1 < 12, (took0, took1)


def _expert_major_landing(rank, world, device, L):
    """dispatch_expert_major across nodes with the rows stored by the dispatch kernels (Config.fuse_max_width
    forces it at these widths) against the reference backend: exact counts, then a capacity layout with
    num_worst_tokens (Megatron's drop-and-pad), then a capacity some source overflows (the same ValueError
    on every rank, before any row moves, and the Buffer goes on); the combine of the landed rows."""
    import dataclasses

    import torch.distributed as dist

    from uccl_ep_train import Buffer

    dev = torch.device("cuda", torch.cuda.current_device())
    native, ref = _buffers(world)
    config = dataclasses.replace(Buffer.get_dispatch_config(world), fuse_max_width=100.0)
    assert native.backend.lands_expert_major(TOPK, EXPERTS, config)
    names = ("x_em", "recv_topk_idx", "recv_topk_weights", "tokens_per_expert", "em_map")
    for case, (mode, T) in enumerate([("random", 96), ("skewed", 80), ("one_node", 0 if rank == 1 else 64)]):
        x, idx, w = _routing(rank, T + 5 * rank if T else 0, mode, world, L, seed=40 + case)
        for capacity, worst in ((0, 0), (40, 200 * world)):
            tag = f"rank {rank} case {case} ({mode}) capacity {capacity}"
            got = native.dispatch_expert_major(_gpu(x, dev), _gpu(idx, dev), _gpu(w, dev), EXPERTS, config=config,
                                               num_worst_tokens=worst, expert_capacity=capacity)
            _settle(native, f"{tag}: dispatch_expert_major")
            want = ref.dispatch_expert_major(x, idx, w, EXPERTS, num_worst_tokens=worst, expert_capacity=capacity)
            for name, a, b in zip(names, got[:5], want[:5]):
                if name == "tokens_per_expert":
                    assert a == b, f"{tag}: {name} {a} vs {b}"
                else:
                    _same(a, b, f"{tag}: {name}")
            y = (got[0].float() * (rank + 2)).to(torch.bfloat16)
            out, _, _ = native.combine_expert_major(y, got[5], got[4], expert_capacity=capacity)
            _settle(native, f"{tag}: combine_expert_major")
            # the rows landed from the dispatch kernels; the combine folds through the permute kernels
            assert native.expert_major_paths == {"dispatch_expert_major": "fused", "combine_expert_major": "permute"}, \
                f"{tag}: {native.expert_major_paths}"
            eout, _, _ = ref.combine_expert_major(y.cpu(), want[5], want[4], expert_capacity=capacity)
            torch.testing.assert_close(_host(out).float(), eout.float(), rtol=2e-2, atol=2e-2, msg=tag)
    # every token of rank 0 to expert 0 (its other slots elsewhere): 64 tokens, over a capacity of 8
    x, idx, w = _routing(rank, 64, "random", world, L, seed=90)
    bad = idx.clone()
    if rank == 0:  # (row 0 of the counts: its first block over the capacity is expert 0's, whatever the others do)
        bad = torch.full((64, TOPK), -1, dtype=torch.int64)
        bad[:, 0], bad[:, 1] = 0, torch.arange(64) % 40 + 1
    overflow = r"dispatch_expert_major: rank 0 sends 64 tokens to local expert 0 of rank 0, more than expert_capacity=8"
    with pytest.raises(ValueError, match=overflow):  # the host sync's check: before any row moves
        native.dispatch_expert_major(_gpu(x, dev), _gpu(bad, dev), _gpu(w, dev), EXPERTS, config=config,
                                     expert_capacity=8)
    dist.barrier()
    (rx, _, _, _, _, _), _ = _dispatch(native, x, idx, w, EXPERTS, dev)
    _settle(native, f"rank {rank}: dispatch after the capacity refusal")
    (ex, _, _, _, _, _), _ = _dispatch(ref, x, idx, w, EXPERTS, "cpu")
    _same(rx, ex, f"rank {rank}: dispatch after the capacity refusal")
    native.destroy()
    ref.destroy()
    # without a host sync (num_worst_tokens) the counts kernel finds the same overflow on every rank, moves no
    # row, and the next check raises it everywhere; likewise a receive over num_worst_tokens
    calls = [lambda b: b.dispatch_expert_major(_gpu(x, dev), _gpu(bad, dev), _gpu(w, dev), EXPERTS, config=config,
                                               num_worst_tokens=64 * world, expert_capacity=8),
             lambda b: _dispatch(b, x, idx, w, EXPERTS, dev, num_worst_tokens=1)]
    for call, want in zip(calls, (overflow, r"receives \d+ tokens, more than num_worst_tokens=1")):
        native, ref = _buffers(world)
        ref.destroy()
        with pytest.raises(RuntimeError, match=want):
            call(native)
            torch.cuda.synchronize()
            native.backend.check_errors()
        native.destroy()
    return 1


def _rows_of_many_chunks(rank, world, device, L):
    """Dispatch and combine of DeepSeek-V3-wide rows (hidden 7168) on 4 SMs: every warp of the combine forward
    moves several rows of several shared-memory chunks (the bulk-copy path with one rank per node reuses its
    stages and flips their phases; the register loop takes several rounds per row). The combine of the
    dispatch's own output, without weights, is exact: each token's partials are its x row, and k copies of a
    BF16 value sum to k * x in float32 without rounding, then round once as k * x does."""
    from uccl_ep_train import Config

    native, ref = _buffers(world)
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = Config(num_sms=4)
    g = torch.Generator().manual_seed(31 + rank)
    T, H = 384 + 32 * rank, 7168
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(T)])
    w = torch.rand(T, TOPK, generator=g)
    (rx, _, _, _, h, _), _ = _dispatch(native, x, idx, w, EXPERTS, dev, config=cfg)
    _settle(native, f"rank {rank}: wide dispatch")
    (ex, _, _, _, _, _), _ = _dispatch(ref, x, idx, w, EXPERTS, "cpu", config=cfg)
    _same(rx, ex, f"rank {rank}: wide recv_x")
    hits = (idx.unsqueeze(-1) // (EXPERTS // world) == torch.arange(world)).any(1).sum(-1, keepdim=True)
    for dtype in (torch.bfloat16, torch.float32):
        out, _, _ = native.combine(rx.to(dtype), h, config=cfg)
        _settle(native, f"rank {rank}: wide combine in {dtype}")
        _same(out, (x.float() * hits).to(dtype), f"rank {rank}: wide combine in {dtype}")
    native.destroy()
    ref.destroy()
    return int(rx.size(0))


@pytest.mark.parametrize("world,L", [(2, 1), (4, 1), (4, 2)])
def test_rows_of_many_chunks_on_few_sms_are_exact(mps, world, L):
    why = _ready()
    if why:
        pytest.skip(why)
    received = run_ranks(_rows_of_many_chunks, world, L, device="cuda", backend="gloo", ranks_per_gpu=world,
                         timeout=600, env={"UCCL_EP_RANKS_PER_NODE": str(L), "UCCL_EP_TIMEOUT_S": "60"})
    assert min(received) > 0, received


@pytest.mark.parametrize("world,L", [(2, 1), (4, 2), (6, 2)])
def test_expert_major_rows_land_from_the_dispatch_kernels(mps, world, L):
    """Expert-major (and capacity) layouts across nodes written by the kernels that output each received row
    (pack, forward, copy-out), bit-equal to the reference's dispatch + permute; rank 1 sends nothing in the
    last case."""
    why = _ready()
    if why:
        pytest.skip(why)
    env = {"UCCL_EP_RANKS_PER_NODE": str(L), "UCCL_EP_TIMEOUT_S": "60"}
    assert run_ranks(_expert_major_landing, world, L, device="cuda", backend="gloo", ranks_per_gpu=world, timeout=400,
                     env=env) == [1] * world
