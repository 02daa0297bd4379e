"""`Buffer`: the DeepEP v1.2.1-compatible API (high-throughput and low-latency dispatch/combine).

Code written for `deep_ep.Buffer` runs unchanged on this class. It validates every argument before any
communication, runs the backend on a communication stream (CUDA) with DeepEP's event semantics
(`previous_event`, `async_finish`, `allocate_on_comm_stream`), and returns DeepEP's tuples.
Ours on top: the expert-major pair (`dispatch_expert_major`, `dispatch_expert_major_cached`,
`combine_expert_major`), which moves rows straight into/out of the order experts consume.
Backend choice: `native` when the native module, its kernels and GPUs are present (across nodes: when it
also has the internode path), `reference` (torch.distributed) otherwise; `UCCL_EP_BACKEND=reference|native`
forces one. `Buffer.backend_name` says which one is in use. Which ranks form a node is decided once, at
construction (`Buffer.topology`, see topology.py): on several nodes the layout has a per-node count and
dispatch returns an InternodeHandle.
"""
from __future__ import annotations

import functools
import itertools
import logging
import os
from typing import Any, Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import aborts, agreement
from . import validation as V
from .backends.base import Backend
from .backends.low_latency import PROXY_GROUPS, low_latency_layout
from .config import DEFAULT_COMBINE, DEFAULT_DISPATCH, DEFAULT_NUM_SMS, Config, default_config
from .events import EventHandle, EventOverlap, capturing, current_raw_stream, host_values
from .errors import RankLocalError
from .fp8 import FP8_BLOCK
from .gpu_sharing import group_device
from .handles import HTHandle, LowLatencyHandle, check_ht_handle, check_low_latency_handle
from .proxy import check_caller_stream
from .topology import Topology, detect_topology

log = logging.getLogger("uccl_ep_train")

# Errors a call raises alike on every rank (argument checks, ranks that disagree): no abort, the Buffer stays
# usable. A value check that fails on one rank's own data raises errors.RankLocalError (a ValueError) instead,
# which aborts wherever in the call it is raised (`_collective`).
_ALIKE_ERRORS = (ValueError, TypeError, NotImplementedError)


