"""Fabric transport across processes (libfabric tcp / shm / sockets on loopback), with fault injection.

Each rank writes patterned chunks of varying length (zero included) to every rank (itself included) on
several channels spread over the proxy threads, interleaved with atomic adds and closed by a barrier.
Checked on the receiver: every byte lands exactly once at the right offset and nothing else is touched;
sequence tails, signalled-write counts, barrier counts and counters reach their exact values; with
completions reordered and delayed (many seeds), all of that still holds. A silent peer ends in a timeout
error that names rank, peer, channel and phase. Proxies are torn down and rebuilt between rounds.
"""
import os
import threading

import numpy as np
import pytest

from uccl_ep_train import proxy as P
from uccl_ep_train.apps.launch import spawn

pytestmark = pytest.mark.skipif(not P.available() or "fabric" not in P.compiled_transports(),
                                reason="native module with the fabric transport not built")

CH = [0, 1, 2, 3]      # channels (ring = channel % threads)
K = 24                 # chunks per (src, dst, channel)
S = 512                # chunk slot size


def _pattern(src, dst, ch, k, n):
    return ((np.arange(n) + src * 31 + dst * 17 + ch * 7 + k * 3) % 251 + 1).astype(np.uint8)


def _length(k):
    return 0 if k % 7 == 6 else S - (k % 5) * 13


def _exchange_round(rank, world, fault, provider, threads):
    """One full round: build a ProxyGroup, exchange, verify, tear down. Returns proxy stats."""
    import torch.distributed as dist
    slot = lambda s, c, k: ((s * len(CH) + CH.index(c)) * K + k) * S  # noqa: E731
    recv_bytes = world * len(CH) * K * S
    send_bytes = world * len(CH) * K * S
    buf = np.zeros(send_bytes + recv_bytes, np.uint8)
    counters = np.zeros(world * len(CH), np.int64)
    for d in range(world):
        for c in CH:
            for k in range(K):
                n = _length(k)
                off = slot(d, c, k)  # send area indexed by destination
                buf[off: off + n] = _pattern(rank, d, c, k, n)
    g = P.ProxyGroup(rank, world, {0: buf, 1: counters}, transport="fabric", num_threads=threads, provider=provider,
                     fault=fault, pin_threads=False, timeout_s=60)
    try:
        per_ring = {t: [] for t in range(threads)}
        for d in range(world):
            for c in CH:
                for k in range(K):
                    op = P.OP_WRITE_IMM if k % 2 else P.OP_WRITE
                    per_ring[c % threads].append((op, d, c, 0, _length(k), slot(d, c, k), send_bytes + slot(rank, c, k)))
                    per_ring[c % threads].append((P.OP_ATOMIC_ADD, d, c, 1, _length(k) + 1, 0,
                                                  8 * (rank * len(CH) + CH.index(c))))
                per_ring[c % threads].append((P.OP_BARRIER, d, c, 0, 0, 0, 0))
        errs = []

        def produce(t, rows):
            try:  # two producers per ring, racing for slots
                half = len(rows) // 2
                g.push(t, P.make_commands(rows[:half]))
                g.push(t, P.make_commands(rows[half:]))
            except Exception as e:  # pragma: no cover
                errs.append(e)

        # Per (dst, channel) order must follow push order for the counters' meaning, so each ring's rows
        # go through one thread in order; rings run concurrently.
        ts = [threading.Thread(target=produce, args=(t, rows)) for t, rows in per_ring.items()]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not errs, errs
        ops_per_stream = 2 * K + 1
        for s in range(world):
            for c in CH:
                g.wait_seq(s, c, ops_per_stream, timeout_s=60, phase="exchange")
        g.check()
        for s in range(world):
            assert g.barrier_count(s) == len(CH)
            for c in CH:
                assert g.seq_tail(s, c) == ops_per_stream
                assert g.imm_count(s, c) == K // 2
                assert counters[s * len(CH) + CH.index(c)] == sum(_length(k) + 1 for k in range(K))
                for k in range(K):
                    off = send_bytes + slot(s, c, k)
                    n = _length(k)
                    np.testing.assert_array_equal(buf[off: off + n], _pattern(s, rank, c, k, n))
                    assert not buf[off + n: off + S].any(), "bytes beyond the write were touched"
        stats = dict(g.stats(), imm_seq_bits=g.config()["imm_seq_bits"])
        dist.barrier()  # peers finished reading our completions before anyone tears down
        return stats
    finally:
        g.close()


