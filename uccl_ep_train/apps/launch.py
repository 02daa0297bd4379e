"""Loopback rendezvous for the ranks our commands spawn themselves (train, bench): never another host."""
from __future__ import annotations

import errno
import random
import socket

_FALLBACK_EPHEMERAL_LOW = 32768  # Linux's default ip_local_port_range starts here
_LOWEST_PORT = 10000  # candidates start here (well above the well-known and registered services we might meet)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now. Preferably below the ephemeral range: between this check and
    rank 0's listen, the OS may hand an ephemeral port to some outgoing connection (EADDRINUSE), never one of
    these. Falls back to a port the OS picks."""
    low = _ephemeral_low()
    candidates = range(_LOWEST_PORT, low)
    for port in random.SystemRandom().sample(candidates, min(32, len(candidates))):
        if _unbound(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unbound(port: int) -> bool:
    """No socket of any address holds `port`: torch's TCPStore listens on the wildcard address, which a
    listener on another address (e.g. [::1]) blocks, so a bind on 127.0.0.1 alone is not enough. A
    dual-stack wildcard bind conflicts with every IPv4 and IPv6 binding of the port (it sends nothing)."""
    for family, addr in ((socket.AF_INET6, ("::", port)), (socket.AF_INET, ("0.0.0.0", port))):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                s.bind(addr)
                return True
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            # no (dual-stack) IPv6 here: the IPv4 wildcard decides
    return False


def loopback_init_method() -> str:
    """A torch.distributed init_method on 127.0.0.1 with a free port."""
    return f"tcp://127.0.0.1:{free_loopback_port()}"


def spawn_ranks(target, world: int, make_args, timeout: float) -> dict:
    """Run `world` spawned processes of target(*make_args(rank, port), q) on one loopback port. Each puts
    (rank, "ok", payload) or (rank, "error", traceback) on q; returns {rank: payload}, or raises naming the
    failed rank (RuntimeError) or the ranks still missing after `timeout` seconds (TimeoutError)."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_loopback_port()
    procs = [ctx.Process(target=target, args=(*make_args(r, port), q)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict = {}
    try:
        for _ in range(world):
            try:
                rank, status, payload = q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"ranks timed out after {timeout} s (finished: {sorted(out)})") from None
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            out[rank] = payload
    finally:
        for p in procs:
            p.join(15)
            if p.is_alive():
                p.kill()
    return out
