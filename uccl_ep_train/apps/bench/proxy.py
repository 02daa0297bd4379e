"""`uccl-ep-train bench proxy`: the GPU→CPU command channel and its transports.

Measures, with the benchmarks' conventions (`--json PATH` writes a list of records: bench, op, ranks, gbps,
us, device, sms, plus the shape of each measurement):
  nop_push     commands/s from GPU warps through the rings into the proxy threads (per GPU, per thread)
  pickup_rtt   GPU push -> CPU proxy pickup -> echo seen by the GPU (round trip, GPU clock)
  pickup       GPU push -> CPU proxy pickup, one way: the GPU stamps the globaltimer into the command,
               the proxy stamps its clock at pickup; the two clocks are calibrated per run with the
               probe's own ping-pongs (Cristian's mid-point on the minimum-RTT sample of each window,
               a line through the windows for drift). See one_way_pickup.
  visibility   GPU push of a signalled write to this rank -> proxy -> ipc copy -> in-order arrival seen
               by the GPU (push -> remote visibility through the whole proxy path)
  ipc_write    GB/s per GPU of chunked writes into the peer GPU through the ipc transport (two ranks,
               both directions busy), commands pushed by a GPU kernel, ended by OP_FLUSH per ring
  fabric_write GB/s and commands/s through the fabric transport (CPU producers, two processes, shm/tcp)
  batching     the proxy commands of one low-latency dispatch to a rank of another node: one write of the
               kernels' block (`per-rank`: header, row index, each token once; the kernels send the counts
               header ahead in a write + atomic of its own, not modelled here) against one write per local
               expert, a token once per expert (`per-expert`), each followed by the signalling atomic on the
               same channel; the receiver answers with an atomic and the sender times the round trip
               (`signal`: the atomics alone).
               Two processes: ipc on one GPU (--mode gpu; a one-warp kernel pushes each batch), fabric
               (--mode cpu; the host pushes).

Modes: `--mode gpu` (needs CUDA and the native module with ipc), `--mode cpu` (fabric only), `auto`.
Every record also carries the run's command, date, commit, "gpus" (GPUs the measurement ran on, 0 for CPU
producers) and "timing": "kernel" where the GPU's globaltimer read inside the probe kernel gives the
interval (pickup_rtt, pickup, visibility), "api" where the host clock brackets the host call (nop_push:
launch until the rings drained; ipc_write, fabric_*: push until flushed; the CPU producer's pickup_rtt).
It measures in its own process and spawns the two ranks of ipc_write / fabric_write itself (apps.launch),
so it is not started as a rank of torchrun.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from . import int_list, run_context
from ..launch import launched_world, spawn


BATCHING_SHAPE = {"num_tokens": 128, "hidden": 7168, "num_experts": 256, "num_topk": 8}
BATCHING_SEED = 4321


def _parse(argv):
    p = argparse.ArgumentParser(prog="uccl-ep-train bench proxy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["auto", "gpu", "cpu"], default="auto")
    # lists are comma-separated as in every benchmark (space-separated, as earlier records spell them, too)
    p.add_argument("--threads", type=int_list, nargs="+", default=["1,4"],
                   help="comma-separated proxy thread counts (UCCL_EP_PROXY_THREADS)")
    p.add_argument("--warps-per-ring", type=int, default=8)
    p.add_argument("--nops-per-warp", type=int, default=32768)
    p.add_argument("--latency-iters", type=int, default=2000)
    p.add_argument("--chunk-bytes", type=int_list, nargs="+", default=[f"65536,{1 << 20},{4 << 20}"],
                   help="comma-separated write sizes")
    p.add_argument("--total-bytes", type=int, default=1 << 30, help="bytes per rank per ipc/fabric measurement")
    p.add_argument("--ops", nargs="+", default=["single,ipc,batching"],
                   help="comma-separated: single = NOP flood + latencies on one GPU, ipc = two-GPU write "
                        "bandwidth (gpu mode); batching = per-rank vs per-expert writes of a low-latency block "
                        "(both modes)")
    # the low-latency block `batching` sends: DeepEP's LL test shape, as `bench low-latency`
    for name, default in BATCHING_SHAPE.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=default,
                       help="batching: " + name.replace("_", " "))
    p.add_argument("--provider", default="shm", help="fabric provider for --mode cpu (shm, tcp, sockets)")
    p.add_argument("--json", default=None, help="write the records here")
    args = p.parse_args(argv)
    args.threads = [v for vs in args.threads for v in (vs if isinstance(vs, list) else int_list(vs))]
    args.chunk_bytes = [v for vs in args.chunk_bytes for v in (vs if isinstance(vs, list) else int_list(vs))]
    args.ops = [op for ops in args.ops for op in ops.split(",") if op]
    bad = sorted(set(args.ops) - {"single", "ipc", "batching"})
    if bad:
        p.error(f"--ops: unknown {', '.join(bad)} (choose from single, ipc, batching)")
    return args


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def one_way_pickup(start_ns, publish_ns, seen_ns, pickup_ns, windows: int = 16, skip: int = 10) -> dict:
    """One-way GPU->CPU pickup latency from the pickup probe's stamps.

    start/publish/seen are GPU globaltimer ns (start: before the claim; publish: after the release fence,
    right before the header store; seen: echo observed); pickup is the proxy's clock at pickup (another
    clock, unknown offset, possibly a few ppm of drift). Each iteration is a ping-pong: [publish, seen] on
    the GPU brackets `pickup` on the CPU. Calibration (Cristian): in each of `windows` consecutive windows
    take the iteration with the smallest publish->seen round trip and assume the CPU stamp sits at its
    mid-point: offset = pickup - (publish + seen) / 2; a least-squares line through the windows' offsets
    absorbs drift. Then one_way[i] = pickup[i] - offset(start[i]) - start[i].

    The mid-point assumption is the method's only error: for the calibrating samples, the GPU->CPU leg
    (posted write + CPU poll) and the CPU->GPU leg (CPU store + GPU polling read) are each one PCIe
    crossing and a poll; if they differ by d, every one-way value is off by d/2 (too high when the echo
    leg is the slower one). The minimum round trip (`calib_rtt_min_us`) bounds it: one-way values of the
    calibrating samples are exactly calib_rtt_min/2 + push.
    Returns microseconds (median, p99, min, mean), the split push (start->publish, GPU clock only) and
    transit (publish->pickup), and the calibration's figures.
    """
    g0 = np.asarray(start_ns, np.int64)[skip:]
    gp = np.asarray(publish_ns, np.int64)[skip:]
    gs = np.asarray(seen_ns, np.int64)[skip:]
    c = np.asarray(pickup_ns, np.int64)[skip:]
    n = len(g0)
    if n < 2:
        raise ValueError("one_way_pickup: needs at least 2 iterations after the warm-up skip")
    if not (len(gp) == len(gs) == len(c) == n):
        raise ValueError("one_way_pickup: stamp arrays differ in length")
    # Work relative to the first sample (keeps float64 exact for ns-since-epoch clocks).
    bg, bc = int(g0[0]), int(c[0])
    t0 = (g0 - bg).astype(np.float64)
    tp = (gp - bg).astype(np.float64)
    ts = (gs - bg).astype(np.float64)
    tc = (c - bc).astype(np.float64)
    rtt = ts - tp
    theta = tc - (tp + ts) / 2.0          # CPU - GPU offset (relative), one estimate per iteration
    windows = max(1, min(windows, n // 8 if n >= 8 else 1))
    idx = [int(ch[np.argmin(rtt[ch])]) for ch in np.array_split(np.arange(n), windows) if len(ch)]
    tw, thw = (tp[idx] + ts[idx]) / 2.0, theta[idx]
    if len(idx) >= 3 and np.ptp(tw) > 0:
        slope, icept = np.polyfit(tw, thw, 1)
    else:
        j = int(np.argmin(rtt))
        slope, icept = 0.0, float(theta[j])
    off = lambda t: icept + slope * t  # noqa: E731
    one_way = tc - off(t0) - t0
    transit = tc - off(tp) - tp
    resid = thw - off(tw)
    us = lambda x: float(x) / 1e3  # noqa: E731
    return dict(median_us=us(np.median(one_way)), p99_us=us(np.percentile(one_way, 99)),
                min_us=us(one_way.min()), mean_us=us(one_way.mean()),
                push_median_us=us(np.median(tp - t0)), transit_median_us=us(np.median(transit)),
                calib_rtt_min_us=us(rtt[idx].min()), calib_rtt_median_us=us(np.median(rtt)),
                drift_ppm=float(slope) * 1e6, calib_windows=len(idx),
                calib_resid_us=us(np.abs(resid).max()) if len(resid) else 0.0, iters=n,
                method="cristian-min-rtt")


def _device_name():
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return "cpu"


# ---------------------------------------------------------------------------------------------- gpu
def _gpu_single(args, device):
    """One rank on GPU 0 with the ipc transport: NOP flood, pickup round trip, self visibility."""
    import torch
    from uccl_ep_train import _native
    from uccl_ep_train.proxy import ProxyGroup
    recs = []
    torch.cuda.set_device(0)
    region = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    for threads in args.threads:
        # adaptive_sleep off: the proxies spin for the whole measurement (idle_sleeps is recorded to show it)
        with ProxyGroup(0, 1, {0: region}, transport="ipc", gpu=0, num_threads=threads, timeout_s=120,
                        adaptive_sleep=False) as g:
            _native.gpu_bench_nops(g._native, 1, 64)  # warm-up
            total = threads * args.warps_per_ring * args.nops_per_warp
            sec = _native.gpu_bench_nops(g._native, args.warps_per_ring, args.nops_per_warp, 120.0)
            rate = total / sec
            recs.append(dict(bench="proxy", op="nop_push", ranks=1, gbps=rate * 16 / 1e9, us=sec / total * 1e6,
                             device=device, gpus=1, timing="api", sms=0, threads=threads,
                             warps_per_ring=args.warps_per_ring, ring_publish=g.config().get("ring_publish"),
                             commands=total, commands_per_s=rate, commands_per_s_per_thread=rate / threads,
                             cpus=g.thread_cpus()))
            print(f"[nop_push] threads={threads} warps/ring={args.warps_per_ring} publish="
                  f"{g.config().get('ring_publish')}: {rate / 1e6:.2f} M cmd/s per GPU, "
                  f"{rate / threads / 1e6:.2f} M/s per proxy thread", flush=True)
            if threads == max(args.threads):
                recs += _pickup(args, g, device, threads)
                vis = [x / 1e3 for x in _native.gpu_visibility_latency(g._native, 0, 0, 64, 0, 4096,
                                                                         args.latency_iters)][10:]
                med, p99 = statistics.median(vis), _pct(vis, 0.99)
                recs.append(dict(bench="proxy", op="visibility", ranks=1, gbps=0.0, us=med, device=device, gpus=1,
                                 timing="kernel", sms=0, threads=threads, bytes=64, median_us=med, p99_us=p99,
                                 iters=len(vis), transport="ipc"))
                print(f"[visibility] push -> ipc write -> in-order arrival seen by GPU: median {med:.2f} us "
                      f"p99 {p99:.2f} us", flush=True)
            g.check()
    return recs


# pickup_latency_kernel's modes (csrc/proxy/ring_gpu.cu): 0-3 publish body + header behind a system-scope
# release (fence, then a relaxed header; or st.release.sys), 4 the whole command in one 16-byte store with
# no fence (the vector publish, UCCL_EP_RING_PUBLISH=vector), 5 a producer that owns the ring (RingProducer:
# no claim atomic, head in a register; published as the ring is configured, i.e. vector by default).
PICKUP_VARIANTS = {0: "fence+store/acquire-poll", 1: "relaxed-poll", 2: "preclaimed", 3: "release-store",
                   4: "vector-store", 5: "owned-ring"}


def _pickup(args, g, device, threads):
    """Pickup probe on ring 0: round trip (GPU clock) and one-way (calibrated) per variant."""
    from uccl_ep_train import _native
    recs = []
    step_ns, steps, span = _native.gpu_timer_resolution(g.gpu)
    timer_ns = span / steps if steps else float("nan")
    print(f"[pickup] globaltimer: smallest step {step_ns} ns, mean step {timer_ns:.1f} ns", flush=True)
    for mode, name in PICKUP_VARIANTS.items():
        sleeps0 = g.stats()["idle_sleeps"]
        st = _native.gpu_pickup_stamps(g._native, 0, args.latency_iters, mode)
        sleeps = g.stats()["idle_sleeps"] - sleeps0
        start, seen = np.asarray(st["start_ns"], np.int64), np.asarray(st["seen_ns"], np.int64)
        rtt = ((seen - start) / 1e3)[10:].tolist()
        med, p99 = statistics.median(rtt), _pct(rtt, 0.99)
        common = dict(ranks=1, gbps=0.0, device=device, gpus=1, timing="kernel", sms=0, threads=threads,
                      variant=name, mode=mode,
                      idle_sleeps=sleeps, globaltimer_step_ns=step_ns, globaltimer_mean_step_ns=timer_ns,
                      ring_publish=g.config().get("ring_publish"))
        recs.append(dict(bench="proxy", op="pickup_rtt", us=med, median_us=med, p99_us=p99, min_us=min(rtt),
                         one_way_median_us=med / 2, iters=len(rtt), **common))
        ow = one_way_pickup(st["start_ns"], st["publish_ns"], st["seen_ns"], st["pickup_ns"], skip=10)
        recs.append(dict(bench="proxy", op="pickup", us=ow["median_us"], proxy_ticks_per_ns=st["ticks_per_ns"],
                         **ow, **common))
        print(f"[pickup] {name}: one-way GPU->CPU median {ow['median_us']:.2f} us p99 {ow['p99_us']:.2f} us "
              f"(push {ow['push_median_us']:.2f} + transit {ow['transit_median_us']:.2f}; calibration min RTT "
              f"{ow['calib_rtt_min_us']:.2f} us, drift {ow['drift_ppm']:.1f} ppm); round trip median {med:.2f} us "
              f"p99 {p99:.2f} us; idle sleeps {sleeps}", flush=True)
    return recs


def _ipc_rank(rank, world, args, threads):
    """One of the two ranks of ipc_write (GPU rank % count): its records, one per chunk size."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    import torch
    import torch.distributed as dist
    from uccl_ep_train import _native
    from uccl_ep_train import proxy as P
    dev = rank % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    recs = []
    peer = 1 - rank
    max_chunk = max(args.chunk_bytes)
    span = max(args.total_bytes // 4, max_chunk * 8)
    region = torch.zeros(2 * span, dtype=torch.uint8, device="cuda")
    with P.ProxyGroup(rank, world, {0: region}, transport="ipc", gpu=dev, num_threads=threads,
                      timeout_s=120) as g:
        for chunk in args.chunk_bytes:
            n = max(threads, args.total_bytes // chunk)
            per_slot = span // chunk
            rows, offsets = [], [0]
            for t in range(threads):
                mine = [i for i in range(n) if i % threads == t]
                rows += [(P.OP_WRITE, peer, t, 0, chunk, (i % per_slot) * chunk, span + (i % per_slot) * chunk)
                         for i in mine]
                rows.append((P.OP_FLUSH, peer, t, 0, 0, 0, 0))
                offsets.append(len(rows))
            cmds = torch.from_numpy(P.make_commands(rows).view(np.uint8).copy()).cuda()
            base = [g.flushed(t) for t in range(threads)]
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            _native.gpu_push_commands(g._native, cmds.data_ptr(), offsets, 1,
                                      torch.cuda.current_stream().cuda_stream)
            for t in range(threads):
                g.wait_flushed(t, base[t] + 1, timeout_s=120)
            sec = time.perf_counter() - t0
            gbps = n * chunk / sec / 1e9
            recs.append(dict(bench="proxy", op="ipc_write", ranks=world, gbps=gbps, us=sec / n * 1e6,
                             device=torch.cuda.get_device_name(dev), timing="api",
                             gpus=min(world, torch.cuda.device_count()), sms=0, threads=threads, chunk_bytes=chunk,
                             commands=n, total_bytes=n * chunk, rank=rank, seconds=sec,
                             commands_per_s=n / sec, transport="ipc", both_directions=True,
                             max_inflight=g.config()["max_inflight"],
                             ring_publish=g.config().get("ring_publish")))
            dist.barrier()
        g.check()
    return recs


def _gpu_ipc(args):
    recs = []
    threads = max(args.threads)
    out = spawn(_ipc_rank, 2, args, threads, timeout=300)
    for i, chunk in enumerate(args.chunk_bytes):
        rows = [rank_recs[i] for rank_recs in out]
        for r in rows:
            recs.append(r)
        gb = [r["gbps"] for r in rows]
        print(f"[ipc_write] chunk {chunk >> 10} KiB, {threads} threads, in-flight {rows[0]['max_inflight']}, both directions: "
              f"{' / '.join(f'{x:.1f}' for x in gb)} GB/s per GPU, "
              f"{rows[0]['commands_per_s'] / 1e3:.1f} K cmd/s", flush=True)
    return recs


def batching_commands(args, pattern: str, peer: int) -> tuple[np.ndarray, dict]:
    """The proxy commands that move one low-latency dispatch's data for `peer` (the other of two ranks, one
    per node), for a seeded top-k routing of `num_tokens` tokens: `per-rank` one write of the kernels' block
    (counts header, row index, then each token once however many of its experts the peer has;
    backends.low_latency.low_latency_layout), `per-expert` one write per local expert with rows, each row a
    whole message (a token once per expert, as a per-expert batching needs; the first write carries the
    header), `signal` none; then the atomic that raises the peer's signal. Both write from offset 0 of this
    rank's buffer to offset `span` of the peer's (`shape["span"]`: room for either pattern)."""
    from uccl_ep_train import proxy as P
    from uccl_ep_train.backends.low_latency import low_latency_layout
    lay = low_latency_layout(args.num_tokens, args.hidden, 2, args.num_experts)
    rng = np.random.default_rng(BATCHING_SEED)
    experts = np.stack([rng.choice(args.num_experts, args.num_topk, replace=False) for _ in range(args.num_tokens)])
    hits = experts // lay.num_local == peer
    counts = np.bincount(experts[hits] % lay.num_local, minlength=lay.num_local)
    rows, tokens = int(counts.sum()), int(hits.any(axis=1).sum())
    span = -(-max(lay.hdr_bytes + lay.idx_bytes + tokens * lay.msg_bytes, lay.hdr_bytes + rows * lay.msg_bytes)
             // 4096) * 4096  # whole pages
    pieces = []
    if pattern == "per-rank":
        pieces = [(0, lay.hdr_bytes + lay.idx_bytes + tokens * lay.msg_bytes)]
    elif pattern == "per-expert":
        at = lay.hdr_bytes
        for n in counts[counts > 0]:
            start = 0 if not pieces else at  # the first write also carries the header
            pieces.append((start, at + int(n) * lay.msg_bytes - start))
            at += int(n) * lay.msg_bytes
    cmds = [(P.OP_WRITE, peer, 0, 0, length, off, span + off) for off, length in pieces]
    cmds.append((P.OP_ATOMIC_ADD, peer, 0, 1, 1, 0, 8 * peer))
    shape = dict(pattern=pattern, writes=len(pieces), rows=rows, tokens=tokens, span=span,
                 block_bytes=sum(n for _, n in pieces), local_experts=lay.num_local,
                 experts_with_rows=int((counts > 0).sum()), **{k: getattr(args, k) for k in BATCHING_SHAPE})
    return P.make_commands(cmds), shape


def _batching_rank(rank, world, args, transport):
    """One of the two ranks of `batching`: rank 0 pushes a pattern's commands to rank 1 and spins on its own
    signal word; rank 1 spins on its word and answers with one atomic. Returns rank 0's records."""
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist
    from uccl_ep_train import proxy as P
    dist.init_process_group("gloo")
    peer = 1 - rank
    size = 2 * batching_commands(args, "per-expert", peer)[1]["span"]  # where this rank sends from, then receives
    flags = np.zeros(2, np.int64)  # word r: the signal rank r's peer raises (host memory: atomic target)
    if transport == "ipc":
        gpu = rank % torch.cuda.device_count()
        torch.cuda.set_device(gpu)
        data = torch.zeros(size, dtype=torch.uint8, device="cuda")
        # two ranks on one GPU would pin their spinning proxy threads to the same core, where they time-slice
        # at ~4 ms per hop (the emulated-node rule of backends.internode._shared_gpu_proxy_options)
        opts = dict(gpu=gpu, pin_threads=torch.cuda.device_count() >= 2)
    else:
        data, gpu = np.zeros(size, np.uint8), -1
        opts = dict(provider=args.provider, pin_threads=False)
    recs = []
    with P.ProxyGroup(rank, world, {0: data, 1: flags}, transport=transport, num_threads=1, timeout_s=120,
                      adaptive_sleep=False, low_latency=True, **opts) as g:
        if gpu >= 0:  # the rings of a GPU proxy take GPU producers: a one-warp kernel pushes each batch
            from uccl_ep_train import _native
            side = torch.cuda.Stream()  # not the legacy default stream, which would wait for other work
            stream = side.cuda_stream

            def on_gpu(c):
                return torch.from_numpy(c.view(np.uint8).copy()).cuda(), [0, len(c)]

            def push(c):
                _native.gpu_push_commands(g._native, c[0].data_ptr(), c[1], 1, stream)
        else:
            def on_gpu(c):
                return c

            def push(c):
                g.push(0, c)
        answer = on_gpu(P.make_commands([(P.OP_ATOMIC_ADD, peer, 0, 1, 1, 0, 8 * peer)]))
        signals = 0
        for pattern in ("signal", "per-rank", "per-expert"):
            cmds, shape = batching_commands(args, pattern, peer)
            cmds = on_gpu(cmds)
            times, pushes = [], []
            dist.barrier()
            for _ in range(args.latency_iters):
                signals += 1
                deadline = time.monotonic() + 60
                t0 = time.perf_counter()
                if rank == 0:
                    push(cmds)
                    pushes.append((time.perf_counter() - t0) * 1e6)
                while flags[rank] < signals:
                    os.sched_yield()  # the proxy threads may share this core
                    if time.monotonic() > deadline:
                        g.check()
                        raise TimeoutError(f"bench proxy batching: rank {rank} waited 60 s for signal {signals} "
                                           f"({pattern})")
                if rank == 1:
                    t1 = time.perf_counter()
                    push(answer)
                    pushes.append((time.perf_counter() - t1) * 1e6)
                times.append((time.perf_counter() - t0) * 1e6)
            skip = min(10, len(times) // 2)
            # the host time of each push call (a kernel launch and its sync on a GPU proxy): rank 0's batch,
            # rank 1's answer; the rest of the round trip is the proxies, the transport and the waits
            push_us = [None, None]
            dist.all_gather_object(push_us, statistics.median(pushes[skip:]))
            if rank == 0:
                rtt = times[skip:]
                med = statistics.median(rtt)
                recs.append(dict(bench="proxy", op="batching", ranks=world, us=med, median_us=med,
                                 p99_us=_pct(rtt, 0.99), min_us=min(rtt), iters=len(rtt),
                                 push_median_us=push_us[0], answer_push_median_us=push_us[1],
                                 gbps=shape["block_bytes"] / med / 1e3, device=_device_name() if gpu >= 0 else "cpu",
                                 gpus=1 if gpu >= 0 else 0, timing="api", sms=0, threads=1, transport=transport,
                                 producer="gpu" if gpu >= 0 else "cpu",
                                 **({"provider": args.provider} if gpu < 0 else {}), **shape))
        dist.barrier()
        g.check()
    return recs


def _batching(args, transport):
    recs = spawn(_batching_rank, 2, args, transport, timeout=600)[0]
    for r in recs:
        print(f"[batching] {transport}{'/' + r['provider'] if 'provider' in r else ''} {r['pattern']}: "
              f"{r['writes']} write(s) of {r['block_bytes'] / 1e6:.2f} MB + 1 atomic, round trip median "
              f"{r['median_us']:.1f} us p99 {r['p99_us']:.1f} us (pushes {r['push_median_us']:.1f} + "
              f"{r['answer_push_median_us']:.1f} us)", flush=True)
    return recs


# ---------------------------------------------------------------------------------------------- cpu
def _fabric_rank(rank, world, args, threads):
    """One of the two ranks of fabric_cmds / fabric_write (CPU producers): its records, one per chunk size."""
    os.environ["FI_PROVIDER"] = args.provider
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    os.environ.setdefault("FI_SOCKETS_IFACE", "lo")
    import torch.distributed as dist
    from uccl_ep_train import proxy as P
    dist.init_process_group("gloo")
    recs = []
    peer = 1 - rank
    max_chunk = max(args.chunk_bytes)
    span = max(min(args.total_bytes, 64 << 20) // 2, max_chunk * 4)
    buf = np.zeros(2 * span, np.uint8)
    with P.ProxyGroup(rank, world, {0: buf}, transport="fabric", num_threads=threads, pin_threads=False,
                      timeout_s=120, max_inflight=32) as g:
        for chunk in [0] + list(args.chunk_bytes):
            total = args.total_bytes if chunk else 0
            n = max(threads, total // chunk) if chunk else 20000
            per_slot = max(1, span // max(chunk, 1))
            base = [g.flushed(t) for t in range(threads)]
            per_ring = []
            for t in range(threads):
                rows = [(P.OP_WRITE, peer, t, 0, chunk, (i % per_slot) * chunk, span + (i % per_slot) * chunk)
                        for i in range(t, n, threads)]
                rows.append((P.OP_FLUSH, peer, t, 0, 0, 0, 0))
                per_ring.append(P.make_commands(rows))
            dist.barrier()
            t0 = time.perf_counter()
            for t in range(threads):
                g.push(t, per_ring[t])
            for t in range(threads):
                g.wait_flushed(t, base[t] + 1, timeout_s=120)
            sec = time.perf_counter() - t0
            recs.append(dict(bench="proxy", op="fabric_write" if chunk else "fabric_cmds", ranks=world,
                             gbps=n * chunk / sec / 1e9, us=sec / n * 1e6, device="cpu", gpus=0,
                             timing="api", sms=0,
                             threads=threads, chunk_bytes=chunk, commands=n, commands_per_s=n / sec,
                             provider=args.provider, rank=rank, transport="fabric", producer="cpu"))
            dist.barrier()
        g.check()
    return recs


def _cpu_latency(args):
    """Proxy-loop round trip with a CPU producer (push NOP, spin on the echo), loopback fabric proxy."""
    from uccl_ep_train import _native
    from uccl_ep_train.proxy import ProxyGroup
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    recs = []
    with ProxyGroup(0, 1, {0: np.zeros(4096, np.uint8)}, transport="fabric", provider=args.provider, num_threads=1,
                    pin_threads=False, adaptive_sleep=False) as g:
        rtt = [x / 1e3 for x in _native.cpu_pickup_latency(g._native, 0, args.latency_iters)][10:]
    med, p99 = statistics.median(rtt), _pct(rtt, 0.99)
    recs.append(dict(bench="proxy", op="pickup_rtt", ranks=1, gbps=0.0, us=med, device="cpu", gpus=0,
                     timing="api", sms=0, threads=1,
                     median_us=med, p99_us=p99, iters=len(rtt), variant="cpu-producer", producer="cpu"))
    print(f"[pickup_rtt] CPU producer -> proxy -> echo: median {med:.2f} us p99 {p99:.2f} us", flush=True)
    return recs


def _cpu(args):
    threads = min(args.threads)
    out = spawn(_fabric_rank, 2, args, threads, timeout=300)
    recs = []
    for i in range(len(out[0])):
        rows = [rank_recs[i] for rank_recs in out]
        recs += rows
        r0 = rows[0]
        print(f"[{r0['op']}] fabric/{args.provider} chunk {r0['chunk_bytes']} B, {threads} threads: "
              f"{r0['gbps']:.2f} GB/s, {r0['commands_per_s'] / 1e3:.1f} K cmd/s per rank", flush=True)
    return recs


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if launched_world() is not None:
        print("bench proxy: measures in this process and spawns its own pair of ranks: run it without torchrun",
              file=sys.stderr)
        return 2
    from uccl_ep_train import proxy as P
    if not P.available():
        print("bench proxy: the native module is not built (python setup.py build_ext --inplace)", file=sys.stderr)
        return 2
    mode = args.mode
    if mode == "auto":
        try:
            import torch
            gpu_ok = torch.cuda.is_available() and "ipc" in P.compiled_transports()
        except Exception:
            gpu_ok = False
        mode = "gpu" if gpu_ok else "cpu"
    context = run_context("bench proxy", argv)
    records = []
    if mode == "gpu":
        device = _device_name()
        if "single" in args.ops:
            records += _gpu_single(args, device)
        import torch
        if "ipc" not in args.ops:
            pass
        elif torch.cuda.device_count() >= 2:
            records += _gpu_ipc(args)
        else:
            print("[ipc_write] skipped: needs 2 GPUs", flush=True)
        if "batching" in args.ops:
            records += _batching(args, "ipc")
    else:
        records += _cpu_latency(args)
        records += _cpu(args)
        if "batching" in args.ops:
            records += _batching(args, "fabric")
    records = [{**r, **context} for r in records]
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {len(records)} records to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