def _collective(op: str) -> Callable:
    """Marks a Buffer method as the collective call `op`: a RankLocalError it raises, before its backend call
    or inside it, aborts `op` on the peers (Buffer._publish_abort), which wait for this rank in the same call
    (or, after the local get_dispatch_layout, in the next one). Other errors inside the backend call abort
    through Buffer._abort_on_error."""
    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def call(self: "Buffer", *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except RankLocalError as exc:
                if self._aborted is None and not capturing():
                    self._publish_abort(self._backend_of(op), op, f"{type(exc).__name__}: {exc}")
                raise
        return call
    return wrap


_buffer_ids = itertools.count(1)
_announced: set[str] = set()

XType = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _native_internode_backend() -> tuple[Optional[type], str]:
    """(NativeInternodeBackend, "") when its module loads and reports internode support, else (None, why)."""
    try:
        from .backends.internode import NativeInternodeBackend, internode_available
    except ImportError as exc:
        return None, f"the internode backend cannot load: {exc}"
    if not internode_available():
        return None, "the native module was built without the internode path"
    return NativeInternodeBackend, ""


def _warn_without_native_kernels() -> None:
    """Once per process, loudly: GPUs are here but the native kernels cannot serve them, so `auto` runs the
    reference backend (torch.distributed, a host sync per call: several times slower). `doctor` says the same."""
    if "native-missing" in _announced:
        return
    try:
        from .backends.native import native_problem
    except ImportError as exc:
        why = f"the native backend does not load ({exc})"
    else:
        why = native_problem()
    if why:
        _announced.add("native-missing")
        log.warning("uccl_ep_train: GPUs are present but %s. Falling back to the REFERENCE backend "
                    "(torch.distributed, several times slower); UCCL_EP_BACKEND=native makes this an error.", why)


def _make_backend(group, rank, num_ranks, owner, num_nvl_bytes, num_rdma_bytes, device,
                  topology: Topology, low_latency_mode: bool) -> Backend:
    choice = os.environ.get("UCCL_EP_BACKEND", "auto").lower()
    if choice not in ("auto", "reference", "native"):
        raise ValueError(f"UCCL_EP_BACKEND must be auto, reference or native, got {choice!r}")
    if choice == "auto" and device.type == "cuda":
        _warn_without_native_kernels()
    if choice != "reference" and device.type == "cuda":
        try:
            from .backends.native import NativeBackend, native_available
        except ImportError as exc:
            if choice == "native":
                raise RuntimeError(f"UCCL_EP_BACKEND=native but the native backend cannot load: {exc}") from exc
        else:
            if not native_available():
                if choice == "native":
                    raise RuntimeError("UCCL_EP_BACKEND=native but the native module was built without GPU kernels")
            elif not topology.internode:  # the intranode kernels serve one node only
                return NativeBackend(group, rank, num_ranks, owner, num_nvl_bytes, num_rdma_bytes, device)
            else:  # several nodes: the internode kernels (NVLink inside a node, CPU proxies between nodes)
                internode, why = _native_internode_backend()
                if internode is not None:
                    return internode(group, rank, num_ranks, owner, num_nvl_bytes, num_rdma_bytes, device,
                                     topology=topology, proxy_groups=PROXY_GROUPS if low_latency_mode else 1,
                                     open_at_first_dispatch=low_latency_mode)
                if choice == "native":
                    raise RuntimeError(f"UCCL_EP_BACKEND=native but the ranks span {topology.num_nodes} nodes "
                                       f"({topology.ranks_per_node} ranks each) and {why}; use "
                                       f"UCCL_EP_BACKEND=reference, or UCCL_EP_RANKS_PER_NODE={num_ranks} if "
                                       f"they share one NVLink/xGMI domain")
    elif choice == "native":
        raise RuntimeError("UCCL_EP_BACKEND=native needs CUDA/HIP GPUs: an NCCL group, or a gloo group with "
                           "UCCL_EP_DEVICE=cuda")
    from .backends.reference import ReferenceBackend
    return ReferenceBackend(group, rank, num_ranks, owner, num_nvl_bytes, num_rdma_bytes, device, topology=topology)


def _make_low_latency_backend(buffer: "Buffer") -> Optional[Backend]:
    """The native LL backend when the Buffer is in low-latency mode on a native HT backend and the module has
    the LL kernels; None otherwise (LL calls then go to the reference backend)."""
    if not buffer.low_latency_mode or buffer.backend_name != "native":
        return None
    from .backends.low_latency import NativeLowLatencyBackend, low_latency_available

    smallest = low_latency_layout(1, FP8_BLOCK, buffer.group_size, buffer.group_size).total_bytes
    if not low_latency_available() or buffer.num_rdma_bytes < smallest:  # too small for any LL call: the
        return None                                                       # calls raise the size they need
    return NativeLowLatencyBackend(buffer.group, buffer.rank, buffer.group_size, buffer.id, buffer.num_nvl_bytes,
                                   buffer.num_rdma_bytes, buffer.device, topology=buffer.topology)


def _check_capture(op: str, backend: Backend, host_sync: str = "") -> None:
    """Inside CUDA-graph capture only calls that replay exactly are taken: the backend's kernels must be
    capture-safe (its `capture_refusal` is empty) and the call must not size its outputs on the host
    (`host_sync` says why this one would). Refused before any work, with the reason."""
    if not capturing():
        return
    if backend.capture_refusal:
        raise RuntimeError(f"{op}: cannot be captured in a CUDA graph on the {backend.name} backend: "
                           f"{backend.capture_refusal}")
    if host_sync:
        raise RuntimeError(f"{op}: cannot be captured in a CUDA graph: {host_sync}")


_FRESH_SIZES = ("a fresh dispatch sizes its outputs from the receive counts on the host; pass num_worst_tokens "
                "(the most rows this rank can receive) or capture the cached dispatch")


class Buffer:
    """Communication buffers and kernels for expert-parallel dispatch/combine (DeepEP-compatible).

    Attributes:
        num_sms: SMs used by the high-throughput kernels (class-wide, `set_num_sms`).
        rank, group_size, group: this rank, the number of ranks, the process group.
        topology: which ranks form a node (`topology.num_nodes`, `.ranks_per_node`; see topology.py).
        num_nvl_bytes, num_rdma_bytes: buffer sizes for NVLink and RDMA (also LL) traffic.
        backend_name: 'native' or 'reference'.
    """

    num_sms: int = DEFAULT_NUM_SMS

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, comm: Any = None) -> None:
        """
        Arguments:
            group: the communication group (gloo on CPU ranks, NCCL on GPUs).
            num_nvl_bytes: buffer size for intranode (NVLink/xGMI) communication.
            num_rdma_bytes: buffer size for internode and low-latency communication.
            low_latency_mode: enable the low-latency kernels.
            num_qps_per_rank: RDMA queue pairs per peer (the proxy's transport uses it).
            allow_nvlink_for_low_latency_mode: let LL traffic between GPUs of one node use NVLink.
            allow_mnnvl: allow multi-node NVLink domains.
            explicitly_destroy: DeepEP's flag, kept for its callers: `destroy()` is the orderly, collective
                release either way; a Buffer dropped without it runs no collective in its destructor (its
                resources are freed at the next Buffer creation on the group once every rank dropped it,
                see agreement.py).
            comm: an mpi4py communicator instead of `group` (not supported: raises NotImplementedError).
        """
        if comm is not None:
            raise NotImplementedError("Buffer: comm (mpi4py communicator) is not supported; pass a torch.distributed group")
        if group is None:
            raise ValueError("Buffer: group must be a torch.distributed process group")
        for name, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            V.check_non_negative_int(v, name)
        V.check_non_negative_int(num_qps_per_rank, "num_qps_per_rank", 1)
        if allow_mnnvl:
            raise NotImplementedError("Buffer: allow_mnnvl=True (multi-node NVLink) is not supported")
        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.device = group_device(group)
        self.id = next(_buffer_ids)
        self._sequence = agreement.next_sequence(group)
        self._comm_stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        self._comm_used = False  # set by the first call that runs on the comm stream (see _run)
        self._sync_stream: Optional[torch.cuda.Stream] = None  # where synchronous calls run (see _run)
        self._aborted: Optional[str] = None  # why calls are refused: an abort this rank sent or received (_run)
        self.topology: Topology = detect_topology(group)  # collective: before the backend, which needs it
        # collective: the same settings on every rank (else the same error on every rank), before any data moves
        agreement.agree(group, self.device, self._sequence, {
            "num_nvl_bytes": self.num_nvl_bytes, "num_rdma_bytes": self.num_rdma_bytes,
            "low_latency_mode": self.low_latency_mode, "num_qps_per_rank": self.num_qps_per_rank})
        self._backend: Optional[Backend] = _make_backend(group, self.rank, self.group_size, self.id,
                                                         self.num_nvl_bytes, self.num_rdma_bytes, self.device,
                                                         self.topology, self.low_latency_mode)
        self.backend_name = self._backend.name
        # LL calls: the native LL kernels beside a native HT backend (collective, so made here), else the
        # reference backend, made on first use
        self._ll_backend: Optional[Backend] = _make_low_latency_backend(self)
        if self.backend_name not in _announced and self.rank == 0:
            _announced.add(self.backend_name)
            log.info("uccl_ep_train: Buffer uses the %s backend on %s", self.backend_name, self.device)

    # ---- lifecycle -------------------------------------------------------------------------------------
    def _take_backends(self) -> list[Backend]:
        """This Buffer's backends (each once; the LL one may be the HT one), detached from it."""
        backends = {id(b): b for b in (getattr(self, "_backend", None), getattr(self, "_ll_backend", None))
                    if b is not None}
        self._backend = self._ll_backend = None
        return list(backends.values())

    def destroy(self) -> None:
        """Collective (every rank calls it): waits until no rank uses the buffers, then releases every resource
        (idempotent); a new Buffer can be made in the same process."""
        for backend in self._take_backends():
            backend.destroy()

    def __del__(self) -> None:
        """No collective here (ranks collect garbage at different times) and no free of memory a peer may
        still write into: the resources are parked until every rank dropped this Buffer (agreement.py)."""
        backends = self._take_backends()
        if not backends:
            return

        def release() -> None:
            for backend in backends:
                backend.release()

        agreement.park(self.group, self._sequence, release)

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("Buffer: used after destroy()")
        return self._backend

    @property
    def low_latency_backend(self) -> Backend:
        """The backend serving low-latency calls: the native LL kernels, else the HT backend when it has LL
        calls, else the reference."""
        backend = self.backend
        if self._ll_backend is None and backend.supports_low_latency:
            return backend
        if self._ll_backend is None:
            from .backends.reference import ReferenceBackend
            self._ll_backend = ReferenceBackend(self.group, self.rank, self.group_size, self.id, self.num_nvl_bytes,
                                                self.num_rdma_bytes, self.device, topology=self.topology)
            if self.rank == 0:
                log.info("uccl_ep_train: %s backend has no low-latency kernels; LL calls use the reference backend",
                         backend.name)
        return self._ll_backend

    # ---- DeepEP static helpers ---------------------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """DeepEP's question, answered for the native module: were its kernels compiled for SM90 (Hopper) or a
        newer NVIDIA architecture? (FP8 dispatch itself works on every backend here: the reference backend
        and the native kernels move FP8 rows as bytes.)"""
        try:
            from . import _native  # noqa: PLC0415 (optional extension)
        except ImportError:
            return False
        archs = [a for a in str(getattr(_native, "GPU_ARCHS", "")).split(",") if a.isdigit()]
        return bool(getattr(_native, "WITH_CUDA", False)) and any(int(a) >= 90 for a in archs)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM count the high-throughput kernels use by default (even, as in DeepEP)."""
        if not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"set_num_sms: new_num_sms must be a positive even int, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event at the current point of the current stream (for `previous_event`)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return default_config(DEFAULT_DISPATCH, Buffer.num_sms, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return default_config(DEFAULT_COMBINE, Buffer.num_sms, num_ranks)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """RDMA bytes the low-latency kernels need for calls of this shape: exactly their layout
        (backends/low_latency.py: two alternating halves of send / receive blocks per rank, staging and the
        zero-copy combine input)."""
        for name, v in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
                        ("num_ranks", num_ranks), ("num_experts", num_experts)):
            V.check_non_negative_int(v, name, 1)
        if num_experts % num_ranks:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by num_ranks ({num_ranks})")
        return low_latency_layout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts).total_bytes

    def get_comm_stream(self) -> Optional[torch.Stream]:
        """The stream communication runs on (None on CPU ranks)."""
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """This rank's NVLink (or RDMA) communication buffer viewed as `dtype`, from byte `offset`, optionally
        shaped `size` (a view: writes reach the buffer). Backends without such a buffer raise
        NotImplementedError."""
        raw = self.backend.local_buffer(use_rdma_buffer)[offset:]
        elem = torch.empty((), dtype=dtype).element_size()
        tensor = raw[: raw.numel() // elem * elem].view(dtype)
        if size is None:
            return tensor
        if tensor.numel() < torch.Size(size).numel():
            raise ValueError(f"get_local_buffer_tensor: size {list(size)} needs {torch.Size(size).numel() * elem} "
                             f"bytes, the buffer has {raw.numel()} from offset {offset}")
        return tensor[: torch.Size(size).numel()].view(size)

    # ---- stream/event plumbing -------------------------------------------------------------------------
    def _check_caller_stream(self) -> None:
        """Refuses a call from the legacy default stream when this Buffer's proxies copy GPU memory on it
        (`proxy.check_caller_stream`)."""
        waits = any(getattr(b, "waits_for_default_stream", False) for b in (self._backend, self._ll_backend))
        check_caller_stream(waits, self.device, self.rank)

    def _backend_of(self, op: str) -> Backend:
        return self.low_latency_backend if op.startswith("low_latency") else self.backend

    def _refuse_after_abort(self, op: str) -> None:
        if self._aborted is not None:
            raise RuntimeError(f"{op}: this Buffer is unusable after an abort ({self._aborted}); destroy it and "
                               "make a new Buffer on every rank")

    def _received_abort(self, backend: Backend) -> Optional[str]:
        """The sentence to raise when `backend`'s kernels stopped on a peer's abort (its message read from the
        store, aborts.py), else None; the Buffer refuses further calls afterwards."""
        source = backend.aborted_by()
        if source is None or source[0] == self.rank:
            return None
        from .backends.native import abort_sentence  # only native backends abort

        rank, op = source
        self._aborted = abort_sentence(rank, op, aborts.read_message(self.group, self._sequence, rank))
        return self._aborted

    def _publish_abort(self, backend: Backend, op: str, message: str) -> None:
        """Tells the peers that this rank raised `message` inside `op` (a backend that cannot: nothing). The
        message goes into the store first: a peer reads it as soon as the abort record stops its kernels, and
        across nodes the record (through the proxies) can arrive within microseconds."""
        aborts.publish_message(self.group, self._sequence, self.rank, message)  # unread unless a record follows
        try:
            published = backend.abort(op)
        except RuntimeError as exc:  # the peers time out instead; the error this rank raises matters more
            log.error("uccl_ep_train: rank %d could not abort '%s' on its peers: %s", self.rank, op, exc)
            published = True  # its buffer may be half-told: unusable all the same
        if published:
            self._aborted = f"rank {self.rank} aborted '{op}': {message}"

    def _abort_on_error(self, op: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        """`fn` (a call's value checks or its backend call, which may have started communicating) such that an
        error it raises reaches the peers at once (issue #42): an error the kernels recorded is re-raised as is
        (they told the node peers already), or as "rank R aborted 'op': ..." when it is a peer's abort; an
        argument error (_ALIKE_ERRORS: the backends' argument checks and the ranks' agreement checks, which every
        rank makes alike) leaves the Buffer usable (errors.RankLocalError, a check of this rank's own data, aborts
        through `_collective`); any other error of this rank (a native refusal, a check of received sizes, a
        failed allocation) is published as this rank's abort (the backend's `abort`, then the message in the
        store) and re-raised. Inside CUDA-graph capture nothing is published (the refusals there
        come before any kernel is captured, and a copy outside the capture would break it)."""

        def guarded() -> Any:
            try:
                return fn()
            except Exception as exc:
                backend = self._backend_of(op)
                if backend.recorded_error() is not None:
                    received = self._received_abort(backend)
                    if received is not None:
                        raise RuntimeError(received) from exc
                elif self._aborted is None and not isinstance(exc, _ALIKE_ERRORS) and not capturing():
                    self._publish_abort(backend, op, f"{type(exc).__name__}: {exc}")
                raise

        return guarded

    def _run(self, op: str, fn: Callable[[], Any], inputs: tuple, previous_event: Optional[EventOverlap],
             async_finish: bool, allocate_on_comm_stream: bool,
             checks: Optional[Callable[[], None]] = None,
             checked_on_device: Optional[bool] = None) -> tuple[Any, EventOverlap]:
        """Run `fn` on the comm stream after `previous_event` (or the current stream's work) and record an
        event; unless `async_finish`, the current stream waits for it. A call with neither, on a Buffer that
        has not used its comm stream yet, runs on the current stream instead (same order, less host work).
        `checks` (argument checks that read tensor values) run first, in the same stream order, so they see
        what `previous_event` produced, unless the backend's kernels check the same values
        (`checked_on_device`; default: the backend's checks_values_on_device; see validation.host_value_checks).

        Outputs are allocated on the comm stream and recorded on the compute stream too, so their memory is
        not reused while either stream may still use it (`allocate_on_comm_stream` is accepted as in DeepEP:
        ownership is on the comm stream either way).

        `op` names the call: what raises from `checks` or `fn` (after the peers may have started the same call)
        aborts it on every rank (`_abort_on_error`)."""
        self._refuse_after_abort(op)
        return self._run_guarded(self._abort_on_error(op, fn), inputs, previous_event, async_finish,
                                 allocate_on_comm_stream, None if checks is None else self._abort_on_error(op, checks),
                                 checked_on_device)

    def _run_guarded(self, fn: Callable[[], Any], inputs: tuple, previous_event: Optional[EventOverlap],
                     async_finish: bool, allocate_on_comm_stream: bool, checks: Optional[Callable[[], None]],
                     checked_on_device: Optional[bool]) -> tuple[Any, EventOverlap]:
        """_run once `fn` and `checks` abort on error."""
        self._check_caller_stream()
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event: expected an EventOverlap (e.g. Buffer.capture()), "
                            f"got {type(previous_event).__name__}")
        if previous_event is not None and previous_event.event is None:
            previous_event = None  # a synchronous call's (DeepEP's EventOverlap(None)): already in stream order
        if checked_on_device is None:
            checked_on_device = self.backend.checks_values_on_device
        if checks is not None and not V.host_value_checks(checked_on_device):
            checks = None
        if self._comm_stream is not None and capturing():
            # In a CUDA graph every call runs on the capturing stream (the graph orders it; a side stream
            # would need a fork and join per call); previous_event is waited on there.
            if previous_event is not None:
                previous_event.event.current_stream_wait()
            return fn(), EventOverlap(EventHandle(), None)
        if self._comm_stream is None:  # CPU ranks: the work is complete when fn returns
            if previous_event is not None:
                previous_event.event.current_stream_wait()
            if checks is not None:
                checks()
            return fn(), EventOverlap(EventHandle(), None)
        if previous_event is None and not async_finish and not self._comm_used:
            # Synchronous calls of a Buffer that never overlapped run on the current stream: the same order as
            # comm stream + wait, without the stream switch, events and per-tensor record_stream that would
            # sit on the host's critical path. As in DeepEP, such a call returns no event (its work is already
            # in the current stream's order). Once a call uses the comm stream, every call does (ops on one
            # Buffer must not run concurrently, and tensors may be owned by either stream); so does a
            # synchronous call on a second stream, the comm stream then waiting for the first one.
            if torch.cuda.current_device() != self.device.index:
                with torch.cuda.device(self.device):  # the kernels take the current stream of their device
                    return self._run_guarded(fn, inputs, None, False, allocate_on_comm_stream, checks,
                                             checked_on_device)
            if self._sync_stream is None:
                self._sync_stream = torch.cuda.current_stream()  # once per Buffer
            if current_raw_stream(self.device.index) == self._sync_stream.cuda_stream:
                if checks is not None:
                    checks()
                return fn(), EventOverlap(None, None)
        compute = torch.cuda.current_stream()
        comm = self._comm_stream
        if not self._comm_used and self._sync_stream is not None:
            comm.wait_stream(self._sync_stream)  # ops of this Buffer issued on the current stream come first
            self._sync_stream = None
        self._comm_used = True
        if previous_event is not None:
            previous_event.event.stream_wait(comm)
        else:
            comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            if checks is not None:
                checks()
            result = fn()
        # A first internode dispatch opens the proxies inside fn: only now is it known whether they copy on the
        # default stream. Its kernels, on the comm stream, finish (nothing on the default stream waits for them
        # yet); every rank raises here alike, before the caller's stream is made to wait.
        self._check_caller_stream()
        event = EventHandle(comm)
        outputs = tuple(_tensors(result))
        for t in _tensors(inputs):
            t.record_stream(comm)
        for t in outputs:
            t.record_stream(compute)
        if not async_finish:
            event.current_stream_wait()
        return result, EventOverlap(event, inputs + outputs if async_finish else None)

    # ---- high throughput -------------------------------------------------------------------------------
    @_collective("get_dispatch_layout")
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """Compute the dispatch layout from the routing (local, no communication). Expert ids outside
        [-1, num_experts) are an error naming the first bad one's position: a ValueError here where the host
        checks, else found by the native layout kernel without a host sync and raised at the fresh
        dispatch's count sync or the next call (docs/api.md "Errors").

        Arguments:
            topk_idx: `[num_tokens, num_topk]` int64 (int32 accepted), expert ids, -1 means no selection.
            num_experts: number of experts (divisible by the number of ranks).

        Returns:
            num_tokens_per_rank: `[num_ranks]` int32, tokens this rank sends to each rank.
            num_tokens_per_rdma_rank: `[num_nodes]` int32 when the ranks span several nodes
                (`self.topology`): tokens with at least one destination rank on node n, each token counted
                once per node (what crosses to that node); None on one node.
            num_tokens_per_expert: `[num_experts]` int32, tokens this rank sends to each expert.
            is_token_in_rank: `[num_tokens, num_ranks]` bool, whether a token goes to a rank.
            event: the event after the computation.
        """
        V.check_num_experts(num_experts, self.group_size)
        V.check_topk(topk_idx, None, topk_idx.size(0) if isinstance(topk_idx, torch.Tensor) else 0)
        V.check_device(topk_idx, "topk_idx", self.device)
        backend = self.backend
        _check_capture("get_dispatch_layout", backend)

        (per_rank, per_node, per_expert, in_rank), event = self._run(
            "get_dispatch_layout", lambda: backend.get_dispatch_layout(topk_idx, num_experts), (topk_idx,),
            previous_event, async_finish, allocate_on_comm_stream,
            checks=lambda: V.check_expert_range(topk_idx, num_experts, self.rank),
            checked_on_device=backend.checks_expert_ids_on_device)
        return per_rank, per_node, per_expert, in_rank, event

    @_collective("dispatch")
    def dispatch(self, x: XType, handle: Optional[HTHandle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, num_max_tokens_per_rank: int = 0):
        """Dispatch tokens to the ranks holding their experts.

        Arguments:
            x: `[num_tokens, hidden]` bf16 (fp16/fp32 accepted by the reference backend), or a pair
                (`[num_tokens, hidden]` float8 e4m3, `[num_tokens, hidden // 128]` float32 scales).
            handle: a handle from an earlier dispatch: reuse its layout (cached mode, no top-k arguments).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from `get_dispatch_layout`.
            num_tokens_per_rdma_rank: from `get_dispatch_layout` too: `[num_nodes]` int32, required when the
                ranks span several nodes (`self.topology`), None on one node and in cached mode.
            topk_idx: `[num_tokens, num_topk]` int64 expert ids, -1 for none. topk_weights: same shape, float32.
            expert_alignment: round each per-expert receive count up to a multiple of this.
            num_worst_tokens: if > 0, pad outputs to this many rows (no CPU sync for sizes: the call can be
                captured in a CUDA graph); the per-expert count list is then empty.
            config, previous_event, async_finish, allocate_on_comm_stream: as in DeepEP.
            num_max_tokens_per_rank: (not in DeepEP's v1 Buffer; V2's ElasticBuffer passes it) with
                num_worst_tokens: the most tokens any rank passes, the same on every rank. The rows a combine
                brings back are then sized by it, else by num_worst_tokens per rank (a call without a host
                sync cannot learn its peers' token counts).

        Returns:
            recv_x: received tokens (a pair for FP8), grouped by source rank, then source token index.
            recv_topk_idx: `[num_recv, num_topk]` int64 local expert ids, -1 where the expert is elsewhere.
            recv_topk_weights: `[num_recv, num_topk]` float32, 0 where recv_topk_idx is -1.
            num_recv_tokens_per_expert_list: Python list of per-local-expert counts (aligned).
            handle: for combine and cached dispatch. On one node an IntranodeHandle (handle[0] is the rank
                prefix matrix); across nodes an InternodeHandle with DeepEP's 10 internode items (handle[0] is
                is_token_in_rank; docs/api.md, "Internode"). The received rows are the same either way.
            event: the event after the kernels.
        """
        data, scales = V.split_x(x)
        V.check_device(data, "x", self.device)
        config = self._config(config, self.get_dispatch_config)
        _check_capture("dispatch", self.backend, "" if handle is not None or num_worst_tokens else _FRESH_SIZES)
        if num_tokens_per_rdma_rank is not None and not self.topology.internode:
            raise ValueError("dispatch: num_tokens_per_rdma_rank must be None: this Buffer's ranks are on one node "
                             "(get_dispatch_layout returns None for it then)")
        backend = self.backend
        if handle is not None:
            handle = check_ht_handle(handle, self.id)
            for name, v in (("topk_idx", topk_idx), ("topk_weights", topk_weights),
                            ("num_tokens_per_rank", num_tokens_per_rank),
                            ("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank),
                            ("is_token_in_rank", is_token_in_rank), ("num_tokens_per_expert", num_tokens_per_expert)):
                if v is not None:
                    raise ValueError(f"dispatch: {name} must be None with a cached handle")
            if data.size(0) != handle.num_tokens:
                raise RankLocalError(f"x: has {data.size(0)} tokens, the handle was made for {handle.num_tokens}")
            (recv_x, recv_scales), event = self._run(
                "dispatch", lambda: backend.cached_dispatch(data, scales, handle, config), (data, scales, handle),
                previous_event, async_finish, allocate_on_comm_stream)
            return (recv_x, recv_scales) if scales is not None else recv_x, None, None, None, None, event

        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError("dispatch: num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert are "
                             "required without a handle (get them from get_dispatch_layout)")
        num_tokens = data.size(0)
        V.check_layout(num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, num_tokens, self.group_size)
        self._check_rdma_layout(num_tokens_per_rdma_rank)
        num_experts = num_tokens_per_expert.size(0)
        if topk_idx is not None:
            V.check_topk(topk_idx, topk_weights, num_tokens)
        elif topk_weights is not None:
            raise ValueError("dispatch: topk_weights given without topk_idx")
        V.check_non_negative_int(expert_alignment, "expert_alignment", 1)
        V.check_non_negative_int(num_worst_tokens, "num_worst_tokens")
        V.check_non_negative_int(num_max_tokens_per_rank, "num_max_tokens_per_rank")
        if num_max_tokens_per_rank and not num_worst_tokens:
            raise ValueError("num_max_tokens_per_rank: bounds a dispatch with num_worst_tokens only (without it the "
                             "counts are exchanged on the host)")
        if num_tokens > num_max_tokens_per_rank > 0:
            raise RankLocalError(f"x: has {num_tokens} tokens, more than num_max_tokens_per_rank="
                                 f"{num_max_tokens_per_rank}")
        for name, t in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                        ("num_tokens_per_expert", num_tokens_per_expert), ("topk_idx", topk_idx),
                        ("topk_weights", topk_weights), ("x scales", scales),
                        ("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank)):
            V.check_device(t, name, self.device)

        def checks() -> None:  # values: read in stream order, after previous_event, in one host sync
            bounds = V.expert_id_bounds(topk_idx) if topk_idx is not None else None
            parts = [] if bounds is None else [bounds]
            counted = V.value_checks(is_token_in_rank)
            if counted:
                per_node = backend.tokens_per_node(is_token_in_rank)
                parts += [is_token_in_rank.sum(dim=0, dtype=torch.int64), num_tokens_per_rank.to(torch.int64)]
                if per_node is not None:
                    parts += [per_node.to(torch.int64), num_tokens_per_rdma_rank.to(torch.int64)]
            if not parts:
                return
            sizes = [t.numel() for t in parts]
            values = host_values(torch.cat(parts))
            values = [values[end - n:end] for end, n in zip(itertools.accumulate(sizes), sizes)]
            if bounds is not None:
                V.check_expert_range(topk_idx, num_experts, self.rank, bounds=values.pop(0))
            if counted:
                sent, given, *nodes = values
                if sent != given:
                    raise RankLocalError(f"num_tokens_per_rank: {given} disagrees with is_token_in_rank, which "
                                         f"sends {sent}")
                if nodes and nodes[0] != nodes[1]:
                    raise RankLocalError(f"num_tokens_per_rdma_rank: {nodes[1]} disagrees with is_token_in_rank, "
                                         f"which sends {nodes[0]} tokens per node")

        topk_idx64 = topk_idx.to(torch.int64) if topk_idx is not None else None
        result, event = self._run(
            "dispatch",
            lambda: backend.dispatch(data, scales, topk_idx64, topk_weights, num_tokens_per_rank, is_token_in_rank,
                                     num_tokens_per_expert, expert_alignment, num_worst_tokens, config,
                                     num_tokens_per_rdma_rank, num_max_tokens_per_rank),
            (data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
             num_tokens_per_rdma_rank),
            previous_event, async_finish, allocate_on_comm_stream, checks=checks)
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, handle = result
        recv = (recv_x, recv_scales) if scales is not None else recv_x
        return recv, recv_topk_idx, recv_topk_weights, per_expert, handle, event

    def _check_rdma_layout(self, num_tokens_per_rdma_rank: Optional[torch.Tensor]) -> None:
        """A fresh dispatch across nodes needs the per-node counts (its sends to other nodes are sized by
        them); their shape here, their values with the other value checks."""
        if not self.topology.internode:
            return
        if num_tokens_per_rdma_rank is None:
            raise ValueError(f"dispatch: num_tokens_per_rdma_rank is required: this Buffer's ranks span "
                             f"{self.topology.num_nodes} nodes (get it from get_dispatch_layout, which returns "
                             f"it second)")
        V.check_tensor(num_tokens_per_rdma_rank, "num_tokens_per_rdma_rank", (torch.int32,), 1)
        if num_tokens_per_rdma_rank.size(0) != self.topology.num_nodes:
            raise ValueError(f"num_tokens_per_rdma_rank: expected [{self.topology.num_nodes}] (one count per "
                             f"node), got {list(num_tokens_per_rdma_rank.shape)}")

    @_collective("combine")
    def combine(self, x: torch.Tensor, handle: HTHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Reduce (sum, without weights) each token's rows back on the rank it came from.

        Arguments:
            x: `[num_recv_tokens, hidden]` bf16 (fp16/fp32 with the reference backend), in dispatch's
                receive order (rows beyond the handle's received count, i.e. num_worst_tokens padding,
                are ignored).
            handle: from `dispatch` on this Buffer.
            topk_weights: `[num_recv_tokens, num_topk]` float32, reduced the same way.
            bias: 0, 1 or 2 `[num_tokens, hidden]` tensors added to the result.

        Returns:
            combined_x `[num_tokens, hidden]`, combined_topk_weights `[num_tokens, num_topk]` or None, event.
        """
        _check_capture("combine", self.backend)
        handle = check_ht_handle(handle, self.id)
        V.check_tensor(x, "x", V.FLOAT_DTYPES, 2)
        V.check_device(x, "x", self.device)
        if x.size(0) < handle.num_recv_tokens:
            raise RankLocalError(f"x: has {x.size(0)} rows, dispatch returned {handle.num_recv_tokens} "
                                 f"with this handle")
        if topk_weights is not None:
            V.check_tensor(topk_weights, "topk_weights", (torch.float32,), 2)
            if topk_weights.size(0) != x.size(0):
                raise RankLocalError(f"topk_weights: has {topk_weights.size(0)} rows, x has {x.size(0)}")
        config = self._config(config, self.get_combine_config)
        biases = _unpack_bias(bias)
        for i, b in enumerate(biases):
            if b is not None:
                V.check_tensor(b, f"bias[{i}]", V.FLOAT_DTYPES, 2)
                if tuple(b.shape) != (handle.num_tokens, x.size(1)):
                    raise RankLocalError(f"bias[{i}]: expected [{handle.num_tokens}, {x.size(1)}], got {list(b.shape)}")
        backend = self.backend
        (combined, combined_w), event = self._run(
            "combine", lambda: backend.combine(x, handle, topk_weights, biases[0], biases[1], config),
            (x, topk_weights, handle) + biases, previous_event, async_finish, allocate_on_comm_stream)
        return combined, combined_w, event

    # ---- high throughput, expert-major (ours: not in DeepEP) --------------------------------------------
    @_collective("dispatch_expert_major")
    def dispatch_expert_major(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
                              num_experts: int, config: Optional[Config] = None,
                              previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                              allocate_on_comm_stream: bool = False, num_worst_tokens: int = 0,
                              expert_capacity: int = 0):
        """Dispatch tokens straight into expert-major order: one row per (received token, local expert),
        grouped by local expert, within an expert by source rank, then source token index (the order
        `dispatch` + `permute.expert_major_map` + `permute.expand_rows` give, bit for bit). The layout is
        computed here (no get_dispatch_layout call needed); counts are exact (expert_alignment=1) unless
        `expert_capacity` is given.

        Without a host sync (CUDA-graph capturable on the native one-node backend): pass both
        `num_worst_tokens` and `expert_capacity`, as Megatron's drop-and-pad gives them. Then every
        (local expert, source rank) block has exactly `expert_capacity` rows — the source's tokens for that
        expert in token order, then zero rows — so x_em is `[num_local_experts * num_ranks *
        expert_capacity, hidden]` and tokens_per_expert is `num_ranks * expert_capacity` each, known before
        any count arrives. A source with more tokens for one expert is an error (on every rank, native).

        Arguments:
            x: `[num_tokens, hidden]` bf16/fp16/fp32 (no FP8 pairs).
            topk_idx: `[num_tokens, num_topk]` int64 (int32 accepted) expert ids, -1 for none.
            topk_weights: same shape, float32, or None.
            num_experts: all experts (divisible by the number of ranks).
            config, previous_event, async_finish, allocate_on_comm_stream: as in `dispatch`.
            num_worst_tokens: with expert_capacity: pad the receive-order outputs to this many rows (as
                `dispatch` does; em_map -1 there), so no host sync sizes them.
            expert_capacity: rows per (local expert, source rank) block (Megatron's capacity); 0: exact counts.

        Returns:
            x_em: `[sum(tokens_per_expert), hidden]` rows in expert-major order.
            recv_topk_idx: `[num_recv, num_topk]` int64 local expert ids in receive order (source rank, then
                token), -1 where the expert is elsewhere. recv_topk_weights: same shape, float32, 0 there.
                num_recv is num_worst_tokens when given.
            tokens_per_expert: Python list of per-local-expert row counts (exact, or the capacity's).
            em_map: `[num_recv, num_topk]` int32: the expert-major row of each (received row, slot), -1 for
                slots of no local expert (= permute.expert_major_map(recv_topk_idx, tokens_per_expert), or
                permute.expert_major_map_capacity with expert_capacity).
            handle: for combine_expert_major / dispatch_expert_major_cached (and combine / cached dispatch).
            event: the event after the kernels.
        """
        _check_capture("dispatch_expert_major", self.backend,
                       "" if num_worst_tokens and expert_capacity else
                       "its outputs are sized by the per-expert counts on the host; pass num_worst_tokens and "
                       "expert_capacity, or capture dispatch_expert_major_cached and combine_expert_major")
        _check_unquantized(x, "dispatch_expert_major")
        V.check_device(x, "x", self.device)
        V.check_num_experts(num_experts, self.group_size)
        V.check_topk(topk_idx, topk_weights, x.size(0))
        V.check_device(topk_idx, "topk_idx", self.device)
        V.check_device(topk_weights, "topk_weights", self.device)
        V.check_non_negative_int(num_worst_tokens, "num_worst_tokens")
        V.check_non_negative_int(expert_capacity, "expert_capacity")
        if num_worst_tokens and not expert_capacity:
            raise ValueError("num_worst_tokens: dispatch_expert_major takes it only with expert_capacity (without "
                             "a capacity the expert-major rows have no bound known before the counts)")
        config = self._config(config, self.get_dispatch_config)
        backend = self.backend

        def run():
            idx = topk_idx.to(torch.int64)
            per_rank, per_node, per_expert, in_rank = backend.get_dispatch_layout(idx, num_experts)
            return backend.dispatch_expert_major(x, idx, topk_weights, per_rank, in_rank, per_expert, config,
                                                 num_worst_tokens, expert_capacity, per_node)

        (x_em, recv_idx, recv_w, counts, em_map, handle), event = self._run(
            "dispatch_expert_major", run, (x, topk_idx, topk_weights), previous_event, async_finish,
            allocate_on_comm_stream,
            checks=lambda: V.check_expert_range(topk_idx, num_experts, self.rank),
            checked_on_device=backend.checks_expert_ids_on_device)
        return x_em, recv_idx, recv_w, counts, em_map, handle, event

    @_collective("dispatch_expert_major")
    def dispatch_expert_major_cached(self, x: torch.Tensor, handle: HTHandle, em_map: torch.Tensor,
                                     num_rows: int, config: Optional[Config] = None,
                                     previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                                     allocate_on_comm_stream: bool = False, expert_capacity: int = 0
                                     ) -> Tuple[torch.Tensor, EventOverlap]:
        """Cached expert-major dispatch: `x` moves with the layout of `handle` (no layout, no counts
        exchange) and each received row lands at the expert-major rows `em_map` names. It is the backward
        of `combine_expert_major` (autograd.combine_expert_major).

        Arguments:
            x: `[handle.num_tokens, hidden]` bf16/fp16/fp32 (no FP8 pairs).
            handle: from `dispatch_expert_major` (or `dispatch`) on this Buffer.
            em_map: `[handle.num_recv_tokens, num_topk]` int32, naming each of rows 0..num_rows-1 exactly
                once (-1 elsewhere), e.g. the one dispatch_expert_major returned.
            num_rows: rows of the result (sum of the per-expert counts).
            expert_capacity: the dispatch's (a capacity layout): em_map names each row at most once, and the
                rows it does not name are zeros.

        Returns:
            x_em `[num_rows, hidden]`, event.
        """
        _check_capture("dispatch_expert_major_cached", self.backend)
        handle = check_ht_handle(handle, self.id)
        _check_unquantized(x, "dispatch_expert_major_cached")
        V.check_device(x, "x", self.device)
        if x.size(0) != handle.num_tokens:
            raise RankLocalError(f"x: has {x.size(0)} tokens, the handle was made for {handle.num_tokens}")
        V.check_non_negative_int(num_rows, "num_rows")
        padded = self._check_capacity(expert_capacity, num_rows, "num_rows")
        V.check_expert_major_map(em_map, handle.num_recv_tokens, num_rows, "num_rows", values=False, padded=padded)
        V.check_device(em_map, "em_map", self.device)
        config = self._config(config, self.get_dispatch_config)
        backend = self.backend
        x_em, event = self._run(
            "dispatch_expert_major",
            lambda: backend.cached_dispatch_expert_major(x, handle, em_map, num_rows, config, padded),
            (x, em_map, handle), previous_event, async_finish, allocate_on_comm_stream,
            checks=lambda: V.check_expert_major_map(em_map, handle.num_recv_tokens, num_rows, "num_rows",
                                                    padded=padded))
        return x_em, event

    @_collective("combine_expert_major")
    def combine_expert_major(self, y_em: torch.Tensor, handle: HTHandle, em_map: torch.Tensor,
                             topk_weights: Optional[torch.Tensor] = None, config: Optional[Config] = None,
                             previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                             allocate_on_comm_stream: bool = False, expert_capacity: int = 0
                             ) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Combine expert-major rows: each received row's expert rows are summed (float32, slot order) and
        the sums are combined as `combine` does (float32, rank order). Equals `permute.reduce_rows` +
        `combine` (within float32-reduction tolerance on backends that fuse the two sums).

        Arguments:
            y_em: `[num_rows, hidden]` bf16/fp16/fp32 expert outputs in expert-major order.
            handle: from `dispatch_expert_major` (or `dispatch`) on this Buffer.
            em_map: `[handle.num_recv_tokens, num_topk]` int32 naming each row of y_em exactly once.
            topk_weights: `[handle.num_recv_tokens, num_topk]` float32 in receive order (not
                expert-major), reduced as in `combine`; or None.
            expert_capacity: the dispatch's (a capacity layout): em_map names each row at most once; the
                rows it does not name (padding) are not read.

        Returns:
            combined_x `[num_tokens, hidden]`, combined_topk_weights `[num_tokens, num_topk]` or None, event.
        """
        _check_capture("combine_expert_major", self.backend)
        handle = check_ht_handle(handle, self.id)
        V.check_tensor(y_em, "y_em", V.FLOAT_DTYPES, 2)
        V.check_device(y_em, "y_em", self.device)
        rows = y_em.size(0)
        padded = self._check_capacity(expert_capacity, rows, "y_em")
        V.check_expert_major_map(em_map, handle.num_recv_tokens, rows, "y_em", values=False, padded=padded)
        V.check_device(em_map, "em_map", self.device)
        if topk_weights is not None:
            V.check_tensor(topk_weights, "topk_weights", (torch.float32,), 2)
            V.check_device(topk_weights, "topk_weights", self.device)
            if topk_weights.shape != em_map.shape:
                raise RankLocalError(f"topk_weights: shape {list(topk_weights.shape)} != em_map shape "
                                     f"{list(em_map.shape)} (one weight per received row and slot, receive order)")
        config = self._config(config, self.get_combine_config)
        backend = self.backend
        (combined, combined_w), event = self._run(
            "combine_expert_major", lambda: backend.combine_expert_major(y_em, handle, em_map, topk_weights, config),
            (y_em, em_map, topk_weights, handle), previous_event, async_finish, allocate_on_comm_stream,
            checks=lambda: V.check_expert_major_map(em_map, handle.num_recv_tokens, rows, "y_em", padded=padded))
        return combined, combined_w, event

    def _check_capacity(self, expert_capacity: int, rows: int, rows_arg: str) -> bool:
        """Whether an expert-major call's rows are a capacity layout (padded): then they are whole blocks of
        expert_capacity rows per (local expert, source rank)."""
        V.check_non_negative_int(expert_capacity, "expert_capacity")
        if expert_capacity and rows % (self.group_size * expert_capacity):
            raise RankLocalError(f"{rows_arg}: {rows} rows are not whole blocks of expert_capacity={expert_capacity} "
                                 f"rows per (local expert, source rank) for {self.group_size} ranks")
        return bool(expert_capacity)

    def check_errors(self) -> None:
        """Raise RuntimeError if a kernel of this Buffer recorded an error: a wait that timed out or a buffer
        too small, on this rank or on a peer that told it (native intranode: a failing rank writes its
        report into every peer's buffer, whose kernels then stop waiting). Reads host memory, no GPU sync:
        after synchronizing, it tells whether the calls so far succeeded; the next call raises it anyway.
        A low-latency Buffer checks its LL calls' kernels and proxies too."""
        backends = [self.backend]
        if self._ll_backend is not None and self._ll_backend is not self.backend:
            backends.append(self._ll_backend)
        for backend in backends:
            try:
                backend.check_errors()
            except RuntimeError as exc:
                received = self._received_abort(backend)
                if received is not None:
                    raise RuntimeError(received) from exc
                raise

    def occupied_sms(self, config: Optional[Config] = None, expert_major: bool = False) -> Optional[dict]:
        """SMs a high-throughput call with `config` (default: the dispatch default) occupies on this rank while
        it runs: {"communication": n, "side": m, "total": n + m}. Plain dispatch / combine add no side blocks;
        the expert-major calls (`expert_major=True`) add expansion / fold blocks beside the communication
        SMs, by default every SM the call leaves free. A call completes whether or not its side blocks get an
        SM (another stream's kernel may hold them). None for backends that run torch collectives (the
        reference backend)."""
        return self.backend.occupied_sms(self._config(config, self.get_dispatch_config), expert_major)

    @property
    def expert_major_paths(self) -> dict[str, str]:
        """How the last call of each expert-major kind ran on this rank, by its method's name
        ("dispatch_expert_major", "dispatch_expert_major_cached", "combine_expert_major"): "fused" (the
        expansion / fold inside the communication kernels; across nodes, the rows stored by the dispatch
        kernels), "side_blocks" (on blocks beside them) or "permute" (a receive-order call and the separate
        permute kernels: the fallback, and the reference backend's way). Calls not made yet are absent. The
        backend decides per call from its shape and Config (docs/api.md, "Expert-major dispatch/combine")."""
        return dict(self.backend.expert_major_paths)

    def _config(self, config: Optional[Config], default: Callable[[int], Config]) -> Config:
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config: expected uccl_ep_train.Config, got {type(config).__name__}")
        return config or default(self.group_size)

    # ---- low latency -----------------------------------------------------------------------------------
    def _check_low_latency(self, what: str) -> None:
        if not self.low_latency_mode:
            raise RuntimeError(f"{what}: this Buffer was made with low_latency_mode=False")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Zero the low-latency buffers. Collective: every rank calls it; it returns once all have cleaned,
        so no rank can wipe a signal a peer is still waiting on."""
        V.check_non_negative_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank", 1)
        V.check_non_negative_int(hidden, "hidden", 1)
        V.check_num_experts(num_experts, self.group_size)
        self.low_latency_backend.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    @_collective("low_latency_dispatch")
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Low-latency dispatch into a packed per-expert layout.

        Arguments:
            x: `[num_tokens, hidden]` bf16, num_tokens <= num_max_dispatch_tokens_per_rank.
            topk_idx: `[num_tokens, num_topk]` int64, -1 for none.
            num_max_dispatch_tokens_per_rank: the same on all ranks. num_experts: all experts.
            cumulative_local_expert_recv_stats: `[num_local_experts]` int32, received counts are added to it.
            dispatch_wait_recv_cost_stats: not supported (NotImplementedError when given).
            use_fp8, round_scale, use_ue8m0: cast to FP8 e4m3 with per-128 scales (power-of-2 with
                round_scale; UE8M0 exponents packed 4 per int32 with use_ue8m0).
            async_finish: do not make the current stream wait. return_recv_hook: return at once and
                complete the receive when the returned hook is called.

        Returns:
            recv_x: `[num_local_experts, num_ranks * max_tokens, hidden]` bf16, or (fp8 data, scales with
                the last two dims column-major). recv_count: `[num_local_experts]` int32. handle (handle[0]
                src_info, handle[1] layout_range), event, hook.
        """
        self._check_low_latency("low_latency_dispatch")
        _check_capture("low_latency_dispatch", self.low_latency_backend)
        if dispatch_wait_recv_cost_stats is not None:
            raise NotImplementedError("low_latency_dispatch: dispatch_wait_recv_cost_stats is not supported")
        V.check_tensor(x, "x", (torch.bfloat16,), 2)
        V.check_device(x, "x", self.device)
        V.check_num_experts(num_experts, self.group_size)
        V.check_topk(topk_idx, None, x.size(0))
        if V.host_value_checks(self.low_latency_backend.checks_values_on_device):
            V.check_expert_range(topk_idx, num_experts, self.rank)
        V.check_non_negative_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank", 1)
        if x.size(0) > num_max_dispatch_tokens_per_rank:
            raise RankLocalError(f"x: {x.size(0)} tokens exceed num_max_dispatch_tokens_per_rank "
                                 f"({num_max_dispatch_tokens_per_rank})")
        if use_fp8 and x.size(1) % FP8_BLOCK:
            raise ValueError(f"x: hidden ({x.size(1)}) must be divisible by {FP8_BLOCK} for use_fp8")
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise ValueError("use_ue8m0: requires use_fp8=True and round_scale=True")
        if use_ue8m0 and x.size(1) % (4 * FP8_BLOCK):
            raise ValueError(f"x: hidden ({x.size(1)}) must be divisible by {4 * FP8_BLOCK} for use_ue8m0")
        if round_scale and not use_fp8:
            raise ValueError("round_scale: requires use_fp8=True")
        if cumulative_local_expert_recv_stats is not None:
            V.check_tensor(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats", (torch.int32,), 1)
            if cumulative_local_expert_recv_stats.numel() != num_experts // self.group_size:
                raise ValueError(f"cumulative_local_expert_recv_stats: expected [{num_experts // self.group_size}], "
                                 f"got {list(cumulative_local_expert_recv_stats.shape)}")
        self._check_rdma_size(num_max_dispatch_tokens_per_rank, x.size(1), num_experts)
        topk_idx = topk_idx.to(torch.int64)
        backend = self.low_latency_backend
        stats = cumulative_local_expert_recv_stats

        def run():
            return backend.low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                                                round_scale, use_ue8m0, stats, return_recv_hook)

        (recv_x, recv_scales, recv_count, handle, receive), event = self._run(
            "low_latency_dispatch", run, (x, topk_idx), None, async_finish, False)
        hook = self._hook("low_latency_dispatch", receive) if return_recv_hook else (lambda: None)
        return (recv_x, recv_scales) if use_fp8 else recv_x, recv_count, handle, event, hook

    @_collective("low_latency_combine")
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """Low-latency combine: each token gets the weighted sum of its experts' outputs.

        Arguments:
            x: `[num_local_experts, num_ranks * max_tokens, hidden]` bf16 expert outputs in dispatch's layout.
            topk_idx, topk_weights: `[num_tokens, num_topk]` int64 / float32, as given to dispatch.
            handle: from `low_latency_dispatch`. zero_copy: read x from `get_next_low_latency_combine_buffer`.
            out: optional `[num_tokens, hidden]` bf16 result tensor. use_logfmt and
                combine_wait_recv_cost_stats are not supported (NotImplementedError).

        Returns:
            combined_x `[num_tokens, hidden]` bf16, event, hook.
        """
        self._check_low_latency("low_latency_combine")
        _check_capture("low_latency_combine", self.low_latency_backend)
        if use_logfmt:
            raise NotImplementedError("low_latency_combine: use_logfmt is not supported")
        if combine_wait_recv_cost_stats is not None:
            raise NotImplementedError("low_latency_combine: combine_wait_recv_cost_stats is not supported")
        handle = check_low_latency_handle(handle, self.id)
        backend = self.low_latency_backend
        if zero_copy:
            x = backend.low_latency_combine_buffer(handle)
        num_local = handle.num_experts // self.group_size
        shape = (num_local, self.group_size * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        V.check_tensor(x, "x", (torch.bfloat16,), 3)
        if tuple(x.shape) != shape:
            raise ValueError(f"x: expected {list(shape)}, got {list(x.shape)}")
        if topk_weights is None:
            raise ValueError("topk_weights: required, low-latency combine reduces with the top-k weights")
        V.check_topk(topk_idx, topk_weights, topk_idx.size(0) if isinstance(topk_idx, torch.Tensor) else -1)
        if V.host_value_checks(backend.checks_values_on_device):
            V.check_expert_range(topk_idx, handle.num_experts, self.rank)
        if topk_idx.size(0) > handle.num_max_dispatch_tokens_per_rank:
            raise RankLocalError(f"topk_idx: {topk_idx.size(0)} tokens exceed the handle's maximum "
                                 f"{handle.num_max_dispatch_tokens_per_rank}")
        if out is None:
            out = torch.empty((topk_idx.size(0), handle.hidden), dtype=torch.bfloat16, device=x.device)
        else:
            V.check_tensor(out, "out", (torch.bfloat16,), 2)
            if tuple(out.shape) != (topk_idx.size(0), handle.hidden):
                raise RankLocalError(f"out: expected [{topk_idx.size(0)}, {handle.hidden}], got {list(out.shape)}")
        topk_idx = topk_idx.to(torch.int64)

        def run():
            return backend.low_latency_combine(x, topk_idx, topk_weights, handle, out, return_recv_hook)

        receive, event = self._run("low_latency_combine", run, (x, topk_idx, topk_weights, handle), None,
                                   async_finish, False)
        hook = self._hook("low_latency_combine", receive) if return_recv_hook else (lambda: None)
        return out, event, hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The buffer a `zero_copy=True` combine reads: `[num_local_experts, num_ranks * max_tokens, hidden]`
        bf16; fill it with the expert outputs yourself."""
        handle = check_low_latency_handle(handle, self.id)
        return self.low_latency_backend.low_latency_combine_buffer(handle)

    def _hook(self, op: str, receive: Callable[[], None]) -> Callable[[], None]:
        """The recv hook: launches the receive where the Buffer's calls run (as DeepEP: the current stream,
        like the send of a call without async_finish, unless the Buffer moved to its comm stream, which the
        current stream then waits for); a second call does nothing."""
        done = []

        def hook() -> None:
            if not done:
                self._run(op, receive, (), None, False, False)
                done.append(True)

        return hook

    def _check_rdma_size(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        need = self.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, self.group_size,
                                                   num_experts)
        if self.num_rdma_bytes < need:
            raise ValueError(f"num_rdma_bytes: this Buffer has {self.num_rdma_bytes} bytes, low-latency mode with "
                             f"{num_max_dispatch_tokens_per_rank} tokens x hidden {hidden} x {num_experts} experts "
                             f"needs {need} (Buffer.get_low_latency_rdma_size_hint)")


def _check_unquantized(x: Any, what: str) -> None:
    """x of an expert-major call: a bf16/fp16/fp32 tensor (the fused copy-out has no FP8 scales path)."""
    if isinstance(x, (tuple, list)) or (isinstance(x, torch.Tensor) and x.dtype in V.FP8_DTYPES):
        raise TypeError(f"x: {what} takes bf16/fp16/fp32 tokens; FP8 input (an (e4m3, scales) pair or an e4m3 "
                        f"tensor) is not supported here: use dispatch() with expert_alignment=1 and "
                        f"permute.expand_rows")
    V.check_tensor(x, "x", V.FLOAT_DTYPES, 2)


def _unpack_bias(bias) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    if bias is None:
        return None, None
    if isinstance(bias, torch.Tensor):
        return bias, None
    if isinstance(bias, (tuple, list)) and len(bias) <= 2:
        b = tuple(bias) + (None,) * (2 - len(bias))
        return b[0], b[1]
    raise ValueError("bias: expected None, a tensor or a pair of tensors")


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor inside nested tuples/lists/handles (for stream bookkeeping)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _tensors(item)]
    return []
