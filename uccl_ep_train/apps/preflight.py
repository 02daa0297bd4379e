"""`uccl-ep-train doctor --peers`: the pre-flight check of a multi-node run, through the real proxies.

`doctor` alone says what one machine offers; a first run across nodes fails on what only the ranks together
can show: a GID the peer cannot route to, a provider one node lacks, GPU memory one NIC cannot register, a
link far slower than the others. Each rank here does, in seconds, what an EP call does:

1. registers one region on its GPU (host memory without CUDA) with a `ProxyGroup` on the transport the
   library would choose (or `--transport`), and connects to every peer;
2. writes a pattern to every peer (every other rank, or with `--other-nodes` the ranks of other hosts
   only) with OP_WRITE_IMM, the flag protocol of the kernels, waits for its peers' arrivals
   (`wait_seq`, `--timeout` seconds), and checks every byte (GPU: copied back to host);
3. sends `--mib` MiB to every peer in `--rounds` timed rounds, every proxy thread (hence every NIC) its
   share, and reports the send rate per NIC (payload bytes this rank posted through the NIC's threads,
   divided by the time until they completed locally; the best round);
4. gathers one row per rank to rank 0, which prints one table (rank, host, GPU, NICs, GID, path MTU,
   registration method, transport, GB/s, error) and the first problem met, and exits non-zero on any error.

Every phase ends in a gather of every rank's status, so a rank that failed (or whose ProxyGroup could not
be built) stops every rank at the same point with its error in the table: nothing waits without a deadline.
Ranks come from torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR: one process per GPU; on Slurm, srun
starting torchrun per node) or, for a check of one host, `--ranks N` spawned here on loopback. Commands reach the rings the way the product's do:
from a GPU kernel (`gpu_push_commands`) when the region is on a GPU, from CPU threads otherwise.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

CHUNK = 1 << 20  # bytes of one write: the pattern each rank sends each peer, and the bulk writes' size
PHASES = ("setup", "connect", "pattern", "bulk")  # in order: the first problem is the earliest phase's


@dataclass(frozen=True)
class Options:
    """What one run checks (the command line's options, the same on every rank)."""

    transport: Optional[str] = None   # None: the library's choice (UCCL_EP_TRANSPORT, else by NIC kind)
    other_nodes: bool = False         # peers: the ranks of other hosts only (else every other rank)
    mib: int = 64                     # MiB sent to each peer over the timed rounds
    rounds: int = 4
    timeout_s: float = 5.0            # every wait for peers (arrivals, completions) ends in an error after this

    def validate(self) -> None:
        """ValueError naming the option, before any rank starts."""
        if self.transport is not None and self.transport not in ("fabric", "ipc", "verbs"):
            raise ValueError(f"--transport must be fabric, ipc or verbs, got {self.transport!r}")
        if self.mib < 1:
            raise ValueError(f"--mib must be >= 1 (MiB sent to each peer), got {self.mib}")
        if not 1 <= self.rounds <= 100:
            raise ValueError(f"--rounds must be in 1..100, got {self.rounds}")
        if not 0 < self.timeout_s <= 600:
            raise ValueError(f"--timeout must be in (0, 600] seconds, got {self.timeout_s}")


@dataclass
class Row:
    """One rank's line of the table (also the JSON's rows)."""

    rank: int
    host: str = "-"
    gpu: str = "cpu"                  # "index name" or "cpu"
    transport: str = "-"
    nics: list[str] = field(default_factory=list)       # the NIC each proxy thread's endpoint opened ("-": none, ipc)
    gid: list[str] = field(default_factory=list)        # per NIC (verbs only): "index type address"
    path_mtu: list[str] = field(default_factory=list)   # per NIC (verbs only): the port's active MTU
    registration: str = "-"
    peers: list[int] = field(default_factory=list)
    bytes_verified: int = 0
    gbps: dict[str, float] = field(default_factory=dict)  # per NIC, and "total"
    phase: str = ""                   # the phase that failed ("" : none)
    error: str = ""
    cause: str = ""                   # "own": this rank's problem; "peer": it stopped or waited for a peer's


def peers_of(rank: int, hosts: Sequence[str], other_nodes: bool) -> list[int]:
    """The ranks `rank` writes to and hears from (a symmetric relation): every other rank, or with
    `other_nodes` those on another host."""
    return [r for r in range(len(hosts)) if r != rank and (not other_nodes or hosts[r] != hosts[rank])]


def pattern(src: int, dst: int, n: int) -> np.ndarray:
    """The bytes `src` writes to `dst`: different for every pair and offset, never 0 (the untouched value)."""
    return ((np.arange(n, dtype=np.int64) * 7 + src * 31 + dst * 17) % 251 + 1).astype(np.uint8)


# -- one rank ------------------------------------------------------------------------------------------
class _Stop(Exception):
    """A phase failed on some rank: every rank stops at the same gather."""


class _PeerFailed(Exception):
    """This rank's step failed because of a peer (the message names it): its row's cause is "peer"."""


class _Rank:
    """One rank's state through the phases; every phase ends in `_sync`, the gather that keeps ranks together."""

    def __init__(self, rank: int, world: int, opts: Options):
        self.rank, self.world, self.opts = rank, world, opts
        self.row = Row(rank=rank, host=socket.gethostname())
        self.group: Any = None
        self.region: Any = None
        self.gpu = -1
        self.stream: Any = None   # the GPU push kernel's stream

    def _sync(self, phase: str, error: str, cause: str = "own") -> None:
        """Gathers every rank's error of `phase`; raises _Stop on every rank when any rank failed."""
        import torch.distributed as dist
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, error)
        if error:
            self.row.phase, self.row.error, self.row.cause = phase, error, cause
        failed = [r for r, e in enumerate(everyone) if e]
        if failed:
            if not error:
                self.row.phase, self.row.cause = phase, "peer"
                self.row.error = f"stopped: rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} failed"
            raise _Stop()

    def run(self) -> Row:
        try:
            for name, step in (("setup", self._setup), ("connect", self._connect), ("pattern", self._pattern),
                               ("bulk", self._bulk)):
                self._phase(name, step)
        except _Stop:
            pass
        except BaseException:  # a gather itself failed (a rank died): no teardown that waits for peers
            if self.group is not None:
                self.group.close()
            raise
        self._teardown()
        return self.row

    def _phase(self, name: str, fn: Callable[[], None]) -> None:
        error, cause = "", "own"
        try:
            fn()
        except _Stop:  # a gather inside the phase already stopped every rank
            raise
        except _PeerFailed as exc:
            error, cause = str(exc), "peer"
        except Exception as exc:  # noqa: BLE001 - the rank's error goes into its row, after its peers heard of it
            error = f"{type(exc).__name__}: {exc}"
        self._sync(name, error.replace("\n", " "), cause)

    # -- setup: device, hosts, peers, region ------------------------------------------------------
    def _setup(self) -> None:
        import torch
        import torch.distributed as dist
        from uccl_ep_train import proxy as P

        hosts: list = [None] * self.world
        dist.all_gather_object(hosts, self.row.host)
        self.row.peers = peers_of(self.rank, hosts, self.opts.other_nodes)
        if not self.row.peers:
            raise ValueError("no peer to check: every rank is on this host and --other-nodes asks for ranks of "
                             "other hosts only; drop --other-nodes" if self.opts.other_nodes else
                             "no peer to check: run 2 ranks or more (--ranks N, or torchrun)")
        if not P.available():
            raise RuntimeError("the native module uccl_ep_train._native is not built (pip install ., or "
                               "`python setup.py build_ext --inplace`)")
        most = max(len(peers_of(r, hosts, self.opts.other_nodes)) for r in range(self.world))
        nbytes = 2 * most * CHUNK   # [send: one slot per peer | receive: one slot per peer], the same on every rank
        if torch.cuda.is_available():
            from uccl_ep_train import _native
            if not hasattr(_native, "gpu_push_commands"):
                raise RuntimeError("this rank sees a GPU but the native module was built without GPU support "
                                   "(UCCL_EP_GPU=none?): rebuild it with CUDA or HIP")
            self.gpu = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
            torch.cuda.set_device(self.gpu)
            self.row.gpu = f"{self.gpu} {torch.cuda.get_device_name(self.gpu)}"
            self.stream = torch.cuda.Stream(self.gpu)
            self.region = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{self.gpu}")
            for i, d in enumerate(self.row.peers):
                self.region[i * CHUNK:(i + 1) * CHUNK] = torch.from_numpy(pattern(self.rank, d, CHUNK)).cuda()
            torch.cuda.synchronize()
        else:
            self.region = np.zeros(nbytes, np.uint8)
            for i, d in enumerate(self.row.peers):
                self.region[i * CHUNK:(i + 1) * CHUNK] = pattern(self.rank, d, CHUNK)
        self.recv_base = most * CHUNK
        self.hosts = hosts

    # -- connect: the ProxyGroup (its bootstrap gathers every rank's error itself) -----------------
    def _connect(self) -> None:
        from uccl_ep_train import proxy as P

        try:
            self.group = P.ProxyGroup(self.rank, self.world, {0: self.region}, transport=self.opts.transport,
                                      gpu=self.gpu, timeout_s=self.opts.timeout_s)
        except RuntimeError as exc:
            # The bootstrap raises the same gathered error ("... failed on rank 1: ...") on every rank: on the
            # ranks it does not name, it is a peer's problem, and the table's first problem is that peer's.
            if str(exc).startswith("ProxyGroup:") and not re.search(rf"\brank {self.rank}:", str(exc)):
                raise _PeerFailed(f"stopped: {exc}") from None
            raise
        g = self.group
        # What the endpoints opened (fabric: the provider and domain of its fi_info; verbs: the device), not what
        # UCCL_EP_NICS asked for.
        opened = g.config()["opened"]  # (one native read for all three)
        providers = P.providers_of(opened)
        self.row.transport = P.described(g.transport, providers)
        self.row.nics = [o["device"] or "-" for o in opened]
        if g.transport == "verbs":
            for nic in _distinct(self.row.nics):
                gid, mtu = verbs_port(nic)
                self.row.gid.append(gid)
                self.row.path_mtu.append(mtu)
        self.row.registration = registration_method(g.transport, self.gpu >= 0, providers, g.calls_gpu_runtime)

    # -- pattern: one signalled write to every peer, every byte checked ----------------------------
    def _pattern(self) -> None:
        from uccl_ep_train import proxy as P

        rows = [(P.OP_WRITE_IMM, d, 0, 0, CHUNK, i * CHUNK, self.recv_base + self._slot_at(d) * CHUNK)
                for i, d in enumerate(self.row.peers)]
        self._push(self._commands({0: rows}))
        for s in self.row.peers:
            self._wait_from(s, 0, 1, "pattern")
        self.group.check()
        got = self._received()
        for i, s in enumerate(self.row.peers):
            part = got[i * CHUNK:(i + 1) * CHUNK]
            want = pattern(s, self.rank, CHUNK)
            bad = np.flatnonzero(part != want)
            if bad.size:
                raise RuntimeError(f"the pattern from rank {s} ({self.hosts[s]}) arrived with {bad.size} of {CHUNK} "
                                   f"bytes wrong (first at byte {int(bad[0])}: {int(part[bad[0]])}, expected "
                                   f"{int(want[bad[0]])}): the NIC or its registration corrupts data")
        rest = got[len(self.row.peers) * CHUNK:]
        if rest.any():
            raise RuntimeError(f"{int(np.count_nonzero(rest))} bytes beyond the peers' slots were written")
        self.row.bytes_verified = len(self.row.peers) * CHUNK

    def _wait_from(self, src: int, channel: int, target: int, what: str) -> None:
        """Waits for `src`'s writes; a timeout is blamed on `src` (its own row says what went wrong there),
        after this rank's own proxies were checked."""
        try:
            self.group.wait_seq(src, channel, target, timeout_s=self.opts.timeout_s, phase=f"doctor --peers {what}")
        except RuntimeError as exc:
            self.group.check()
            raise _PeerFailed(f"waited for rank {src} ({self.hosts[src]}): {exc}") from None

    def _slot_at(self, dst: int) -> int:
        """Where this rank's writes land at `dst`: its index among dst's peers."""
        return peers_of(dst, self.hosts, self.opts.other_nodes).index(self.rank)

    def _received(self) -> np.ndarray:
        if isinstance(self.region, np.ndarray):
            return self.region[self.recv_base:].copy()
        import torch
        torch.cuda.synchronize(self.gpu)
        return self.region[self.recv_base:].cpu().numpy()

    # -- bulk: timed rounds, every thread its share --------------------------------------------------
    def _bulk(self) -> None:
        from uccl_ep_train import proxy as P

        g, threads = self.group, self.group.num_threads
        per_thread = max(1, math.ceil(self.opts.mib * (1 << 20) / self.opts.rounds / threads / CHUNK))
        seq = {t: (1 if t == 0 else 0) for t in range(threads)}   # arrivals per (peer, channel) so far
        flushed = {t: g.flushed(t) for t in range(threads)}
        rows = {t: [(P.OP_WRITE, d, t, 0, CHUNK, i * CHUNK, self.recv_base + self._slot_at(d) * CHUNK)
                    for i, d in enumerate(self.row.peers) for _ in range(per_thread)]
                + [(P.OP_FLUSH, 0, t, 0, 0, 0, 0)] for t in range(threads)}
        commands = self._commands(rows)   # the same every round
        best: dict[str, float] = {}
        for _ in range(self.opts.rounds):
            # every rank sends at once (the rate a dispatch meets); a rank that failed the round before
            # meets the others here with its phase-end gather, so every rank does one gather per round
            self._sync("bulk", "")
            start = time.monotonic()
            self._push(commands)
            done = self._wait_flushed({t: flushed[t] + 1 for t in range(threads)}, start)
            for t in range(threads):
                flushed[t] += 1
                seq[t] += per_thread
            for s in self.row.peers:
                for t in range(threads):
                    self._wait_from(s, t, seq[t], "bulk")
            g.check()
            sent = len(self.row.peers) * per_thread * CHUNK
            rate = {nic: sent * sum(n == nic for n in self.row.nics) /
                    max(done[t] for t in range(threads) if self.row.nics[t] == nic) / 1e9
                    for nic in _distinct(self.row.nics)}
            rate["total"] = sent * threads / max(done.values()) / 1e9
            best = {k: max(v, best.get(k, 0.0)) for k, v in rate.items()}
        self.row.gbps = {k: round(v, 3) for k, v in best.items()}

    def _wait_flushed(self, targets: dict[int, int], start: float) -> dict[int, float]:
        """Seconds from `start` until each ring's flush ran (every write before it completed), polled."""
        done: dict[int, float] = {}
        deadline = start + self.opts.timeout_s
        while len(done) < len(targets):
            for t, want in targets.items():
                if t not in done and self.group.flushed(t) >= want:
                    done[t] = max(time.monotonic() - start, 1e-9)
            self.group.check()
            if len(done) < len(targets):
                if time.monotonic() > deadline:
                    late = sorted(set(targets) - set(done))
                    # a peer that stopped receiving or this rank's NIC: the peers' rows tell which
                    raise _PeerFailed(f"proxy threads {late} ({', '.join(self.row.nics[t] for t in late)}) did not "
                                      f"complete their writes to the peers within {self.opts.timeout_s} s (--timeout)")
                time.sleep(0.0002)
        return done

    def _commands(self, rows: dict[int, list[tuple]]) -> Any:
        """Each ring's rows as commands, ready for `_push` (built before any clock starts): one array in GPU
        memory with each ring's offsets when the rank has a GPU, else one array per ring."""
        from uccl_ep_train import proxy as P

        if self.gpu < 0:
            return {t: P.make_commands(r) for t, r in rows.items() if r}
        import torch
        flat, offsets = [], [0]
        for t in range(self.group.num_threads):
            flat += rows.get(t, [])
            offsets.append(len(flat))
        cmds = torch.from_numpy(P.make_commands(flat).view(np.uint8).copy()).cuda(self.gpu)
        torch.cuda.synchronize(self.gpu)  # in GPU memory before the push kernel's stream reads them
        return cmds, offsets

    def _push(self, commands: Any) -> None:
        """Commands into the rings the way the product's producers do: a GPU kernel when the rank has a GPU,
        else one CPU thread per ring (rings drain concurrently, each in order)."""
        g = self.group
        if self.gpu >= 0:
            from uccl_ep_train import _native
            cmds, offsets = commands
            # A stream of its own, not the legacy default one: a provider that copies GPU memory on the default
            # stream (libfabric's shm) must not wait behind this kernel while it waits for ring slots.
            _native.gpu_push_commands(g._native, cmds.data_ptr(), offsets, 1, self.stream.cuda_stream)
            return
        errors: list[BaseException] = []

        def produce(t: int, arr: np.ndarray) -> None:
            try:
                g.push(t, arr)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the rank's thread below
                errors.append(exc)

        workers = [threading.Thread(target=produce, args=(t, arr), daemon=True) for t, arr in commands.items()]
        for w in workers:
            w.start()
        for w in workers:
            w.join(self.opts.timeout_s + 5)
        if any(w.is_alive() for w in workers):
            raise TimeoutError(f"pushing commands into the rings took longer than {self.opts.timeout_s} s: the proxy "
                               "threads are not draining them")
        if errors:
            raise errors[0]

    def _teardown(self) -> None:
        """Every rank (with proxies or not) done with its peers' writes before any endpoint goes away."""
        import torch.distributed as dist
        try:
            dist.barrier()
        finally:
            if self.group is not None:
                self.group.close()


