"""The one way our commands (train, bench) and the tests start ranks: torchrun's environment, on loopback.

A rank function `fn(rank, world, *args)` initialises its process group from the environment
(`dist.init_process_group(backend)`: init_method env://) and returns what the caller collects; it leaves the
group up, and the launcher tears it down. Where its process comes from does not change it:

- under torchrun or Slurm (RANK and WORLD_SIZE already in the environment, `launched_world`), `run` calls
  fn in this process, as that one rank, and gathers the results on rank 0;
- otherwise `run` (or `spawn`) starts `world` processes (torch.multiprocessing's spawn context) with the
  environment torchrun would give them: MASTER_ADDR=127.0.0.1, MASTER_PORT (a free loopback port), RANK,
  WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, plus the caller's extra variables. Nothing listens anywhere but
  127.0.0.1. The first failing rank's traceback comes back naming the rank (with any other rank's that fails
  within a few seconds: the first to report is not always the cause), a run past its timeout names the ranks
  still missing, and no child outlives the call.
"""
from __future__ import annotations

import errno
import os
import pickle
import queue
import random
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Mapping, Optional

from uccl_ep_train.topology import MAX_RANKS_PER_NODE

_FALLBACK_EPHEMERAL_LOW = 32768  # Linux's default ip_local_port_range starts here
_LOWEST_PORT = 10000  # candidates start here (well above the well-known and registered services we might meet)
_MORE_ERRORS_S = 5.0  # after a rank fails, how long the others may take to report theirs (often the cause)
_TEARDOWN_S = 30.0  # after every rank reported, how long they may take to leave before they are killed
_HANDED_S = 120.0  # a port free_loopback_port handed out is not handed out again for this long
_handed: dict[int, float] = {}  # port -> when it was handed out (time.monotonic)
_handed_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now. Preferably below the ephemeral range: between this check and
    rank 0's listen, the OS may hand an ephemeral port to some outgoing connection (EADDRINUSE), never one of
    these; nor does this process hand it out again meanwhile (threads spawning groups at once: the GPU fuzz
    suite's seeds on several GPUs). Falls back to a port the OS picks."""
    low = _ephemeral_low()
    candidates = range(_LOWEST_PORT, low)
    with _handed_lock:
        now = time.monotonic()
        for port in [p for p, t in _handed.items() if now - t >= _HANDED_S]:
            del _handed[port]
        for port in random.SystemRandom().sample(candidates, min(32, len(candidates))):
            if port not in _handed and _unbound(port):
                _handed[port] = now
                return port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            _handed[s.getsockname()[1]] = now
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


def check_ranks_per_node(ranks_per_node: Optional[int], world: int) -> None:
    """--ranks-per-node (ranks of one emulated node, every command that takes it) must be 1..MAX_RANKS_PER_NODE
    and divide the number of ranks (SystemExit otherwise)."""
    if ranks_per_node is None:
        return
    if not 1 <= ranks_per_node <= MAX_RANKS_PER_NODE or world % ranks_per_node:
        raise SystemExit(f"--ranks-per-node must be in 1..{MAX_RANKS_PER_NODE} and divide the number of ranks "
                         f"({world}), got {ranks_per_node}")


def launched_world() -> Optional[int]:
    """WORLD_SIZE when a launcher (torchrun, Slurm through slurm/launch.sh) started this process as one rank
    (RANK and WORLD_SIZE set); None when this process is to spawn its ranks itself."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def torchrun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun gives rank `rank` of `world` ranks on one host, rendezvous on 127.0.0.1:`port`."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}


def run(fn: Callable[..., Any], world: int, *args: Any, env: Optional[Mapping[str, str]] = None,
        timeout: Optional[float]) -> Optional[list[Any]]:
    """fn(rank, world, *args) on every rank: fn's results in rank order, or None on a launched rank other
    than 0 (its caller has nothing left to do). Launched (`launched_world`): this process is one rank; `env`
    is set in it, `world` must be the launcher's WORLD_SIZE, and the results are gathered over fn's process
    group. Otherwise `spawn`. `timeout` (seconds, None: no bound) applies to spawned ranks; launched ranks
    are bounded by their launcher and their group's timeout."""
    launched = launched_world()
    if launched is None:
        return spawn(fn, world, *args, env=env, timeout=timeout)
    if world != launched:
        raise ValueError(f"{world} ranks asked for, but the launcher started {launched} (WORLD_SIZE)")
    import torch.distributed as dist

    os.environ.update(env or {})
    rank = int(os.environ["RANK"])
    result = fn(rank, world, *args)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    dist.destroy_process_group()
    return gathered if rank == 0 else None


def spawn(fn: Callable[..., Any], world: int, *args: Any, env: Optional[Mapping[str, str]] = None,
          timeout: Optional[float], exit_at_once: bool = False) -> list[Any]:
    """Start `world` processes, each running fn(rank, world, *args) with `torchrun_env` and `env` set;
    returns fn's results in rank order. Raises RuntimeError naming the ranks that failed (their tracebacks)
    or exited without a result (their exit codes), TimeoutError naming the ranks still missing after
    `timeout` seconds (None: no bound). Every rank is gone when it returns or raises (the fork server the
    ranks come from stays, one per process, until this process ends).
    exit_at_once: a rank leaves right after reporting, without tearing its process group down (for groups
    broken on purpose, whose teardown could wait for a peer that is gone)."""
    if world < 1:
        raise ValueError(f"spawn: world must be >= 1, got {world}")
    import torch.multiprocessing as mp

    # Each rank forks from a server process that imported torch once, instead of being a fresh interpreter
    # that imports it again (~5 s of CPU per rank on a 2-core host); the server never touches CUDA, so a rank
    # starts its own context as a spawned one does. A rank imports the program's main module as spawn's do
    # (functions defined there resolve); the server imports it once beforehand, so the ranks find it there.
    # A rank gets this process's whole environment and stdout / stderr as they are now (_rank_process,
    # _LauncherStdio), not the server's.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "torch", "torch.distributed"])
    q = ctx.Queue()
    port = free_loopback_port()
    procs = []
    try:
        for rank in range(world):
            rank_env = {**os.environ, **torchrun_env(rank, world, port), **(env or {})}
            procs.append(ctx.Process(target=_rank_process, name=f"rank {rank}",
                                     args=(fn, rank, world, args, rank_env, q, exit_at_once, _LauncherStdio())))
            procs[-1].start()
        results = _collect(q, procs, timeout)
    except BaseException:
        _stop(procs, 0.0)
        raise
    _stop(procs, _TEARDOWN_S)
    return [results[rank] for rank in range(world)]


class _LauncherStdio:
    """Pickled into a rank's arguments: the launching process's stdout and stderr (descriptors 1 and 2) as
    they are when the rank starts, which the rank takes over while it is unpickled (_adopt_stdio). A rank
    forked from the fork server would otherwise write where the server's pointed when it started, and a
    caller may have redirected its own since (pytest's capture does, per test)."""

    def __reduce__(self):
        from multiprocessing import reduction

        return _adopt_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _adopt_stdio(out: Any, err: Any) -> None:
    """In the rank, while its arguments are unpickled: descriptors 1 and 2 become the launcher's."""
    for wrapper, target in ((out, 1), (err, 2)):
        fd = wrapper.detach()
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)