def _worker(rank, world, provider, faults, threads, env):
    os.environ.update(env)
    os.environ["FI_PROVIDER"] = provider
    os.environ["FI_TCP_IFACE"] = "lo"
    os.environ["FI_SOCKETS_IFACE"] = "lo"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist
    dist.init_process_group("gloo")
    return [_exchange_round(rank, world, f, provider, threads) for f in faults]


def _run(world, provider, faults, threads=2, timeout=150, env=None):
    return spawn(_worker, world, provider, faults, threads, env or {}, timeout=timeout)


def test_tcp_two_ranks_every_byte_once():
    out = _run(2, "tcp", [""])
    for rank, (stats,) in enumerate(out):
        assert stats["rejected"] == 0 and stats["arrivals"] > 0 and stats["imm_seq_bits"] == 24


def test_shm_two_ranks_fault_injection_many_seeds():
    faults = [f"reorder=0.3,delay_us=50,seed={s}" for s in range(1, 5)]
    out = _run(2, "shm", faults, threads=2)
    for rank, stats in enumerate(out):
        assert all(s["fault_held"] > 0 for s in stats)
        assert sum(s["out_of_order"] for s in stats) > 0


def test_tcp_three_ranks_reorder_and_four_threads():
    out = _run(3, "tcp", ["reorder=0.5,delay_us=20,seed=11"], threads=4)
    for rank, (stats,) in enumerate(out):
        assert stats["out_of_order"] > 0


@pytest.mark.parametrize("provider", ["shm", "tcp"])
def test_four_byte_cq_data_layout_under_reordering(provider):
    """EFA's efa provider carries 4 bytes of remote CQ data: the writer's rank and the immediate then share
    them (17-bit sequence numbers). Forced on providers that offer 8, every byte still lands once and every
    count is exact with completions reordered and delayed, loopback writes included."""
    faults = [f"reorder=0.5,delay_us=30,seed={s}" for s in range(1, 4)]
    out = _run(3, provider, faults, threads=2, env={"UCCL_EP_FABRIC_CQ_DATA_BYTES": "4"})
    for rank, stats in enumerate(out):
        assert all(s["rejected"] == 0 and s["fault_held"] > 0 and s["imm_seq_bits"] == 17 for s in stats)
        assert sum(s["out_of_order"] for s in stats) > 0


def _mixed_layout_worker(rank, world):
    os.environ.update(FI_PROVIDER="tcp", FI_TCP_IFACE="lo", UCCL_EP_FABRIC_CQ_DATA_BYTES="4" if rank else "8")
    import torch.distributed as dist
    dist.init_process_group("gloo")
    try:
        P.ProxyGroup(rank, 2, {0: np.zeros(4096, np.uint8)}, transport="fabric", num_threads=1, pin_threads=False)
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"


def test_ranks_disagreeing_on_the_cq_data_layout_fail_at_bootstrap():
    res = spawn(_mixed_layout_worker, 2, timeout=90)
    for msg in res:
        assert "UCCL_EP_FABRIC_CQ_DATA_BYTES" in msg and "bytes of CQ data" in msg, msg


def test_sockets_provider_two_ranks():
    out = _run(2, "sockets", [""], threads=1)
    assert len(out) == 2


def _silent_worker(rank, world):
    os.environ["FI_PROVIDER"] = "tcp"
    os.environ["FI_TCP_IFACE"] = "lo"
    import torch.distributed as dist
    dist.init_process_group("gloo")
    g = P.ProxyGroup(rank, 2, {0: np.zeros(4096, np.uint8)}, transport="fabric", num_threads=1,
                     pin_threads=False, timeout_s=1.5)
    msg = ""
    if rank == 0:  # rank 1 never sends: rank 0's wait must end with a precise error
        try:
            g.wait_seq(1, 3, 1, phase="dispatch")
        except RuntimeError as e:
            msg = str(e)
    dist.barrier()
    g.close()
    return msg


