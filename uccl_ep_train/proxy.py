"""CPU proxies for the GPU→CPU command channel (Python side of csrc/proxy and csrc/transport).

A `ProxyGroup` is one rank's set of proxy threads: each owns a ring buffer in pinned host memory that GPU
warps (or CPU threads in tests) push 16-byte commands into, and one transport endpoint (`fabric`, `ipc`
or `verbs`) that carries the writes and atomics to peer ranks. Peers exchange endpoint addresses and
memory keys over torch.distributed at construction; `close()` joins the threads and deregisters memory.

    group = ProxyGroup(rank, world, regions={0: tensor}, group=pg)          # bootstrap + start
    group.push(ring, make_commands([...]))                                  # CPU producer (tests)
    group.wait_seq(src, channel, n, phase="dispatch")                       # in-order arrivals from src
    group.close()

Command fields (`COMMAND_DTYPE`, 16 bytes): op, dst, channel, region, length, local_off, remote_off.
Opcodes: OP_WRITE, OP_WRITE_IMM (also bumps the receiver's imm_count), OP_ATOMIC_ADD (length is the signed
addend, remote_off an 8-byte aligned int64 in a host region), OP_FLUSH, OP_BARRIER, OP_NOP. Channel c is
served by ring c % num_threads. Knobs: UCCL_EP_PROXY_THREADS, UCCL_EP_DISABLE_CPU_AFFINITY,
UCCL_IB_MAX_INFLIGHT_{BYTES,NORMAL,LOW_LATENCY}, UCCL_RDMA_ADAPTIVE_SLEEP, UCCL_EP_TIMEOUT_S, UCCL_EP_FAULT,
UCCL_EP_TRANSPORT (fabric | ipc | verbs; default by NIC kind, `choose_transport`), UCCL_EP_NICS (each GPU's
NICs; default by PCI topology, uccl_ep_train/nics.py), FI_PROVIDER (tcp | shm | sockets | efa).
"""
from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np

from .config import nic_flow_control
from .nics import EFA_KIND, RC_KINDS, NicChoice, choose_nics, gpu_bus_id, local_rank

log = logging.getLogger("uccl_ep_train")

try:
    from . import _native  # type: ignore[attr-defined]
except ImportError:  # pure-Python install: no proxies
    _native = None

COMMAND_DTYPE = np.dtype([("op", "u1"), ("dst", "u1"), ("channel", "u1"), ("region", "u1"),
                          ("length", "<u4"), ("local_off", "<u4"), ("remote_off", "<u4")])
assert COMMAND_DTYPE.itemsize == 16

OP_WRITE, OP_WRITE_IMM, OP_ATOMIC_ADD, OP_FLUSH, OP_BARRIER, OP_NOP = 1, 2, 3, 4, 5, 6
MAX_CHANNELS = 64


def available() -> bool:
    """True when the native module with proxies is importable."""
    return _native is not None and hasattr(_native, "Proxy")


def compiled_transports() -> list[str]:
    return list(_native.compiled_transports()) if available() else []


def make_commands(rows: Iterable[tuple]) -> np.ndarray:
    """Packs (op, dst, channel, region, length, local_off, remote_off) tuples into a command array.

    `length` may be negative for OP_ATOMIC_ADD (it is the signed addend)."""
    rows = [tuple(r) for r in rows]
    out = np.zeros(len(rows), dtype=COMMAND_DTYPE)
    for i, r in enumerate(rows):
        if len(r) != 7:
            raise ValueError(f"make_commands: row {i} has {len(r)} fields, expected 7 "
                             "(op, dst, channel, region, length, local_off, remote_off)")
        op, dst, ch, region, length, loff, roff = r
        out[i] = (op, dst, ch, region, int(length) & 0xFFFFFFFF, loff, roff)
    return out