def _rank_process(fn: Callable[..., Any], rank: int, world: int, args: tuple, env: dict[str, str], q: Any,
                  exit_at_once: bool, stdio: None) -> None:
    """A spawned rank: its environment replaced by `env` (the launching process's, as spawn() saw it, and the
    rank's own), fn's result (pickled here, so that an unpicklable one is this rank's error and not a silent
    loss in the queue's feeder thread) or its traceback onto q, then the group's teardown. (stdio: what
    _LauncherStdio leaves once it redirected descriptors 1 and 2.)"""
    os.environ.clear()
    os.environ.update(env)
    try:
        report = (rank, "ok", pickle.dumps(fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 (every failure is reported, assertion errors and exits included)
        _report(q, (rank, "error", traceback.format_exc()))
        os._exit(1)  # a peer may be gone: no teardown that could wait for it
    _report(q, report)
    if exit_at_once:
        os._exit(0)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _report(q: Any, item: tuple) -> None:
    """Put `item` and wait until it is in the pipe (a rank may leave with os._exit right after)."""
    q.put(item)
    q.close()
    q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()


def _collect(q: Any, procs: list, timeout: Optional[float]) -> dict[int, Any]:
    """Every rank's result, or the error naming the ranks that failed, died or are missing."""
    world = len(procs)
    deadline = None if timeout is None else time.monotonic() + timeout
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    first_failure: Optional[float] = None  # when the first error came
    while len(results) + len(errors) < world:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            if errors:
                break
            missing = sorted(set(range(world)) - set(results))
            raise TimeoutError(f"ranks {missing} of {world} did not finish within {timeout} s "
                               f"(finished: {sorted(results)})")
        try:
            rank, status, payload = q.get(timeout=1.0 if left is None else min(1.0, left))
        except queue.Empty:
            gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results and r not in errors]
            if not gone:
                continue
            try:  # a rank's report is in the pipe before it exits: read now, it is there if it was made
                rank, status, payload = q.get(timeout=1.0)
            except queue.Empty:
                errors.update({r: f"exited with code {procs[r].exitcode} without a result\n" for r in gone})
                first_failure = first_failure or time.monotonic()
                continue
        if status == "ok":
            results[rank] = pickle.loads(payload)
            continue
        if not errors:  # the others' errors for a few seconds more (often the cause), then out
            first_failure = time.monotonic()
            more = first_failure + _MORE_ERRORS_S
            deadline = more if deadline is None else min(deadline, more)
        errors[rank] = payload
    if errors:
        silent = sorted(set(range(world)) - set(results) - set(errors))
        waited = time.monotonic() - first_failure  # (the overall timeout may have ended the wait sooner)
        late = (f"ranks {silent} had not reported {waited:.0f} s after the first failure (their errors, "
                "if any, are not shown)\n") if silent else ""
        raise RuntimeError(f"ranks {sorted(errors)} of {world} failed:\n{late}" +
                           "".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors)))
    return results


def _stop(procs: list, grace: float) -> None:
    """Wait up to `grace` seconds for the processes to leave, then kill the ones still there."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