def test_silent_peer_times_out_with_rank_peer_channel_phase():
    res = spawn(_silent_worker, 2, timeout=90)
    msg = res[0]
    for part in ("rank 0", "waiting for rank 1", "channel 3", "'dispatch'", "timed out"):
        assert part in msg, msg


def _dying_rank_worker(rank, world, rounds):
    """Rounds of: every rank writes 1 MiB chunks to every other on both proxy threads while rank 1's threads die
    after their second command (die_after), so the peers' writes to rank 1 stop half received; then every rank
    closes. Returns, per round, rank 1's error (rank 1) or how long close() took (every rank)."""
    os.environ.update(FI_PROVIDER="tcp", FI_TCP_IFACE="lo")
    import time

    import torch.distributed as dist
    dist.init_process_group("gloo")
    chunk, out = 1 << 20, []
    for _ in range(rounds):
        buf = np.zeros(4 * chunk, np.uint8)
        g = P.ProxyGroup(rank, world, {0: buf}, transport="fabric", num_threads=2, pin_threads=False, timeout_s=5,
                         fault="die_after=2" if rank == 1 else "")
        for t in range(2):
            rows = [(P.OP_WRITE, d, t, 0, chunk, 0, 2 * chunk) for d in range(world) if d != rank for _ in range(4)]
            g.push(t, P.make_commands(rows))
        error = ""
        deadline = time.monotonic() + 10
        while rank == 1 and not error and time.monotonic() < deadline:  # until a thread took its 2nd and stopped
            try:
                g.check()
            except RuntimeError as e:
                error = str(e)
            time.sleep(0.001)
        dist.barrier()
        start = time.monotonic()
        g.close()
        out.append((error, time.monotonic() - start))
        dist.barrier()
    return out


def test_closing_after_a_proxy_thread_died_mid_transfer_never_crashes(capfd):
    """libfabric 1.17's tcp;ofi_rxm segfaults in fi_close when an endpoint closes with a peer's write half
    received (rank 1's threads died with the peers' writes to it in flight: the old teardown crashed in most of
    these rounds). Every endpoint now quiesces with its peers first (Transport::quiesce): no rank crashes (a
    crash fails spawn), every close agrees with the peers quickly, and rank 1 still reports its thread's death."""
    rounds = 8
    res = spawn(_dying_rank_worker, 3, rounds, timeout=240)
    assert all("die_after" in error for error, _ in res[1]), res[1]
    for rank in range(3):
        assert len(res[rank]) == rounds and all(took < 5 for _, took in res[rank]), res[rank]
    assert "closes a busy endpoint" not in capfd.readouterr().err


def _bootstrap_fail_worker(rank, world):
    os.environ["FI_TCP_IFACE"] = "lo"
    import torch.distributed as dist
    dist.init_process_group("gloo")
    provider = "tcp" if rank == 0 else "no-such-provider"
    try:
        P.ProxyGroup(rank, 2, {0: np.zeros(4096, np.uint8)}, transport="fabric", provider=provider,
                     num_threads=1, pin_threads=False)
        msg = "no error"
    except Exception as e:  # noqa: BLE001
        msg = str(e)
    return msg


def test_a_rank_failing_at_bootstrap_fails_every_rank_without_hanging():
    res = spawn(_bootstrap_fail_worker, 2, timeout=90)
    assert "no-such-provider" in res[1]
    assert "bootstrap failed on rank 1" in res[0] and "no-such-provider" in res[0]


def _sizes_to(src, dst):
    """Write lengths rank `src` sends to `dst`: a different total per (src, dst), every ring used."""
    return [64 * (dst + 1) + 8 * src + 3 * k for k in range(5)]