def _region_of(obj: Any) -> tuple[int, int, bool]:
    """(ptr, nbytes, is_device) of a torch tensor, numpy array or (ptr, nbytes[, device]) tuple."""
    if isinstance(obj, tuple):
        ptr, nbytes = int(obj[0]), int(obj[1])
        return ptr, nbytes, bool(obj[2]) if len(obj) > 2 else False
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError("regions: numpy arrays must be C-contiguous")
        return obj.ctypes.data, obj.nbytes, False
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None
    if torch is not None and isinstance(obj, torch.Tensor):
        if not obj.is_contiguous():
            raise ValueError("regions: tensors must be contiguous")
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj.is_cuda
    raise TypeError(f"regions: expected a tensor, numpy array or (ptr, nbytes[, device]) tuple, got {type(obj).__name__}")


@dataclass(frozen=True)
class TransportChoice:
    """The transport a rank runs, the fabric provider it asks for, the NICs its threads open, and why."""

    transport: str                    # fabric | ipc | verbs
    provider: Optional[str]           # fabric provider; None: FI_PROVIDER, else libfabric's choice
    devices: tuple[str, ...]          # verbs device names or libfabric domain names; () : the default
    reason: str


_TRANSPORTS = ("fabric", "ipc", "verbs")
_BUILD_HINT = {"verbs": "rebuild with rdma-core's headers (infiniband/verbs.h)",
               "fabric": "rebuild with libfabric's headers (rdma/fabric.h)",
               "ipc": "rebuild with CUDA or HIP"}


def choose_transport(nics: NicChoice, compiled: list[str], same_host: bool, gpu: int,
                     requested: Optional[str] = None, provider: Optional[str] = None) -> TransportChoice:
    """One rank's transport from what its NICs are (docs/proxy.md, "How the transport is chosen").

    `requested`: the caller's or UCCL_EP_TRANSPORT's transport (None: automatic); `provider`: the caller's
    or FI_PROVIDER's fabric provider. Automatic: GPUs whose ranks all share one host -> ipc; EFA -> fabric
    (efa provider); RC NICs (mlx5, bnxt_re, ionic, irdma) -> verbs; no RDMA NIC -> fabric over tcp.
    Raises ValueError, naming what was found and what to set, for a choice that cannot work; `nics.error` (a
    bad UCCL_EP_NICS) only where NICs are opened (verbs, fabric): ipc opens none."""
    kind = nics.kind or "none"
    found = f"this rank's NICs: {', '.join(nics.devices) or 'none'} ({kind}; {nics.reason})"
    if requested:
        if requested not in _TRANSPORTS:
            raise ValueError(f"UCCL_EP_TRANSPORT / transport= must be one of {', '.join(_TRANSPORTS)}, got "
                             f"{requested!r}")
        transport, why = requested, "requested (UCCL_EP_TRANSPORT or transport=)"
    elif gpu >= 0 and same_host and "ipc" in compiled:
        transport, why = "ipc", "every rank on one host, with GPUs"
    elif nics.kind == EFA_KIND:
        transport, why = "fabric", "EFA NICs (SRD, no RC queue pairs): libfabric's efa provider"
    elif nics.devices:
        known = nics.kind in RC_KINDS
        transport, why = "verbs", (f"{nics.kind} NICs: RC verbs" if known else
                                   f"{nics.kind} NICs (kind unknown here, assumed RC): verbs; set "
                                   "UCCL_EP_TRANSPORT=fabric if they have no RC queue pairs")
    else:
        transport, why = "fabric", "no RDMA NIC: libfabric over tcp"
    if nics.error and transport != "ipc":
        raise ValueError(nics.error)
    if transport not in compiled:
        raise ValueError(f"transport {transport} ({why}) is not compiled in (native module's transports: "
                         f"{', '.join(compiled) or 'none'}; {found}): {_BUILD_HINT[transport]}, or set "
                         "UCCL_EP_TRANSPORT to a compiled one")
    if transport == "verbs" and nics.kind == EFA_KIND:
        raise ValueError(f"transport verbs cannot run on EFA devices ({found}): EFA offers no RC queue pairs or "
                         "SRQ; unset UCCL_EP_TRANSPORT (or set it to fabric): fabric with the efa provider")
    if transport == "verbs" and not nics.devices:
        raise ValueError(f"transport verbs found no RDMA devices with an ACTIVE port (host: "
                         f"{', '.join(nics.found) or 'none'}; {found}); set UCCL_EP_TRANSPORT=fabric (tcp) or "
                         "bring a port up")
    devices: tuple[str, ...] = ()
    if transport == "fabric":
        if not provider and nics.kind == EFA_KIND:
            provider = "efa"
        elif not provider and not requested and not nics.devices:
            provider = "tcp"  # fabric chosen for want of a NIC; a fabric asked for keeps libfabric's choice
        if provider == "efa" and nics.kind == EFA_KIND:
            devices = tuple(f"{d}-rdm" for d in nics.devices)  # the efa provider's domain names
    elif transport == "verbs":
        devices = nics.devices
    else:
        provider = None
    return TransportChoice(transport, provider, devices, why)


