"""The native backend: our CUDA/HIP kernels (`uccl_ep_train._native`) over IPC-shared NVLink/xGMI buffers.

Intranode high-throughput path (docs/intranode.md, the push plan):
- every rank owns one device buffer (`num_nvl_bytes`, grown collectively when a call needs more) whose
  IPC handle is exchanged over torch.distributed; every rank maps every other rank's buffer;
- `notify` pushes this rank's per-rank / per-expert counts into every peer's buffer, so each rank knows
  the global rank prefix matrix, i.e. the exact receive row of each of its tokens on each rank;
- `dispatch` pushes each token once per destination rank straight into that row of the receiver's buffer
  (16-byte vector stores over NVLink; rows for the own rank go straight into the output), one barrier
  (per-block arrival counters), then the receiver copies its rows out into fresh tensors;
- `combine` mirrors it: rows go back into the source's buffer at the same positions, and the source sums
  them per token in float32 (rank order, then bias_0, bias_1), like the reference backend.
No queues, no data atomics, deterministic order, bit-exact with `reference` for dispatch.

The receive size needs one device-to-host copy of the counts unless `num_worst_tokens` is given: then the
whole call is CPU-sync free (outputs padded to num_worst_tokens; handle's num_recv_tokens is
num_worst_tokens, as the combine input has that many rows). Such a dispatch, cached dispatch and combine
can be captured in a CUDA graph: the kernels read their signal base from the buffer, not from arguments.
Values the host would read back (expert ids, counts against the mask, the ranks' shapes without a host
sync) are checked by the kernels and reported like timeouts.

Waits inside kernels have a deadline (UCCL_EP_TIMEOUT_S); a kernel that times out records rank, peer,
block and phase in host-mapped memory, and the next call on this backend raises with that message.
Low-latency mode is not implemented here: Buffer falls back to the reference backend for it.
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .. import permute, sizing
from ..config import Config, timeout_s
from ..errors import ranks_disagree
from ..events import capturing, current_raw_stream
from ..handles import IntranodeHandle, rows_per_source
from ..topology import MAX_RANKS_PER_NODE, native_limit
from .base import FUSED, PERMUTE, SIDE_BLOCKS, Backend, WithoutLowLatency

log = logging.getLogger("uccl_ep_train")

# Of the 16 warps of a block, how many push; the others copy landed rows out (dispatch) or reduce landed
# rows (combine) while the pushes go on, and push warps join them when done. For the combine, the more
# blocks, the fewer push warps keep NVLink busy: (up to this many SMs, push warps). `bench intranode --sms
# 16,24,32 --push-warps 2,3,4,6,8,12`, 2xH200, DeepSeek-V3 shape, combine kernel us: 280/223/226 at
# 16/24/32 SMs with 8/6/4 push warps, 280/271-275/244-247 with 8 (confirmed twice: 283-291/219-224/224-229). The
# dispatch keeps 12: 8 was within the runs' ~10% spread for BF16 and slower for FP8 at 16-24 SMs (153 vs
# 135 us at 24). benchmarks/results/intranode_2xH200_push_warps.json.
_DISPATCH_PUSH_WARPS = 12
_COMBINE_PUSH_WARPS = ((16, 8), (24, 6), (1 << 30, 4))
# Fold mode: every warp folds and pushes first (the fold's reads, not the reduce, bound it; 2xH200, 32 SMs,
# fused fold+combine: 731 us with 8 push warps, 581 with 12, 517 with 16)
_FOLD_PUSH_WARPS = 16
# Rows a push warp sends between two system fences (after which it releases their "landed" flags): small
# batches let the receiver start copying / reducing early, large ones fence less often. Config.flag_batch /
# Config.combine_flag_batch override them, as Config.dispatch_push_warps / combine_push_warps the push warps.
_FLAG_BATCH = 4
_COMBINE_FLAG_BATCH = 4
_COMBINE_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
# Expert-major rows per received row (the fold width) up to which the expert-major calls expand / fold inside
# the communication kernels; wider rows go through the separate full-GPU permute kernels, except that the
# dispatches fuse from _FUSE_DISPATCH_MIN_SMS SMs on and the combine from _FUSE_COMBINE_MIN_SMS (the fold
# reads ~width rows per pushed row: HBM-bound on few SMs). `uccl-ep-train bench expert-major --sms
# 20,32,64,132`, 2xH200, DeepSeek-V3 shape at EP=2 (width ~4), fused/separate us: fresh dispatch 761/936,
# 595/820, 596/838, 400/527 (host-bound, noisy); cached 518/418, 338/396, 292/371, 250/356; combine 825/428,
# 525/411, 378/375, 319/374 (benchmarks/results/expert_major_2xH200.json). At width ~1 (EP >= 8) fusing
# moves no extra bytes and saves the pass. Config.fuse_max_width replaces the rule: fuse up to that width.
_FUSE_MAX_WIDTH = 2.0
_FUSE_DISPATCH_MIN_SMS = 32
_FUSE_COMBINE_MIN_SMS = 64
_MAX_FUSED_TOPK = 32  # kMaxExpertMajorTopk (csrc/kernels/intranode_api.h): one warp lane per top-k slot
# Wide rows expand / fold on side blocks beside the kernel's num_sms in the same launch (the GPU's remaining
# SMs): expand blocks write the dispatch's expert-major rows as rows land, fold blocks form each row the
# combine pushes just before it is pushed, so the permute overlaps the NVLink transfer instead of preceding /
# following it (separate kernels) or slowing the push / copy-out warps (fused). Config.expand_blocks /
# Config.fold_blocks override the count (0: none). `bench expert-major --sms
# 16,24,32,64 --iters 30`, 2xH200, DeepSeek-V3 shape at EP=2 (width ~4), us, separate / fused / side blocks:
# fresh dispatch 617/808/451, 610/601/407, 547/464/337, 512/402/366; cached 413/621/253, 419/437/215,
# 395/338/205, 362/283/249; combine 429/1026/373, 393/711/299, 383/540/299, 366/380/298
# (benchmarks/results/expert_major_side_blocks_2xH200.json). Fewer than _MIN_SIDE_BLOCKS free SMs: as
# before (_fuse). _MAX_FOLD_ROWS: kMaxFlagRows (device_utils.cuh).
_MIN_SIDE_BLOCKS = 8
_MAX_FOLD_ROWS = 1 << 20


def _module():
    from .. import _native  # noqa: PLC0415 (optional extension)

    return _native


def module_serves(kernels: str) -> bool:
    """True when the native module loads, was built with `kernels` (its buffer class: IntranodeBuffer,
    InternodeBuffer, LowLatencyBuffer) and a CUDA/HIP GPU is visible."""
    try:
        m = _module()
    except ImportError:
        return False
    return hasattr(m, kernels) and torch.cuda.is_available()


def native_available() -> bool:
    """True when the native module has the intranode kernels and a CUDA/HIP GPU is visible."""
    return module_serves("IntranodeBuffer")


# Appended to a timeout when the proxies copy GPU memory through the CUDA runtime (the fabric transport on
# libfabric's shm or tcp, or efa without GPUDirect RDMA) and no proxy error explains it: the likely causes
# there (events.host_values has the measurement of the first; proxy.warn_single_connection of the second).
PAGEABLE_COPY_HINT = ("the proxies' transport copies GPU memory through the CUDA runtime (fabric on shm, or a NIC "
                      "without GPUDirect RDMA), so a likely cause is a host copy into or out of pageable memory "
                      "(tensor.to('cuda'), .cpu(), .tolist(), .item()) issued while this call's kernels ran: it "
                      "holds those copies back until "
                      "the kernels time out; copy through pinned memory (pin_memory(), non_blocking=True), or await "
                      "an event on the stream first; with CUDA_DEVICE_MAX_CONNECTIONS=1 the copies can also wait "
                      "behind the kernels themselves: leave it unset where you can (docs/internode.md, \"Host copies "
                      "and the fabric transport\")")


def recorded_errors(buf, proxy, raised: str = "") -> str:
    """What a native buffer's kernels (else `raised`: the error of a host wait) and its proxies (None: none)
    recorded, joined; "" when nothing. A timeout on proxies that copy through the CUDA runtime, with no proxy
    error to explain it, names the likely cause (PAGEABLE_COPY_HINT)."""
    msgs = [buf.error() or raised]
    if proxy is not None:
        try:
            proxy.check()
        except RuntimeError as exc:  # a rejected command or a dead transport, often the cause of a timeout
            msgs.append(f"proxy: {exc}")
        if len(msgs) == 1 and "timed out" in msgs[0]:  # no cause recorded
            msgs.append(proxy.state_line())
            if proxy.calls_gpu_runtime:
                msgs.append(PAGEABLE_COPY_HINT)
    return "; ".join(m for m in msgs if m)


def native_problem() -> str:
    """Why the native kernels cannot serve this machine's GPUs ("" when they can, or when there is no GPU):
    the module does not import, was built without GPU kernels, or for targets the GPUs cannot run."""
    if not torch.cuda.is_available():
        return ""
    try:
        m = _module()
    except ImportError as exc:
        return f"the native module does not import ({exc}); rebuild it: python setup.py build_ext --inplace"
    if not hasattr(m, "IntranodeBuffer"):
        return ("the native module was built without GPU kernels (no nvcc / hipcc found at build time); install "
                "the CUDA toolkit or ROCm and rebuild: python setup.py build_ext --inplace")
    archs = [a for a in str(getattr(m, "GPU_ARCHS", "")).split(",") if a]
    if getattr(m, "WITH_CUDA", False) and archs:
        cap = torch.cuda.get_device_capability()
        have = cap[0] * 10 + cap[1]
        built = sorted(int(a) for a in archs if a.isdigit())
        # cubins run on their own major architecture at the same or a newer minor; PTX of the newest on newer GPUs
        if built and not any(b // 10 == have // 10 and b <= have for b in built) and have < built[-1]:
            return (f"the native kernels were built for sm_{','.join(map(str, built))}, this GPU is sm_{have}; "
                    f"rebuild with UCCL_EP_CUDA_ARCHS={have}")
    return ""


# A fresh dispatch's shape as notify carries it to every rank (intranode and internode): the native module's
# INTRANODE_SHAPE_FIELDS name its ints. The ranks must agree on all of it but the token count: else they write
# rows of different sizes, or id words of different formats, into each other's buffers.
_X_DTYPES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float8_e4m3fn: 4, torch.float8_e4m3fnuz: 5}


def shape_header(x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], num_experts: int, expert_capacity: int = 0,
                 expert_major_ids: bool = False) -> list[int]:
    """The call's shape (the native module's INTRANODE_SHAPE_FIELDS): the header notify carries. The top-k
    format is 1 with topk_weights, plus 2 when the id words carry expert-major positions (a fresh expert-major
    dispatch that expands inside the kernel: its receivers must expect them, see _expand_plan)."""
    top_k_format = int(topk_weights is not None) + 2 * int(expert_major_ids)
    return [x.size(0), x.size(1) * x.element_size(), 0 if x_scales is None else x_scales.size(1) * 4,
            0 if topk_idx is None else topk_idx.size(1), top_k_format, num_experts,
            _X_DTYPES.get(x.dtype, 0), int(expert_capacity)]


def _combine_row_bytes(x: torch.Tensor) -> int:
    """Bytes of a row the combine of a dispatch of `x` sends back (FP8 and BF16 rows come back BF16)."""
    return x.size(1) * (4 if x.dtype == torch.float32 else 2)


def check_same_shape(per_rank: list) -> None:
    """Raises the same ValueError on every rank (each passes every rank's header) unless they agree."""
    for i, name in enumerate(_module().INTRANODE_SHAPE_FIELDS):
        values = [int(h[i]) for h in per_rank]
        if name != "num_tokens" and len(set(values)) > 1:
            raise ValueError(ranks_disagree("dispatch", name, values))


def quiesce(device: torch.device, group) -> None:
    """Before a native backend releases its buffers: this rank's kernels are done and, after the barrier,
    every peer's too, so nobody still writes into (or reads from) them."""
    torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier(group=group)


class SharesMemoryWithPeers:
    """Mixin for the native backends (before Backend): peers map this rank's buffers (IPC) or write into them
    (proxies), so an orderly destroy() first waits until no rank uses them; release() is the local part."""

    def destroy(self) -> None:
        if self._buf is None:
            return
        try:
            quiesce(self.device, self.group)
        finally:
            self.release()


class RaisesRecordedErrors:
    """Mixin for the native backends: the first error their kernels or proxies recorded (timeout, capacity,
    ring full, rejected command) makes the backend unusable, every later call raising it (peers may have
    moved on: nothing it holds can be trusted). Uses `_buf` (None once destroyed), `_proxy` (None: no
    proxies) and `_failed`; `error_prefix` names the backend in the messages."""

    error_prefix = "native backend"
    _proxy = None
    _failed: Optional[str] = None

    def _check_usable(self) -> None:
        """Raises when an earlier call failed or the backend was destroyed; reads no record. A fresh dispatch
        starts with this alone: whether a peer's record is visible here yet depends on timing, and a rank
        that raised on it while its peers go into a collective grow would leave them waiting there; the
        records are read once the grow's agreement ran (_quiesce_before_grow) or it was not needed."""
        if self._failed is not None:
            raise RuntimeError(f"{self.error_prefix}: unusable after an earlier error: {self._failed}")
        if self._buf is None:
            raise RuntimeError(f"{self.error_prefix}: destroyed")

    def _check(self) -> None:
        self._check_usable()
        msg = recorded_errors(self._buf, self._proxy)
        if msg:
            self._failed = msg
            raise RuntimeError(f"{self.error_prefix}: {msg}")

    def check_errors(self) -> None:
        """Raise if a kernel or a proxy thread recorded an error; cheap (reads host memory)."""
        self._check()

    def _quiesce_before_grow(self) -> None:
        """quiesce, then one verdict on every rank about the errors recorded so far. A grow replaces the buffers
        that hold the error record: an error an earlier kernel recorded without a host sync (a bad expert id
        the layout kernel found with the host's value checks off, a refused capacity) would be dropped with
        them, and the call would go on without the rows it refused. So every rank's record is gathered (a
        grow's host exchange; grows are rare) and, if any rank has one, every rank raises before anything is
        released: its own error, or the first rank's."""
        quiesce(self.device, self.group)
        mine = recorded_errors(self._buf, self._proxy)
        per_rank: list = [mine]
        if dist.is_initialized():  # (no rank raises before the gather: its peers would wait in it)
            per_rank = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(per_rank, mine, group=self.group)
        first = next(((r, m) for r, m in enumerate(per_rank) if m), None)
        if first is not None:
            self._failed = mine or f"rank {first[0]} recorded an error before the buffers could grow: {first[1]}"
            raise RuntimeError(f"{self.error_prefix}: {self._failed}")

    def recorded_error(self) -> Optional[str]:
        return self._failed

    def abort(self, op: str) -> bool:
        """Writes this rank's aborted record into every node peer's buffer (the native buffer's abort: the copy
        engine, bounded); the backend is unusable afterwards, like after any recorded error."""
        if self._buf is None:
            return False
        if self._proxy is not None:  # the other nodes, through the proxies (before the slower copies)
            self._proxy.abort(op)
        self._buf.abort(op)
        if self._failed is None:
            self._failed = f"this rank aborted '{op}'"
        return True

    def aborted_by(self) -> Optional[tuple[int, str]]:
        if self._buf is None:
            return None
        rank, op = self._buf.abort_source()
        return (int(rank), str(op)) if rank >= 0 else None


def abort_sentence(rank: int, op: str, message: Optional[str]) -> str:
    """What a rank raises when `rank` aborted `op` (`message`: the text it raised; None: not known here)."""
    return _module().rank_aborted(rank, op, message or "")


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def refuse_in_capture(backend: str, why: str) -> None:
    """Raises inside CUDA-graph capture: `why` names what the call would do on the host (checked before any
    kernel of the call was captured: the Buffer stays usable)."""
    if capturing():
        raise RuntimeError(f"{backend}: {why}")


def refuse_grow_in_capture(backend: str, what: str, size_args: str) -> None:
    """A buffer grow is collective and host-side: inside capture the call raises, naming the Buffer arguments
    that make it unnecessary."""
    refuse_in_capture(backend, f"{what} for this call, which cannot happen inside CUDA-graph capture (it is "
                      f"collective); make the Buffer with {size_args} at least that large, or run the call once "
                      "before capturing")


@dataclass
class NativeHandleState:
    """Backend-private part of an IntranodeHandle (the device-side layout lives in the handle's tensors:
    rank_prefix_matrix and send_head)."""

    out_rows: int  # rows of dispatch outputs (num_recv_tokens, or num_worst_tokens)
    max_recv_rows: int  # the largest receive of any rank (buffer rows a dispatch needs)
    max_send_rows: int  # the largest number of rows any rank sent (buffer rows a combine needs)
    worst: bool


class NativeBackend(SharesMemoryWithPeers, RaisesRecordedErrors, WithoutLowLatency, Backend):
    name = "native"
    # Capture-safe: the kernels read their signal base from the buffer (OpSeq in device_utils.cuh), not from
    # arguments, so replays stay in step with the peers; only growing the buffer (host + collective) is refused.
    capture_refusal = ""
    checks_values_on_device = True  # layout: expert ids; notify: counts against the mask (and shapes)

    def __init__(self, group, rank, num_ranks, owner, num_nvl_bytes, num_rdma_bytes, device=None):
        super().__init__(group, rank, num_ranks, owner, num_nvl_bytes, num_rdma_bytes)
        self._native = _module()
        self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        max_ranks = native_limit(self._native, "INTRANODE_MAX_RANKS", MAX_RANKS_PER_NODE)
        if num_ranks > max_ranks:
            raise ValueError(f"native intranode backend: at most {max_ranks} ranks on one node, got {num_ranks}; "
                             "set UCCL_EP_RANKS_PER_NODE to the ranks of one NVLink domain")
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        hosts_sms: list = [None] * num_ranks  # (the ranks' settings agree: Buffer checked them, agreement.py)
        dist.all_gather_object(hosts_sms, (socket.gethostname(), sms), group=group)
        hosts = [h for h, _ in hosts_sms]
        if len(set(hosts)) > 1:
            raise ValueError(f"native intranode backend: ranks span several hosts ({sorted(set(hosts))}) but "
                             "UCCL_EP_RANKS_PER_NODE / LOCAL_WORLD_SIZE put them on one node")
        self._timeout = float(timeout_s())
        from ..gpu_sharing import check_gpu_sharing, comm_sms_share

        # ranks sharing a GPU (under MPS) wait for each other inside the kernels: each takes only its share of
        # the SMs (side blocks included), so that every rank's blocks are resident at once
        per_gpu = check_gpu_sharing(group, self.device, "the native backend")
        # the fewest of any rank: SM-derived choices that change the wire format (expand blocks) must agree
        self._device_sms = comm_sms_share(min(s for _, s in hosts_sms), per_gpu)
        self._pinned: Optional[torch.Tensor] = None  # notify's counts on the host (see _host_counts)
        self._copied: Optional[torch.cuda.Event] = None  # marks their copy (see _exchange_counts)
        self._failed: Optional[str] = None
        self._buf = None
        # header (counts, row flags: ~9 MiB) + a first data region; grows on demand (uccl_ep_train.sizing)
        self._open(max(int(num_nvl_bytes), sizing.MIN_BYTES))

    # ---- buffer lifetime -----------------------------------------------------------------------------
    def _open(self, nbytes: int) -> None:
        with torch.cuda.device(self.device):
            buf = self._native.IntranodeBuffer(self.device.index, self.rank, self.num_ranks, int(nbytes), self._timeout)
            handles: list = [None] * self.num_ranks
            dist.all_gather_object(handles, buf.ipc_handle(), group=self.group)
            buf.open_peers(handles)
        self._buf = buf
        self._nbytes = int(nbytes)

    def _grow(self, new_bytes: int) -> None:
        """Collective: every rank calls it with the same size (decided from globally known counts)."""
        if self.rank == 0:
            log.warning("uccl_ep_train native: growing the NVLink buffer from %d to %d bytes (pass "
                        "num_nvl_bytes >= %d to avoid this)", self._nbytes, new_bytes, new_bytes)
        self._quiesce_before_grow()  # nobody still reads or writes the old buffers; no error recorded in them
        old = self._buf
        self._buf = None
        old.destroy()
        self._open(new_bytes)

    def _ensure(self, rows: int, x_bytes: int, scale_bytes: int, num_topk: int, with_src: bool) -> None:
        new_bytes = sizing.intranode_grow_to(self._nbytes, rows, x_bytes, scale_bytes, num_topk, with_src)
        if new_bytes is not None:
            refuse_grow_in_capture(self.error_prefix, f"the NVLink buffer ({self._nbytes} bytes) must grow to "
                                   f"{new_bytes} bytes", "num_nvl_bytes")
            self._grow(new_bytes)

    def release(self) -> None:
        if self._buf is None:
            return
        torch.cuda.synchronize(self.device)  # this rank's kernels still using the buffer
        buf, self._buf = self._buf, None
        buf.destroy()

    @staticmethod
    def _stream() -> int:
        return current_raw_stream()

    def _push_warps(self, chosen: Optional[int], default: int) -> int:
        """Warps per block that push (the others copy out / reduce from the start): the Config's `chosen`, else
        `default`, at most the block's warps."""
        total = int(getattr(self._native, "INTRANODE_WARPS_PER_BLOCK", 16))
        if chosen is None:
            chosen = max(1, round(default * total / 16))  # defaults are for 16 warps (32-wide); HIP has 8
        return min(chosen, total)

    def _num_sms(self, config: Config) -> int:
        """The call's SMs: its Config's (Buffer resolves a missing one to its defaults), at most this rank's share."""
        return max(1, min(config.num_sms, self._device_sms))

    # ---- layout --------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts):
        self._check()
        topk_idx = topk_idx.to(torch.int64).contiguous()
        n, k = topk_idx.shape
        counts = torch.zeros(self.num_ranks + num_experts, dtype=torch.int32, device=topk_idx.device)  # one fill
        per_rank, per_expert = counts[: self.num_ranks], counts[self.num_ranks:]
        in_rank = torch.empty((n, self.num_ranks), dtype=torch.bool, device=topk_idx.device)
        self._buf.dispatch_layout(topk_idx.data_ptr(), n, k, num_experts, per_rank.data_ptr(), per_expert.data_ptr(),
                                  in_rank.data_ptr(), self._stream())
        return per_rank, None, per_expert, in_rank  # (one node)

    # ---- dispatch ------------------------------------------------------------------------------------
    def _host_counts(self, size: int) -> torch.Tensor:
        """A pinned int32 host buffer of `size` for notify's counts (kept: one per backend; each call reads
        it back into Python ints before the next copy is queued)."""
        if self._pinned is None or self._pinned.numel() < size:
            self._pinned = torch.empty(size, dtype=torch.int32, pin_memory=True)
        return self._pinned[:size]

    def _exchange_counts(self, n: int, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                         num_worst_tokens: int, shape: list[int], num_max_tokens_per_rank: int = 0,
                         y_bytes: int = 0) -> "_Counts":
        """notify (per-rank / per-expert counts and the call's `shape` into every peer), then, unless
        num_worst_tokens bounds the receive, the one host sync that sizes the outputs and checks that the
        ranks agree on the shape (the same error on every rank: each reads every rank's). With
        num_worst_tokens the buffer is sized before notify (`y_bytes`: the combine's row bytes): a grow
        replaces the buffer and with it the error record notify writes (capacity, shape, worst tokens)."""
        R, me = self.num_ranks, self.rank
        dev = is_token_in_rank.device
        is_token_in_rank = is_token_in_rank.to(torch.bool).contiguous()
        per_rank = num_tokens_per_rank.to(torch.int32).contiguous()
        per_expert = num_tokens_per_expert.to(torch.int32).contiguous()
        num_experts = per_expert.numel()
        epr = num_experts // R
        fields = self._native.INTRANODE_SHAPE_FIELDS
        if num_worst_tokens:
            # Sized from what every rank passes alike (num_worst_tokens, the capacity, num_max_tokens_per_rank),
            # never from this rank's token count: a grow must be every rank's or none's (the kernels check the
            # real counts against the buffer and report instead of overflowing). Before notify: after it, a
            # grow would drop the error notify records (the dispatch would then move the refused rows).
            max_recv = int(num_worst_tokens)
            max_send = sizing.worst_send_rows(max_recv, R, epr, shape[fields.index("expert_capacity")],
                                              num_max_tokens_per_rank)
            for need in sizing.intranode_dispatch_needs(max_recv, max_send, shape[fields.index("x row bytes")],
                                                        shape[fields.index("FP8 scale bytes")],
                                                        shape[fields.index("num_topk")], y_bytes):
                self._ensure(*need)
        self._check()  # every rank grew (and agreed on the records first) or none did
        send_pos = torch.empty((n, R), dtype=torch.int32, device=dev)
        # rank prefix matrix [R*R], per-local-expert counts [epr], expert-major bases [R*epr], and the handle's
        # one-channel matrices [R] + [R] (notify writes them all: no further launches before the host sync)
        o = R * R + epr + R * epr
        S = int(self._native.INTRANODE_SHAPE_INTS)  # then every rank's shape
        info = torch.empty(o + 2 * R + R * S, dtype=torch.int32, device=dev)
        self._buf.notify(per_rank.data_ptr(), per_expert.data_ptr(), is_token_in_rank.data_ptr(), n, num_experts,
                         send_pos.data_ptr(), info.data_ptr(), int(num_worst_tokens), shape, self._stream())
        c = _Counts(send_pos, info, per_rank, is_token_in_rank, epr,
                    (info[o: o + R].view(R, 1), info[o + R: o + 2 * R].view(R, 1)))
        if num_worst_tokens:
            c.out_rows = c.max_recv = max_recv
            c.max_send = max_send
            return c
        # the one host sync (into pinned memory, waiting on an event): it sizes the outputs (plain ints from here)
        counts = self._host_counts(info.numel())
        counts.copy_(info, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()  # one per backend, re-recorded per call (awaited right away)
        self._copied.record()
        self._copied.synchronize()
        host = counts.tolist()
        self._check()
        check_same_shape([host[o + 2 * R + s * S: o + 2 * R + (s + 1) * S] for s in range(R)])
        last = host[(R - 1) * R: R * R]  # prefix over source ranks: rows each rank receives in all
        c.out_rows, c.max_recv = last[me], max(last)
        # rows source s sends in all = row s of the prefix matrix minus row s - 1, summed over receivers
        c.max_send = max(sum(host[s * R: (s + 1) * R]) - (sum(host[(s - 1) * R: s * R]) if s else 0)
                         for s in range(R))
        c.per_expert = host[R * R: R * R + epr]
        return c

    def _launch_dispatch(self, x, x_bytes, x_scales, scale_bytes, topk_idx, topk_weights, flags, num_topk, epr,
                         send_pos, rank_prefix, recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx,
                         out_rows, config, em_x=None, em_map=None, topk_pos=None, em_base=None, em_rows=0,
                         expand_blocks=0) -> None:
        self._buf.dispatch(
            x.data_ptr(), x_bytes, _ptr(x_scales), scale_bytes, _ptr(topk_idx), _ptr(topk_weights), flags, num_topk,
            epr, x.size(0), send_pos.data_ptr(), rank_prefix.data_ptr(), _ptr(recv_x), _ptr(recv_scales),
            _ptr(recv_topk_idx), _ptr(recv_topk_weights), _ptr(recv_src_idx), out_rows, _ptr(em_x), _ptr(em_map),
            _ptr(topk_pos), _ptr(em_base), 0 if em_map is None else em_map.size(1), int(em_rows), expand_blocks,
            self._num_sms(config), self._push_warps(config.dispatch_push_warps, _DISPATCH_PUSH_WARPS),
            config.flag_batch or _FLAG_BATCH, self._stream())

    def _handle(self, c: "_Counts", recv_src_idx, n: int, worst: bool) -> IntranodeHandle:
        R = self.num_ranks
        return IntranodeHandle.with_one_channel(
            c.info[: R * R].view(R, R), c.per_rank, self.rank, recv_src_idx, c.is_token_in_rank, c.send_pos,
            num_recv_tokens=c.out_rows, num_tokens=n, owner=self.owner,
            private=NativeHandleState(c.out_rows, c.max_recv, c.max_send, worst), channels=c.channels)

    def dispatch(self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert, expert_alignment, num_worst_tokens, config, num_tokens_per_rdma_rank,
                 num_max_tokens_per_rank=0):
        self._check_usable()  # (the records: _exchange_counts, after a sync-free grow)
        x = _aligned(x)
        n = x.size(0)
        if x_scales is not None:
            x_scales = x_scales.to(torch.float32).contiguous()
        if topk_idx is not None:
            topk_idx = topk_idx.to(torch.int64).contiguous()
            if topk_weights is not None:
                topk_weights = topk_weights.to(torch.float32).contiguous()
        c = self._exchange_counts(n, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, num_worst_tokens,
                                  shape_header(x, x_scales, topk_idx, topk_weights, num_tokens_per_expert.numel()),
                                  num_max_tokens_per_rank, y_bytes=_combine_row_bytes(x))
        per_expert_list = [_align_up(v, expert_alignment) for v in c.per_expert]
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = self._dispatch_rows(
            x, x_scales, topk_idx, topk_weights, c, config)
        handle = self._handle(c, recv_src_idx, n, bool(num_worst_tokens))
        return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle

    def _dispatch_rows(self, x, x_scales, topk_idx, topk_weights, c: "_Counts", config):
        """The dispatch kernel after notify, rows in receive order -> (recv_x, recv_scales, recv_topk_idx,
        recv_topk_weights, recv_src_idx)."""
        dev, (out_rows, hidden) = x.device, (c.out_rows, x.size(1))
        x_bytes = hidden * x.element_size()
        scale_bytes = 0 if x_scales is None else x_scales.size(1) * 4
        with_topk = topk_idx is not None
        num_topk = topk_idx.size(1) if with_topk else 0
        for need in sizing.intranode_dispatch_needs(c.max_recv, c.max_send, x_bytes, scale_bytes, num_topk,
                                                    _combine_row_bytes(x)):
            self._ensure(*need)  # its receive rows, then its combine's rows
        recv_x = torch.empty((out_rows, hidden), dtype=x.dtype, device=dev)
        recv_scales = None if x_scales is None else torch.empty((out_rows, x_scales.size(1)), dtype=torch.float32,
                                                                device=dev)
        recv_topk_idx = torch.empty((out_rows, num_topk), dtype=torch.int64, device=dev) if with_topk else None
        recv_topk_weights = torch.empty((out_rows, num_topk), dtype=torch.float32, device=dev) if with_topk else None
        recv_src_idx = torch.empty(out_rows, dtype=torch.int32, device=dev)
        flags = 4 | (1 if with_topk else 0) | (2 if topk_weights is not None else 0)
        R = self.num_ranks
        self._launch_dispatch(x, x_bytes, x_scales, scale_bytes, topk_idx, topk_weights, flags, num_topk, c.epr,
                              c.send_pos, c.info[: R * R], recv_x, recv_scales, recv_topk_idx, recv_topk_weights,
                              recv_src_idx, out_rows, config)
        return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx

    def _state(self, handle: IntranodeHandle) -> NativeHandleState:
        st = handle.private
        if not isinstance(st, NativeHandleState):
            raise ValueError("handle: not made by the native backend")
        return st

    def cached_dispatch(self, x, x_scales, handle, config):
        self._check()
        st = self._state(handle)
        x = _aligned(x)
        hidden = x.size(1)
        x_bytes = hidden * x.element_size()
        if x_scales is not None:
            x_scales = x_scales.to(torch.float32).contiguous()
        scale_bytes = 0 if x_scales is None else x_scales.size(1) * 4
        self._ensure(st.max_recv_rows, x_bytes, scale_bytes, 0, False)
        recv_x = torch.empty((st.out_rows, hidden), dtype=x.dtype, device=x.device)
        recv_scales = None if x_scales is None else torch.empty((st.out_rows, x_scales.size(1)), dtype=torch.float32,
                                                                device=x.device)
        self._launch_dispatch(x, x_bytes, x_scales, scale_bytes, None, None, 0, 0, 0, handle.send_head,
                              handle.rank_prefix_matrix, recv_x, recv_scales, None, None, None, st.out_rows, config)
        return recv_x, recv_scales

    # ---- expert-major: the expansion inside the dispatch copy-out, the fold-back inside combine's push ----
    def dispatch_expert_major(self, x, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                              num_tokens_per_expert, config, num_worst_tokens=0, expert_capacity=0,
                              num_tokens_per_rdma_rank=None):  # (one node: None)
        """Fused (see _fuse): each received row is read once from the buffer and stored at its expert-major
        rows (one per local expert); this rank's own tokens go there straight from x. With expand blocks
        (_expand_plan) those stores come from blocks beside the kernel's num_sms. The sender ships each
        top-k slot's position in its (rank, expert) block inside the id word; notify gives every block's
        base row (with expert_capacity: block (e, s) at (e * R + s) * capacity, and notify reports a source
        that overflows one). Otherwise: the receive-order dispatch, then the map and expand kernels.
        With num_worst_tokens and expert_capacity every size is known without the counts: no host sync."""
        self._check_usable()  # (the records: _exchange_counts, after a sync-free grow)
        R = self.num_ranks
        x = _aligned(x)
        n, hidden = x.shape
        x_bytes = hidden * x.element_size()
        topk_idx = topk_idx.to(torch.int64).contiguous()
        num_topk, num_experts = topk_idx.size(1), num_tokens_per_expert.numel()
        if topk_weights is not None:
            topk_weights = topk_weights.to(torch.float32).contiguous()
        # Sender and receiver must agree on the id words' format (expert-major senders pack positions into
        # them), so every rank decides from the same inputs: the routing shape's expected width, not its own
        # counts, the fewest SMs of any rank (expand blocks) and the call's Config; the header carries the
        # decision, so ranks whose Configs differ there get the same error before any row moves.
        fused, expand_blocks = self._expand_plan(_expected_width(num_topk, num_experts, R), num_topk, config)
        expands_in_kernel = fused or expand_blocks > 0
        # device work that needs no counts goes ahead of notify: after its host sync the GPU idles until the
        # dispatch kernel is launched
        topk_pos = positions_in_expert(topk_idx, num_experts, self._stream()) if expands_in_kernel else None
        c = self._exchange_counts(n, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, num_worst_tokens,
                                  shape_header(x, None, topk_idx, topk_weights, num_experts, expert_capacity,
                                               expert_major_ids=expands_in_kernel), y_bytes=_combine_row_bytes(x))
        if expert_capacity:
            per_expert = [R * expert_capacity] * c.epr
        else:
            per_expert = list(c.per_expert)
        num_rows, out_rows, worst, padded = sum(per_expert), c.out_rows, bool(num_worst_tokens), bool(expert_capacity)
        self._took("dispatch_expert_major", FUSED if fused else SIDE_BLOCKS if expand_blocks else PERMUTE)
        if not expands_in_kernel:
            recv_x, _, recv_topk_idx, recv_topk_weights, recv_src_idx = self._dispatch_rows(
                x, None, topk_idx, topk_weights, c, config)
            handle = self._handle(c, recv_src_idx, n, worst)
            if padded:
                em_map = permute.expert_major_map_capacity(recv_topk_idx, rows_per_source(handle, self.rank), c.epr,
                                                           expert_capacity)
            else:
                em_map = permute.expert_major_map(recv_topk_idx, per_expert)
            x_em = permute.expand_rows_raw(recv_x, em_map, num_rows, padded)
            return x_em, recv_topk_idx, recv_topk_weights, per_expert, em_map, handle
        for need in sizing.intranode_dispatch_needs(c.max_recv, c.max_send, x_bytes, 0, num_topk,
                                                    hidden * x.element_size()):
            self._ensure(*need)  # its receive rows, then its combine's rows
        dev = x.device
        # at least one row each: an empty tensor has no data pointer, and the kernels tell the expert-major
        # mode by a non-null output. A capacity layout's rows that no token fills stay zeros.
        x_em = (torch.zeros if padded else torch.empty)((max(num_rows, 1), hidden), dtype=x.dtype, device=dev)
        recv_topk_idx = torch.empty((out_rows, num_topk), dtype=torch.int64, device=dev)
        recv_topk_weights = torch.empty((out_rows, num_topk), dtype=torch.float32, device=dev)
        recv_src_idx = torch.empty(out_rows, dtype=torch.int32, device=dev)
        em_map = torch.empty((max(out_rows, 1), num_topk), dtype=torch.int32, device=dev)
        flags = 4 | 1 | (2 if topk_weights is not None else 0)
        self._launch_dispatch(x, x_bytes, None, 0, topk_idx, topk_weights, flags, num_topk, c.epr, c.send_pos,
                              c.info[: R * R], None, None, recv_topk_idx, recv_topk_weights, recv_src_idx, out_rows,
                              config, em_x=x_em, em_map=em_map, topk_pos=topk_pos,
                              em_base=c.info[R * R + c.epr:], em_rows=num_rows, expand_blocks=expand_blocks)
        handle = self._handle(c, recv_src_idx, n, worst)
        return x_em[:num_rows], recv_topk_idx, recv_topk_weights, per_expert, em_map[:out_rows], handle

    def _fuse(self, width: float, num_topk: int, dispatch: bool, config: Config, by_sms: bool = True) -> bool:
        """Expand / fold inside the communication kernel, else through the separate permute kernels (see
        _FUSE_MAX_WIDTH); width = expert-major rows per received row. Config.fuse_max_width replaces the rule
        for every op (0: never fuse, a large value: always). More than kMaxExpertMajorTopk slots per row
        never fuse (the kernels give each slot a lane). by_sms=False: wide rows do not fuse however many SMs
        the kernel has (the combine when fold blocks are at hand)."""
        if num_topk > _MAX_FUSED_TOPK:
            return False
        if config.fuse_max_width is not None:
            return width <= config.fuse_max_width
        min_sms = _FUSE_DISPATCH_MIN_SMS if dispatch else _FUSE_COMBINE_MIN_SMS
        return width <= _FUSE_MAX_WIDTH or (by_sms and self._num_sms(config) >= min_sms)

    def _expand_plan(self, width: float, num_topk: int, config: Config) -> tuple[bool, int]:
        """-> (fused, expand_blocks) for an expert-major dispatch: the expansion inside the copy-out (fused),
        on expand blocks beside the kernel (no fusion by SM count then), or neither (separate kernels)."""
        expand = self._side_blocks(config.expand_blocks, config) if num_topk <= _MAX_FUSED_TOPK else 0
        fused = self._fuse(width, num_topk, dispatch=True, config=config, by_sms=not expand)
        return fused, 0 if fused else expand

    def cached_dispatch_expert_major(self, x, handle, em_map, num_rows, config, padded=False):
        # the cached dispatch and the combine move receive-order rows either way: each rank may decide alone
        fused, expand_blocks = self._expand_plan(int(num_rows) / max(em_map.size(0), 1), em_map.size(1), config)
        if not (fused or expand_blocks):
            return super().cached_dispatch_expert_major(x, handle, em_map, num_rows, config, padded)
        self._took("dispatch_expert_major_cached", FUSED if fused else SIDE_BLOCKS)
        self._check()
        st = self._state(handle)
        x = _aligned(x)
        hidden = x.size(1)
        x_bytes = hidden * x.element_size()
        em_map = _map_arg(em_map)
        self._ensure(st.max_recv_rows, x_bytes, 0, 0, False)
        x_em = (torch.zeros if padded else torch.empty)((max(int(num_rows), 1), hidden), dtype=x.dtype,
                                                        device=x.device)  # (see above)
        self._launch_dispatch(x, x_bytes, None, 0, None, None, 0, 0, 0, handle.send_head, handle.rank_prefix_matrix,
                              None, None, None, None, None, st.out_rows, config, em_x=x_em, em_map=em_map,
                              em_rows=num_rows, expand_blocks=expand_blocks)
        return x_em[: int(num_rows)]

    # ---- combine -------------------------------------------------------------------------------------
    def combine(self, x, handle, topk_weights, bias_0, bias_1, config):
        return self._combine(x, handle, topk_weights, (bias_0, bias_1), config, None)

    def combine_expert_major(self, y_em, handle, em_map, topk_weights, config):
        fold_blocks = self._side_blocks(config.fold_blocks, config) if em_map.size(0) <= _MAX_FOLD_ROWS else 0
        if self._fuse(y_em.size(0) / max(em_map.size(0), 1), em_map.size(1), dispatch=False, config=config,
                      by_sms=not fold_blocks):
            self._took("combine_expert_major", FUSED)
            return self._combine(y_em, handle, topk_weights, (None, None), config, _map_arg(em_map))
        if not fold_blocks or em_map.size(1) > _MAX_FUSED_TOPK:
            return super().combine_expert_major(y_em, handle, em_map, topk_weights, config)
        self._took("combine_expert_major", SIDE_BLOCKS)
        fold_out = torch.empty((max(em_map.size(0), 1), y_em.size(1)), dtype=y_em.dtype, device=y_em.device)
        return self._combine(y_em, handle, topk_weights, (None, None), config, _map_arg(em_map),
                             fold_out=fold_out, fold_blocks=fold_blocks)

    def occupied_sms(self, config, expert_major):
        n = self._num_sms(config)
        side = max(self._side_blocks(config.expand_blocks, config),
                   self._side_blocks(config.fold_blocks, config)) if expert_major else 0
        return {"communication": n, "side": side, "total": n + side}

    def _side_blocks(self, chosen: Optional[int], config: Config) -> int:
        """Fold / expand blocks beside the kernel's SMs (see _MIN_SIDE_BLOCKS): the Config's `chosen`, at most
        the SMs the kernel leaves free; 0: none."""
        free = self._device_sms - self._num_sms(config)
        if chosen is None:
            return free if free >= _MIN_SIDE_BLOCKS else 0
        return min(chosen, free)

    def _combine(self, x, handle, topk_weights, biases, config, fold_map, fold_out=None, fold_blocks=0):
        self._check()
        st = self._state(handle)
        if x.dtype not in _COMBINE_DTYPES:
            raise TypeError(f"x: the native backend combines bfloat16, float16 or float32 rows, got {x.dtype}")
        x = _aligned(x)
        hidden = x.size(1)
        num_topk = 0 if topk_weights is None else topk_weights.size(1)
        if topk_weights is not None:
            topk_weights = topk_weights.to(torch.float32).contiguous()
        self._ensure(st.max_send_rows, hidden * x.element_size(), 0, num_topk, False)
        biases = [None if b is None else _aligned(b.to(x.dtype)) for b in biases]
        n = handle.num_tokens
        num_sms = self._num_sms(config)
        # the fused fold pushes from every warp; with fold blocks the push is a plain combine's
        push_warps = (_FOLD_PUSH_WARPS if fold_map is not None and fold_out is None
                      else _by_sms(_COMBINE_PUSH_WARPS, num_sms))
        out = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
        out_w = None if topk_weights is None else torch.empty((n, num_topk), dtype=torch.float32, device=x.device)
        self._buf.combine(x.data_ptr(), _COMBINE_DTYPES[x.dtype], hidden, _ptr(topk_weights), topk_weights is not None,
                          num_topk, n, handle.send_head.data_ptr(), handle.rank_prefix_matrix.data_ptr(),
                          _ptr(biases[0]), _ptr(biases[1]), out.data_ptr(), _ptr(out_w), _ptr(fold_map),
                          0 if fold_map is None else fold_map.size(1), x.size(0), _ptr(fold_out),
                          0 if fold_out is None else fold_out.size(0), fold_blocks, num_sms,
                          self._push_warps(config.combine_push_warps, push_warps),
                          config.combine_flag_batch or _COMBINE_FLAG_BATCH,
                          config.combine_kernel or 0, self._stream())  # 0: the kernel's default for the mode
        return out, out_w


@dataclass
class _Counts:
    """What notify (and the host sync after it) tells one dispatch."""

    send_pos: torch.Tensor  # [N, R] int32: row of token t among the rows sent to r, -1 if none
    info: torch.Tensor  # int32: rank prefix matrix [R*R], per-local-expert counts [epr], expert-major bases
    #                     [R*epr], the handle's one-channel matrices [R] + [R]
    per_rank: torch.Tensor
    is_token_in_rank: torch.Tensor
    epr: int
    channels: tuple  # the handle's (channel_prefix_matrix, recv_channel_prefix_matrix)
    out_rows: int = 0
    max_recv: int = 0
    max_send: int = 0
    per_expert: list = field(default_factory=list)  # exact per-local-expert counts (empty with num_worst_tokens)


_ZERO_STARTS: dict = {}  # (num_experts, device) -> int32 zeros for positions_in_expert


def positions_in_expert(topk_idx: torch.Tensor, num_experts: int, stream: int) -> torch.Tensor:
    """int32 [n, k] (int64 topk_idx [n, k]): the row of each (token, slot) among this rank's tokens for that
    expert (the expert-major map with every expert starting at 0), -1 for slots without an expert and for a
    token's repeat of an id. What an expert-major sender ships so that its receivers place its rows."""
    n, k = topk_idx.shape
    pos = torch.empty((max(n, 1), k), dtype=torch.int32, device=topk_idx.device)  # never pointer-less
    if n:  # (the kernel writes every slot, -1 where there is no expert)
        key = (num_experts, topk_idx.device)
        starts = _ZERO_STARTS.get(key)  # every expert starts at row 0 (read only: one per shape and device)
        if starts is None:
            starts = _ZERO_STARTS[key] = torch.zeros(num_experts, dtype=torch.int32, device=topk_idx.device)
        _module().expert_major_map(topk_idx.data_ptr(), n, k, num_experts, starts.data_ptr(), pos.data_ptr(), stream)
    return pos


def _map_arg(em_map: torch.Tensor) -> torch.Tensor:
    """em_map as the kernels read it: contiguous int32, never pointer-less (an empty map becomes one row of
    -1 that no row index reaches)."""
    em_map = em_map.to(torch.int32).contiguous()
    return em_map if em_map.numel() else torch.full((1, em_map.size(1)), -1, dtype=torch.int32, device=em_map.device)


def _expected_width(num_topk: int, num_experts: int, num_ranks: int) -> float:
    """Expert-major rows per received row under uniform top-k routing: the k/R slots a rank gets per token,
    over the chance that a token has any expert there (1 - C(E - E/R, k) / C(E, k)). The same on every
    rank: EP=2 top-8 of 256 gives 4.0, EP=8 1.5."""
    k = min(num_topk, num_experts)
    return (k / num_ranks) / max(sizing.p_token_reaches(num_topk, num_experts, num_experts // num_ranks), 1e-9)


def _by_sms(table: tuple, num_sms: int) -> int:
    """The setting of the first (up to this many SMs, setting) row of `table` that covers num_sms."""
    return next(value for max_sms, value in table if num_sms <= max_sms)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned: the kernels move rows in 16-byte vectors whenever the row size
    allows, so a view starting mid-allocation (e.g. `x[1:]` of a 1-D-offset storage) is copied first."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()