def _per_destination_worker(rank, world):
    os.environ["FI_PROVIDER"] = "tcp"
    os.environ["FI_TCP_IFACE"] = "lo"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist
    dist.init_process_group("gloo")
    threads, slot = 2, 2048
    recv_base = world * slot
    buf = np.zeros(2 * world * slot, np.uint8)   # [send area per destination | receive area per source]
    counters = np.zeros(world, np.int64)
    for d in range(world):
        buf[d * slot: (d + 1) * slot] = (np.arange(slot) + 13 * rank + d) % 251 + 1
    g = P.ProxyGroup(rank, world, {0: buf, 1: counters}, transport="fabric", num_threads=threads,
                     provider="tcp", pin_threads=False, timeout_s=60)
    try:
        rows = {t: [] for t in range(threads)}
        for d in range(world):
            for k, n in enumerate(_sizes_to(rank, d)):   # channel k: spread over both threads
                off = sum(_sizes_to(rank, d)[:k])
                rows[k % threads].append((P.OP_WRITE if k % 2 else P.OP_WRITE_IMM, d, k, 0, n,
                                          d * slot + off, recv_base + rank * slot + off))
            rows[0].append((P.OP_WRITE_IMM, d, 0, 0, 0, 0, recv_base))          # zero-length signal
            rows[1].append((P.OP_ATOMIC_ADD, d, 1, 1, 5, 0, 8 * rank))
            rows[1].append((P.OP_BARRIER, d, 1, 0, 0, 0, 0))
        rows[0].append((P.OP_NOP, 0, 0, 0, 99, 0, 0))                           # goes nowhere
        for t in range(threads):
            rows[t].append((P.OP_FLUSH, 0, t, 0, 0, 0, 0))
            g.push(t, P.make_commands(rows[t]))
        # The flush runs on the sending thread after every earlier command of its ring was posted and
        # completed, so the counts read after it are final.
        g.wait_flushed(0, 1, timeout_s=60)
        g.wait_flushed(1, world + 1, timeout_s=60)   # a barrier also bumps `flushed`
        for s in range(world):                       # and the peers' operations reached us
            for ch, ops in ((0, 2), (1, 3), (2, 1), (3, 1), (4, 1)):
                g.wait_seq(s, ch, ops, timeout_s=60, phase="per-destination")
        g.check()
        stats = g.stats()
        for s in range(world):
            assert counters[s] == 5 and g.barrier_count(s) == 1
            assert [g.imm_count(s, c) for c in range(5)] == [2, 0, 1, 0, 1]
            sizes = _sizes_to(s, rank)
            got = buf[recv_base + s * slot: recv_base + s * slot + sum(sizes)]
            np.testing.assert_array_equal(got, (np.arange(sum(sizes)) + 13 * s + rank) % 251 + 1)
        dist.barrier()   # peers finished waiting on our operations before anyone tears down
    finally:
        g.close()
    return stats


def test_stats_count_bytes_and_commands_per_destination():
    world = 3
    out = spawn(_per_destination_worker, world, timeout=120)
    for rank, st in enumerate(out):
        want_bytes = [sum(_sizes_to(rank, d)) for d in range(world)]
        assert st["bytes_to"] == want_bytes, (rank, st["bytes_to"], want_bytes)
        # per destination: 5 writes, the zero-length OP_WRITE_IMM, one atomic add, one barrier marker
        assert st["commands_to"] == [8] * world, (rank, st["commands_to"])
        assert st["bytes"] == sum(want_bytes)
        assert st["writes"] == 6 * world and st["atomics"] == world
        assert st["commands"] == 8 * world + 1 + 2   # + the NOP and the two flushes, which go nowhere
        assert st["nops"] == 1 and st["rejected"] == 0


def _idle_then_write_worker(rank, world):
    os.environ["FI_PROVIDER"] = "tcp"
    os.environ["FI_TCP_IFACE"] = "lo"
    import time

    import torch.distributed as dist
    dist.init_process_group("gloo")
    buf = np.zeros(8192, np.uint8)
    buf[:4096] = rank + 1
    g = P.ProxyGroup(rank, 2, {0: buf}, transport="fabric", num_threads=1, pin_threads=False, timeout_s=1.0)
    time.sleep(1.5)  # idle for longer than the timeout: nothing is in flight, nothing may time out
    g.push(0, P.make_commands([(P.OP_WRITE, 1 - rank, 0, 0, 4096, 0, 4096)]))
    g.wait_seq(1 - rank, 0, 1, phase="after idle")
    g.check()
    ok = bool((buf[4096:] == 2 - rank).all())
    dist.barrier()
    g.close()
    return ok