def _local_choices(gpu: int, requested: Optional[str], provider: Optional[str]) -> dict[bool, Any]:
    """This rank's TransportChoice (or error text) for both answers to "are all ranks on one host?", so
    that one exchange settles the transport (the answer is known only once every host name is in). A bad
    UCCL_EP_NICS fails only the transports that open NICs (`choose_transport`)."""
    try:
        nics = choose_nics(gpu_bus_id(gpu), local_rank(gpu))
    except ValueError as exc:
        nics = NicChoice((), "", "not chosen (the setting is unusable here)", error=str(exc))
    compiled = compiled_transports()
    out: dict[bool, Any] = {}
    for same_host in (True, False):
        try:
            out[same_host] = (choose_transport(nics, compiled, same_host, gpu, requested, provider), nics)
        except ValueError as exc:
            out[same_host] = str(exc)
    return out


def _agree(per_rank: list[Any], rank: int) -> tuple[TransportChoice, NicChoice]:
    """This rank's choice once every rank's is known; the same RuntimeError on every rank when any rank
    failed to choose or the ranks chose different transports (the fabric transport itself refuses peers
    of another provider, at connect)."""
    failed = [f"rank {r}: {c}" for r, c in enumerate(per_rank) if isinstance(c, str)]
    if failed:
        raise RuntimeError("ProxyGroup: no usable transport: " + "; ".join(failed))
    kinds = {c.transport for c, _ in per_rank}
    if len(kinds) > 1:
        raise RuntimeError("ProxyGroup: ranks chose different transports: " + "; ".join(
            f"rank {r}: {c.transport}{f' ({c.provider})' if c.provider else ''}, {c.reason}"
            for r, (c, _) in enumerate(per_rank)) + "; set UCCL_EP_TRANSPORT (and FI_PROVIDER) on every rank")
    return per_rank[rank]


def warn_lazy_module_loading(rank: int) -> None:
    """Warns (once per process) when proxies that copy GPU memory through the CUDA runtime serve a process that
    loads its CUDA modules lazily: a kernel's first launch then loads its module while EP kernels may be waiting
    for those proxies, and the load holds the proxies' copies back (seen on an H200 as for pageable copies:
    docs/internode.md, "Host copies and the fabric transport"). Only a warning: the setting must be made before
    CUDA starts, and a rank refusing alone would leave its peers waiting."""
    from .gpu_sharing import loads_modules_eagerly

    global _warned_lazy
    if _warned_lazy or loads_modules_eagerly():
        return
    _warned_lazy = True
    log.warning("uccl_ep_train rank %d: the proxies' transport copies GPU memory through the CUDA runtime (fabric "
                "on shm, or a NIC without GPUDirect RDMA) and CUDA modules load lazily here: a kernel launched for "
                "the first time while EP calls are in flight can stall them until UCCL_EP_TIMEOUT_S; set "
                "CUDA_MODULE_LOADING=EAGER in the ranks' environment before CUDA starts", rank)


_warned_lazy = False