def _distinct(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def verbs_port(device: str) -> tuple[str, str]:
    """(GID, path MTU) the verbs transport uses on `device`: its first ACTIVE port (as csrc/transport/verbs.cpp
    picks it), the GID the transport's own rule chooses there (UCCL_IB_GID_INDEX, else RoCE v2 IPv4-mapped,
    ...; InfiniBand: 0) and the port's active MTU; "-" for what the query cannot tell."""
    from uccl_ep_train import _native

    dev = next((d for d in _native.verbs_devices() if d["name"] == device), None)
    port = next((p for p in (dev or {}).get("ports", []) if p["state"] == "PORT_ACTIVE"), None)
    if port is None:
        return "-", "-"
    table = []
    for entry in port["gids"]:  # "index:type:address"
        index, kind, address = entry.split(":", 2)
        table.append((int(index), bytes.fromhex(address.replace(":", "")), kind))
    try:
        override = _native.verbs_settings(dict(os.environ))["UCCL_IB_GID_INDEX"]
        index, _ = _native.verbs_choose_gid(table, port["link_layer"] == "Ethernet", override,
                                            f"{device} port {port['port']}")
    except ValueError as exc:
        return f"none ({exc})", str(port["active_mtu"])
    chosen = next((e for e in port["gids"] if e.split(":", 1)[0] == str(index)), f"{index}:?:?")
    return chosen.replace(":", " ", 2), str(port["active_mtu"])


def registration_method(transport: str, gpu: bool, provider: str, calls_gpu_runtime: bool = False) -> str:
    """How the transport registered the region, as far as it says: verbs tries peer memory then DMA-BUF for
    GPU memory (which one took is on stderr, not exposed), fabric registers GPU memory through FI_HMEM, with
    `provider` the one its endpoints opened, and says whether that provider moves it by DMA alone or copies
    it through the CUDA runtime in the proxy threads (`ProxyGroup.calls_gpu_runtime`: efa without GPUDirect
    RDMA, shm, tcp), which can stall behind the EP kernels (docs/proxy.md)."""
    if transport == "ipc":
        return "ipc: CUDA/HIP IPC handle" if gpu else "ipc: host memory"
    if transport == "fabric":
        if not gpu:
            return f"host ({provider or 'libfabric default'})"
        how = "CUDA-runtime copies" if calls_gpu_runtime else "DMA only"
        return f"GPU via FI_HMEM ({provider or 'libfabric default'}; {how})"
    if not gpu:
        return "host (ibv_reg_mr)"
    from uccl_ep_train.apps.doctor import local_gpu_memory_registration

    methods = local_gpu_memory_registration()["methods"]
    return "GPU: " + (" or ".join(methods) if methods else "-")


def check_rank(rank: int, world: int, opts: Options) -> dict:
    """One rank of the check (a `launch.run` rank function): its process group (gloo, bounded by the
    timeout), then the phases; returns its row as a dict. Every rank must call it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=60 + 6 * opts.timeout_s))
    return asdict(_Rank(rank, world, opts).run())


# -- the report ----------------------------------------------------------------------------------------
COLUMNS = ("rank", "host", "GPU", "NIC", "GID", "path MTU", "registration", "transport", "GB/s", "error")


def _cells(r: dict) -> tuple[str, ...]:
    join = lambda xs: ", ".join(xs) or "-"  # noqa: E731
    nics = _distinct(r["nics"])
    if r["gbps"]:
        per = [f"{r['gbps'][n]:.2f}" for n in nics if n in r["gbps"]]
        gbps = per[0] if len(per) == 1 else f"{r['gbps']['total']:.2f} ({', '.join(per)})"
    else:
        gbps = "-"
    return (str(r["rank"]), r["host"], r["gpu"], join(nics), join(r["gid"]), join(r["path_mtu"]),
            r["registration"], r["transport"], gbps, r["error"] or "ok")


def first_problem(rows: Sequence[dict]) -> Optional[str]:
    """The earliest phase's error of the lowest rank that failed there on its own, else of one that stopped
    or waited for a peer (a rank whose NIC cannot receive shows only as its own wait)."""
    failed = [r for r in rows if r["error"] and r["cause"] == "own"] or [r for r in rows if r["error"]]
    if not failed:
        return None
    r = min(failed, key=lambda x: (PHASES.index(x["phase"]), x["rank"]))
    return f"rank {r['rank']} ({r['host']}), {r['phase']}: {r['error']}"


def render(rows: Sequence[dict], opts: Options) -> str:
    cells = [COLUMNS] + [_cells(r) for r in rows]
    width = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS) - 1)]
    lines = [f"uccl-ep-train doctor --peers: {len(rows)} ranks, peers: "
             + ("the ranks of other hosts" if opts.other_nodes else "every other rank")
             + f"; {opts.mib} MiB to each peer in {opts.rounds} rounds (GB/s: this rank's send rate, best round; "
             "several NICs: total (per NIC))", ""]
    for c in cells:
        lines.append("  ".join(x.ljust(w) for x, w in zip(c, width)) + "  " + c[-1])
    problem = first_problem(rows)
    lines += ["", f"FIRST PROBLEM: {problem}" if problem else
              f"ok: every byte checked ({sum(r['bytes_verified'] for r in rows)} bytes), every rank sent"]
    return "\n".join(lines)


def exit_code(rows: Sequence[dict]) -> int:
    return 1 if any(r["error"] for r in rows) else 0


def run_check(opts: Options, ranks: Optional[int]) -> Optional[list[dict]]:
    """Every rank's row (rank 0, or the spawning process), None on the other launched ranks. Launched
    (RANK / WORLD_SIZE set): this process is one rank; else `ranks` processes on loopback."""
    from uccl_ep_train.apps.launch import launched_world, run

    world = launched_world()
    if world is None:
        if not ranks:
            raise ValueError("doctor --peers: not launched by torchrun (RANK, WORLD_SIZE unset): give "
                             "--ranks N to check N ranks on this host")
        if ranks < 2:
            raise ValueError(f"--ranks must be >= 2 (a rank needs a peer), got {ranks}")
        env = {"GLOO_SOCKET_IFNAME": "lo", "FI_TCP_IFACE": "lo", "FI_SOCKETS_IFACE": "lo",
               "CUDA_MODULE_LOADING": "EAGER"}   # ranks sharing a GPU load modules eagerly (gpu_sharing.py)
        env = {k: os.environ.get(k, v) for k, v in env.items()}
        return run(check_rank, ranks, opts, env=env, timeout=120 + 12 * opts.timeout_s)
    if ranks is not None and ranks != world:
        raise ValueError(f"--ranks {ranks} given, but the launcher started {world} ranks (WORLD_SIZE); drop --ranks")
    return run(check_rank, world, opts, timeout=None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `doctor --peers` (doctor.py parses them with its own)."""
    d = Options()
    p.add_argument("--ranks", type=int, default=None,
                   help="without torchrun: spawn this many ranks on this host (loopback)")
    p.add_argument("--transport", choices=("fabric", "ipc", "verbs"), default=None,
                   help="default: the library's choice (UCCL_EP_TRANSPORT, else by NIC kind)")
    p.add_argument("--other-nodes", action="store_true",
                   help="write only to the ranks of other hosts (default: every other rank)")
    p.add_argument("--mib", type=int, default=d.mib, help=f"MiB sent to each peer, timed (default {d.mib})")
    p.add_argument("--rounds", type=int, default=d.rounds, help=f"timed rounds (default {d.rounds})")
    p.add_argument("--timeout", type=float, default=d.timeout_s,
                   help=f"seconds any wait for peers may take (default {d.timeout_s})")


def defaults(p: argparse.ArgumentParser) -> dict[str, Any]:
    """{dest: default} of the options `add_arguments` added to `p` (doctor refuses them without --peers)."""
    return {k: p.get_default(k) for k in ("ranks", "transport", "other_nodes", "mib", "rounds", "timeout")}


def main(args: argparse.Namespace) -> int:
    """`doctor --peers` with doctor's parsed arguments: prints the table on rank 0, writes --json there."""
    opts = Options(transport=args.transport, other_nodes=args.other_nodes, mib=args.mib, rounds=args.rounds,
                   timeout_s=args.timeout)
    try:
        opts.validate()
        rows = run_check(opts, args.ranks)
    except ValueError as exc:
        print(f"uccl-ep-train doctor --peers: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as exc:  # a spawned rank died or hung past every deadline: no table
        print(f"uccl-ep-train doctor --peers: a rank did not report: {exc}", file=sys.stderr)
        return 1
    if rows is None:  # a launched rank other than 0: rank 0 reports
        return 0
    print(render(rows, opts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"options": asdict(opts), "rows": rows}, f, indent=1)
    return exit_code(rows)