def test_first_write_after_an_idle_spell_longer_than_the_timeout():
    """The completion deadline counts from the post when nothing was in flight, not from the last
    completion: a thread idle for longer than UCCL_EP_TIMEOUT_S must not fail its next write at once."""
    res = spawn(_idle_then_write_worker, 2, timeout=90)
    assert res == [True, True]


def test_probe_says_whether_gpu_memory_can_be_registered():
    """`fabric_probe` runs the transport's own provider selection. Asked for GPU memory, it either grants FI_HMEM
    or refuses with a sentence naming the provider and what to install (the system libfabric's tcp here)."""
    from uccl_ep_train import _native as N
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    host = N.fabric_probe("tcp")
    assert host["provider"] == "tcp;ofi_rxm" and not host["hmem"] and host["cq_data_bytes"] in (4, 8)
    try:
        gpu = N.fabric_probe("tcp", hmem=True)
    except RuntimeError as e:
        msg = str(e)
        for part in ("provider 'tcp'", "cannot register GPU memory", "FI_HMEM", "libfabric >= 1.18",
                     "UCCL_EP_TRANSPORT=ipc", f"libfabric {host['library_version']}"):
            assert part in msg, msg
    else:
        assert gpu["hmem"] and gpu["provider"] == "tcp;ofi_rxm"


def test_cq_data_setting_is_checked():
    from uccl_ep_train import _native as N
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    os.environ["UCCL_EP_FABRIC_CQ_DATA_BYTES"] = "6"
    try:
        with pytest.raises(RuntimeError, match="UCCL_EP_FABRIC_CQ_DATA_BYTES=6 must be 4 or 8"):
            N.fabric_probe("tcp")
        os.environ["UCCL_EP_FABRIC_CQ_DATA_BYTES"] = "4"
        assert N.fabric_probe("tcp")["cq_data_bytes"] == 4
    finally:
        del os.environ["UCCL_EP_FABRIC_CQ_DATA_BYTES"]


def test_lazy_module_loading_is_warned_about_once_where_the_proxies_copy_through_cuda(monkeypatch, caplog):
    """Fabric on shm/tcp with GPU memory: a module loaded lazily while EP calls wait for the proxies stalls
    them, so such proxies warn (once per process) unless CUDA_MODULE_LOADING=EAGER."""
    import logging

    from uccl_ep_train import proxy

    monkeypatch.setattr(proxy, "_warned_lazy", False)
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    with caplog.at_level(logging.WARNING, logger="uccl_ep_train"):
        proxy.warn_lazy_module_loading(3)
        assert not caplog.records
        monkeypatch.delenv("CUDA_MODULE_LOADING")
        proxy.warn_lazy_module_loading(3)
        proxy.warn_lazy_module_loading(3)
    assert len(caplog.records) == 1, caplog.records
    assert "rank 3" in caplog.records[0].getMessage() and "CUDA_MODULE_LOADING=EAGER" in caplog.records[0].getMessage()


def test_one_hardware_queue_is_warned_about_once_where_the_proxies_call_the_gpu_runtime(monkeypatch, caplog):
    """With CUDA_DEVICE_MAX_CONNECTIONS=1 a provider's CUDA copies queue behind the EP kernels that wait for
    them (certain with ranks sharing a GPU): such proxies warn once per process, and only under that setting."""
    import logging

    from uccl_ep_train import proxy

    monkeypatch.setattr(proxy, "_warned_single", False)
    with caplog.at_level(logging.WARNING, logger="uccl_ep_train"):
        for value in (None, "8", "32"):
            if value is None:
                monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
            else:
                monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
            proxy.warn_single_connection(2)
        assert not caplog.records
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        proxy.warn_single_connection(2)
        proxy.warn_single_connection(2)
    assert len(caplog.records) == 1, caplog.records
    msg = caplog.records[0].getMessage()
    assert "rank 2" in msg and "CUDA_DEVICE_MAX_CONNECTIONS=1" in msg, msg