def warn_single_connection(rank: int) -> None:
    """Warns (once per process) when proxies whose progress calls the GPU runtime serve a process limited to
    one hardware queue per GPU (CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron asks for with sequence
    parallelism and the cluster recipes set): the proxies' copies then queue behind the EP kernels that spin
    until those copies land. On an H200 the fabric transport on shm hung the first dispatch so in both runs with
    two ranks sharing the GPU under MPS, and passed with one rank per GPU (docs/internode.md, "Host copies and
    the fabric transport"). Only a warning: the setting serves the rest of the job, and a rank refusing alone
    would leave its peers waiting."""
    global _warned_single
    if _warned_single or os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() != "1":
        return
    _warned_single = True
    log.warning("uccl_ep_train rank %d: the proxies' transport copies GPU memory through the CUDA runtime and "
                "CUDA_DEVICE_MAX_CONNECTIONS=1 gives this process one hardware queue: those copies can wait behind "
                "the EP kernels that wait for them until UCCL_EP_TIMEOUT_S (seen every time with ranks sharing "
                "a GPU under MPS); use a transport that moves GPU memory by DMA (efa with GPUDirect RDMA, verbs), ipc "
                "within a host, or leave CUDA_DEVICE_MAX_CONNECTIONS unset", rank)


_warned_single = False


def check_caller_stream(waits_for_default_stream: bool, device: Any, rank: int) -> None:
    """Raises when proxies that queue GPU copies on the legacy default stream (`ProxyGroup.calls_gpu_runtime`:
    the fabric transport on libfabric's shm, whose cudaMemcpy goes there) serve a call issued from that
    stream: its kernels, or the default stream waiting for them, would hold those copies back until the kernels
    time out."""
    if not waits_for_default_stream:
        return
    import torch
    if torch.cuda.current_stream(device).cuda_stream == 0:
        raise RuntimeError(
            f"rank {rank}: the proxies use the fabric transport on a provider that copies GPU memory with the "
            "CUDA runtime on the default stream (libfabric's shm), so EP calls cannot be issued from the default "
            "stream: issue them on a stream of your own (`with torch.cuda.stream(s):`), or use "
            "UCCL_EP_TRANSPORT=ipc with every rank on one host (a NIC provider such as efa needs neither)")


def _all_gather(obj: Any, group: Any, world: int) -> list:
    if world == 1:
        return [obj]
    import torch.distributed as dist
    if not dist.is_initialized():
        raise RuntimeError("ProxyGroup: world > 1 needs torch.distributed initialised (or an `exchange` callable)")
    out: list = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def providers_of(opened: list) -> str:
    """The distinct libfabric providers of a ProxyGroup's `config()["opened"]` endpoints, in order, joined."""
    return ", ".join(dict.fromkeys(o["provider"] for o in opened if o["provider"]))


def described(transport: str, providers: str) -> str:
    """A transport with the providers its endpoints opened, e.g. 'fabric (shm)'; 'ipc', 'verbs' alone."""
    return transport + (f" ({providers})" if providers else "")


class ProxyGroup:
    """One rank's proxy threads + rings + transport endpoints, bootstrapped over torch.distributed.

    Args:
        rank, world: this rank and the number of ranks (of `group`).
        regions: {region_id: buffer}; buffers are symmetric (same id and size on every rank). A buffer is a
            torch tensor, numpy array or (ptr, nbytes[, is_device]). Atomic targets must be host memory.
        group: torch.distributed process group used for the bootstrap (None: the default group).
        transport: 'fabric' | 'ipc' | 'verbs'; default UCCL_EP_TRANSPORT, else chosen by what this rank's
            NICs are (`choose_transport`); `devices` / `transport_reason` / `nics` say what was chosen and why.
        gpu: CUDA/HIP device whose kernels feed the rings, or -1 for CPU producers (`push`).
        exchange: optional callable(obj) -> list of every rank's obj, replacing torch.distributed.
        **options: num_threads, ring_capacity, provider, low_latency, max_inflight, max_inflight_bytes,
            adaptive_sleep, timeout_s, fault, pin_threads (defaults from the environment).
    """

    def __init__(self, rank: int, world: int, regions: Mapping[int, Any], group: Any = None,
                 transport: Optional[str] = None, gpu: int = -1,
                 exchange: Optional[Callable[[Any], list]] = None, start: bool = True, **options: Any):
        if not available():
            raise RuntimeError("ProxyGroup: the native module uccl_ep_train._native is not built "
                               "(run `python setup.py build_ext --inplace`)")
        if not (0 <= rank < world):
            raise ValueError(f"ProxyGroup: rank {rank} out of range for world {world}")
        if transport is not None and transport not in _TRANSPORTS:
            raise ValueError(f"ProxyGroup: transport must be one of {', '.join(_TRANSPORTS)}, got {transport!r}")
        gather = exchange or (lambda obj: _all_gather(obj, group, world))
        self.rank, self.world, self.gpu = rank, world, gpu
        self._closed = False
        self._native = None
        # Phase 1: job id (rank 0's), host names and each rank's transport choice for either answer to "one
        # host?", so every rank settles the same transport, or raises the same error, before any endpoint.
        requested = transport or os.environ.get("UCCL_EP_TRANSPORT") or None
        provider = options.pop("provider", None) or os.environ.get("FI_PROVIDER") or None
        info = gather((uuid.uuid4().hex[:12], socket.gethostname(), _local_choices(gpu, requested, provider)))
        job = info[0][0]
        same_host = len({h for _, h, _ in info}) == 1
        choice, self.nics = _agree([c[same_host] for _, _, c in info], rank)
        if self.nics.error:  # only ipc gets here with one: it opens no NIC
            log.info("uccl_ep_train: the %s transport opens no NIC; ignored: %s", choice.transport, self.nics.error)
        self.transport, self.transport_reason, self.devices = choice.transport, choice.reason, choice.devices
        if choice.provider:
            options["provider"] = choice.provider
        # Phase 2: endpoint addresses + memory keys of every thread of every rank. A rank that fails to
        # build its endpoints still takes part in the exchange, carrying its error, so no peer hangs.
        self._keepalive = dict(regions)  # the buffers must outlive the registrations
        mine: Any
        try:
            if self.transport == "verbs":  # Thor-2 / Pollara flow control unless the user set it
                flow, note = nic_flow_control(_native.verbs_devices(), self.devices, bool(options.get("low_latency")))
                options = {**flow, **options}
                if note:
                    log.info("uccl_ep_train: %s", note)
            self._native = _native.Proxy(rank, world, gpu=gpu, transport=self.transport, job=job,
                                         devices=list(self.devices), **options)
            for rid, buf in regions.items():
                ptr, nbytes, device = _region_of(buf)
                self._native.register_region(int(rid), ptr, nbytes, device)
            mine = [self._native.local_blob(t) for t in range(self._native.num_threads)]
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the peers heard of it
            exc.add_note(f"(transport {self.transport}: {self.transport_reason}; devices "
                         f"{', '.join(self.devices) or 'default'})")
            mine = exc
        everyone = gather(mine if not isinstance(mine, Exception) else
                          f"{type(mine).__name__}: {mine} {' '.join(getattr(mine, '__notes__', []))}")
        if isinstance(mine, Exception):
            self.close()
            raise mine
        failed = [(r, e) for r, e in enumerate(everyone) if isinstance(e, str)]
        if failed:
            self.close()
            raise RuntimeError("ProxyGroup: bootstrap failed on " +
                               "; ".join(f"rank {r}: {e}" for r, e in failed))
        # Phase 3: every rank's endpoints are connected (verbs: every QP in RTS) before any rank starts and
        # sends; a peer whose QP is still in INIT drops packets and the sender ends in retry-exceeded (12).
        try:
            self._native.connect(everyone)
            connected = None
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the peers heard of it
            connected = f"{type(exc).__name__}: {exc}"
        failed = [(r, e) for r, e in enumerate(gather(connected)) if e is not None]
        if failed:
            self.close()
            raise RuntimeError("ProxyGroup: connect failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed))
        # A provider that refused to leave the CUDA runtime alone calls it in the proxy threads: its copies queue
        # on the legacy default stream and the fabric transport holds arrivals until they ran
        # (csrc/transport/fabric.cpp), so the backends refuse calls from that stream.
        self.calls_gpu_runtime = bool(self._native.config()["calls_gpu_runtime"])
        if self.calls_gpu_runtime:
            warn_lazy_module_loading(rank)
            warn_single_connection(rank)
        if start:
            self._native.start()

    # -- producers and waits -------------------------------------------------------------------
    @property
    def num_threads(self) -> int:
        return self._native.num_threads

    def ring_for_channel(self, channel: int) -> int:
        return channel % self.num_threads

    def push(self, ring: int, commands: np.ndarray, owned: bool = False) -> None:
        """CPU producer: pushes a COMMAND_DTYPE array into `ring` (waits on a full ring, with timeout).
        `owned`: the caller is the ring's only producer for this call (the RingProducer path GPU warps
        with a ring of their own take: no claim atomic); otherwise slots are claimed (many producers)."""
        arr = np.ascontiguousarray(commands)
        if arr.dtype != COMMAND_DTYPE:
            raise TypeError(f"push: commands must have COMMAND_DTYPE, got {arr.dtype}")
        self._native.push(ring, arr.view(np.uint8), owned)

    def wait_seq(self, src: int, channel: int, target: int, timeout_s: Optional[float] = None,
                 phase: str = "arrival") -> None:
        """Waits until `target` operations from `src` on `channel` have been applied in order."""
        self._native.wait_seq(src, channel, target, self._timeout(timeout_s), phase)

    def wait_flushed(self, ring: int, target: int, timeout_s: Optional[float] = None) -> None:
        self._native.wait_flushed(ring, target, self._timeout(timeout_s))

    def _timeout(self, t: Optional[float]) -> float:
        return float(t if t is not None else self._native.config()["timeout_s"])

    def seq_tail(self, src: int, channel: int) -> int:
        return self._native.seq_tail(src, channel)

    def imm_count(self, src: int, channel: int) -> int:
        return self._native.imm_count(src, channel)

    def barrier_count(self, src: int) -> int:
        return self._native.barrier_count(src)

    def flushed(self, ring: int) -> int:
        return self._native.flushed(ring)

    def ring_desc(self, ring: int, device: bool = True) -> dict:
        return self._native.ring_desc(ring, device)

    def failure_record(self, device: bool = True) -> int:
        """Address of the record a stopping proxy thread fills (pinned host memory; device=True: as the GPU sees
        it): the kernels' waits poll it, so a dead thread ends them at once (docs/proxy.md, "Failures")."""
        return int(self._native.failure_record(device))

    def abort(self, op: str) -> None:
        """This rank aborted call `op` (one of _native.ABORT_OPS): proxy thread 0 tells every peer's proxy, which
        fills its failure record, so the kernels of ranks on other nodes stop too (docs/api.md, "Aborts")."""
        from . import _native  # noqa: PLC0415 (optional extension)

        self._native.abort(list(_native.ABORT_OPS).index(op))

    def failure_code(self) -> int:
        """The record's code: 0 until a thread stopped, then _native.ERROR_CODES["proxy_failed"]."""
        return int(self._native.failure_code())

    def signals(self, device: bool = True) -> dict:
        return self._native.signals(device)

    def stats(self) -> dict:
        """Counters summed over this rank's proxy threads (each thread counts its own, without locked
        instructions; a snapshot taken while commands flow may be a few operations behind):

        - `commands`: commands taken from the rings (every opcode, rejected ones included).
        - `writes` / `atomics` / `flushes` / `nops`: OP_WRITE + OP_WRITE_IMM posted / OP_ATOMIC_ADD posted /
          OP_FLUSH + OP_BARRIER executed (each bumps its ring's `flushed`) / OP_NOP echoed.
        - `rejected`: commands refused (the first error is in `check()`).
        - `bytes`: payload bytes of the writes posted, all destinations together.
        - `bytes_to`, `commands_to`: lists indexed by destination rank (length world, this rank included):
          payload bytes of the writes posted to that rank, and the operations posted to it (writes,
          atomic adds, barrier markers; NOP, FLUSH and rejected commands go nowhere and are not counted).
          Zero-length writes count as commands with 0 bytes. With ranks of different nodes, the entries
          of the other nodes' ranks are exactly what crossed the node boundary through the proxies.
        - `local_completions`: operations the transport reported complete at this end.
        - `arrivals`: remote operations received (before ordering); `out_of_order`: how many of them
          arrived ahead of their turn and waited in the ordering window.
        - `fault_held`: completions held back by fault injection (UCCL_EP_FAULT).
        - `idle_sleeps`: adaptive-sleep naps taken (UCCL_RDMA_ADAPTIVE_SLEEP); 0 when spinning.
        - `held`, `undelivered` (now, not cumulative): arrivals the ordering window holds for an earlier one,
          and arrivals the transport read but holds back (the fabric transport's copy fence, until the
          provider's GPU copies ran). A timeout's message quotes them (`state_line`).
        """
        return self._native.stats()

    def state_line(self) -> str:
        """This rank's proxies in one line, for a timeout's message: with the peers' lines, where an
        operation stopped (never posted, posted but not arrived, arrived but held)."""
        s = self.stats()
        return (f"this rank's proxies: {s['commands']} commands taken, {s['writes']} writes posted, "
                f"{s['local_completions']} completed, {s['arrivals']} arrivals, {s['held']} held for an earlier "
                f"one, {s['undelivered']} held by the copy fence")

    def config(self) -> dict:
        return self._native.config()

    @property
    def opened_providers(self) -> str:
        """The libfabric provider(s) the endpoints opened, e.g. 'shm' or 'tcp;ofi_rxm' ('' for ipc and verbs):
        what FI_PROVIDER asked for may be an alias, or nothing, leaving the choice to libfabric."""
        return providers_of(self.config()["opened"])

    @property
    def described_transport(self) -> str:
        """The transport with the provider its endpoints opened, e.g. 'fabric (shm)'; 'ipc', 'verbs' alone."""
        return described(self.transport, self.opened_providers)

    def thread_cpus(self) -> list[int]:
        return self._native.thread_cpus()

    def check(self) -> None:
        """Raises RuntimeError with the first error any proxy thread recorded (rejected command, transport
        failure, timeout naming rank, peer, channel and phase)."""
        err = self._native.error()
        if err:
            raise RuntimeError(err)

    # -- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the threads (each first quiesces its endpoint with the peers', bounded by min(timeout_s, 10 s):
        ranks should close together) and releases transports and registrations; idempotent, safe after errors."""
        if self._closed:
            return
        self._closed = True
        if self._native is not None:
            self._native.stop()

    stop = close

    def __enter__(self) -> "ProxyGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def start_proxies(runtime: Any, **kw: Any) -> tuple[list, list]:
    """Called by `initialize_uccl`: starts this GPU's proxies over the runtime's scratch (RDMA) region.

    Proxies start when the native module is built and the scratch lives on a GPU (or
    UCCL_EP_START_PROXIES=1 for CPU runs); otherwise nothing runs and both lists are empty."""
    scratch = getattr(runtime, "scratch", None)
    if not available() or scratch is None:
        return [], []
    on_gpu = bool(getattr(scratch, "is_cuda", False))
    if not on_gpu and os.environ.get("UCCL_EP_START_PROXIES") != "1":
        log.info("uccl_ep_train: CPU scratch, proxies not started (UCCL_EP_START_PROXIES=1 forces them)")
        return [], []
    gpu = scratch.device.index if on_gpu else -1
    flat = scratch.reshape(-1)
    if runtime.num_rdma_bytes:
        flat = flat[: max(1, -(-runtime.num_rdma_bytes // flat.element_size()))]
    regions = {0: flat}
    # Until kernels push commands on every call, idle proxies should not burn a core each: sleep
    # adaptively unless UCCL_RDMA_ADAPTIVE_SLEEP (or the caller) says otherwise.
    if "adaptive_sleep" not in kw and "UCCL_RDMA_ADAPTIVE_SLEEP" not in os.environ:
        kw["adaptive_sleep"] = True
    group = ProxyGroup(runtime.rank, runtime.num_ranks, regions, group=runtime.group, gpu=gpu, **kw)
    log.info("uccl_ep_train: %d proxy threads on %s transport (%s; NICs %s: %s; cpus %s)", group.num_threads,
             group.transport, group.transport_reason, ", ".join(group.nics.devices) or "none", group.nics.reason,
             group.thread_cpus())
    return [group], []
