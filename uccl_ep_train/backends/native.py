"""The native backend: our CUDA/HIP kernels (`uccl_ep_train._native`) over IPC-shared NVLink/xGMI buffers.

Intranode high-throughput path (DESIGN.md, "High-throughput kernels", the push plan):
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
whole call is CPU-sync free and CUDA-graph capturable (outputs padded to num_worst_tokens; handle's
num_recv_tokens is num_worst_tokens, as the combine input has that many rows).

Waits inside kernels have a deadline (UCCL_EP_TIMEOUT_S); a kernel that times out records rank, peer,
block and phase in host-mapped memory, and the next call on this backend raises with that message.
Low-latency mode is not implemented here: Buffer falls back to the reference backend for it.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..config import Config, env_number
from ..handles import IntranodeHandle
from .base import Backend

log = logging.getLogger("uccl_ep_train")

_GROW_STEP = 64 << 20  # grown buffers are rounded up to this
# Of the 16 warps of a block, how many push; the others copy landed rows out (dispatch) or reduce landed
# rows (combine) while the pushes go on, and push warps join them when done (benchmark-tuned defaults).
_DISPATCH_PUSH_WARPS = 12
_COMBINE_PUSH_WARPS = 8
# Rows a push warp sends between two system fences (after which it releases their "landed" flags): small
# batches let the receiver start copying / reducing early, large ones fence less often.
_FLAG_BATCH = 4
_COMBINE_FLAG_BATCH = 4
_COMBINE_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _module():
    from .. import _native  # noqa: PLC0415 (optional extension)

    return _native


def native_available() -> bool:
    """True when the native module has the intranode kernels and a CUDA/HIP GPU is visible."""
    try:
        m = _module()
    except ImportError:
        return False
    return hasattr(m, "IntranodeBuffer") and torch.cuda.is_available()


def _timeout_s() -> float:
    try:
        from ..config import timeout_s

        return float(timeout_s())
    except Exception:  # noqa: BLE001 - the env var alone is enough
        return float(os.environ.get("UCCL_EP_TIMEOUT_S", "100"))


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class NativeHandleState:
    """Backend-private part of an IntranodeHandle (the device-side layout lives in the handle's tensors:
    rank_prefix_matrix and send_head)."""

    out_rows: int  # rows of dispatch outputs (num_recv_tokens, or num_worst_tokens)
    max_recv_rows: int  # the largest receive of any rank (buffer rows a dispatch needs)
    max_send_rows: int  # the largest number of rows any rank sent (buffer rows a combine needs)
    worst: bool


class NativeBackend(Backend):
    name = "native"
    supports_low_latency = False  # LL kernels are not native yet: Buffer serves LL calls with the reference

    def __init__(self, group, rank, num_ranks, owner, num_nvl_bytes, num_rdma_bytes, device=None):
        super().__init__(group, rank, num_ranks, owner, num_nvl_bytes, num_rdma_bytes)
        self._native = _module()
        self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        max_ranks = int(getattr(self._native, "INTRANODE_MAX_RANKS", 8))
        if num_ranks > max_ranks:
            raise NotImplementedError(f"native backend: intranode only (at most {max_ranks} ranks on one node), "
                                      f"got {num_ranks} ranks; internode is not implemented yet")
        hosts: list = [None] * num_ranks
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if len(set(hosts)) > 1:
            raise NotImplementedError(f"native backend: ranks span several hosts ({sorted(set(hosts))}); "
                                      "only the intranode (one NVLink domain) path is implemented")
        self._timeout = _timeout_s()
        self._failed: Optional[str] = None
        self._buf = None
        self._open(max(int(num_nvl_bytes), self._min_bytes()))

    # ---- buffer lifetime -----------------------------------------------------------------------------
    def _min_bytes(self) -> int:
        return 32 << 20  # header (counts, row flags: ~5 MiB) + a first data region; grows on demand

    def _open(self, nbytes: int) -> None:
        with torch.cuda.device(self.device):
            buf = self._native.IntranodeBuffer(self.device.index, self.rank, self.num_ranks, int(nbytes), self._timeout)
            handles: list = [None] * self.num_ranks
            dist.all_gather_object(handles, buf.ipc_handle(), group=self.group)
            buf.open_peers(handles)
        self._buf = buf
        self._nbytes = int(nbytes)

    def _grow(self, need_bytes: int) -> None:
        """Collective: every rank calls it with the same size (decided from globally known counts)."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"native backend: the NVLink buffer ({self._nbytes} bytes) is too small for this "
                               f"call ({need_bytes} bytes needed) and cannot grow during CUDA graph capture; "
                               f"pass num_nvl_bytes >= {need_bytes} or run one call before capturing")
        new_bytes = _align_up(need_bytes + need_bytes // 8, _GROW_STEP)
        if self.rank == 0:
            log.warning("uccl_ep_train native: growing the NVLink buffer from %d to %d bytes (pass "
                        "num_nvl_bytes >= %d to avoid this)", self._nbytes, new_bytes, need_bytes)
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # nobody is still reading or writing the old buffers
        old = self._buf
        self._buf = None
        old.destroy()
        self._open(new_bytes)

    def _bytes_for(self, rows: int, x_bytes: int, scale_bytes: int, num_topk: int, with_src: bool) -> int:
        per_row = x_bytes + scale_bytes + num_topk * 12 + (4 if with_src else 0)
        return self._buf.header_bytes() + rows * per_row + 5 * 256 + 4096

    def _ensure(self, rows: int, x_bytes: int, scale_bytes: int, num_topk: int, with_src: bool) -> None:
        cap = self._native.intranode_row_capacity(self._buf.data_bytes(), x_bytes, scale_bytes, num_topk, with_src)
        if rows > cap:
            self._grow(self._bytes_for(rows, x_bytes, scale_bytes, num_topk, with_src))

    def _check(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"native backend: unusable after an earlier error: {self._failed}")
        if self._buf is None:
            raise RuntimeError("native backend: destroyed")
        msg = self._buf.error()
        if msg:
            self._failed = msg
            raise RuntimeError(f"native backend: {msg}")

    def check_errors(self) -> None:
        """Raise if a kernel recorded an error (timeout, capacity); cheap (reads host memory)."""
        self._check()

    def destroy(self) -> None:
        if self._buf is None:
            return
        try:
            torch.cuda.synchronize(self.device)
            if dist.is_initialized():
                dist.barrier(group=self.group)  # no peer still writes into this rank's buffer
        finally:
            buf, self._buf = self._buf, None
            buf.destroy()

    @staticmethod
    def _stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def _push_warps(self, var: str, default: int) -> int:
        """Warps per block that push (the others copy out / reduce from the start); env overrides."""
        total = int(getattr(self._native, "INTRANODE_WARPS_PER_BLOCK", 16))
        default = max(1, round(default * total / 16))  # defaults are for 16 warps (32-wide); HIP has 8
        try:
            n = int(os.environ.get(var, default))
        except ValueError:
            raise ValueError(f"{var} must be an int, got {os.environ.get(var)!r}") from None
        return max(1, min(n, total))

    @staticmethod
    def _num_sms(config: Optional[Config]) -> int:
        n = int(getattr(config, "num_sms", 0) or 24)
        return max(1, min(n, torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count))

    # ---- layout --------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts):
        self._check()
        topk_idx = topk_idx.to(torch.int64).contiguous()
        n, k = topk_idx.shape
        per_rank = torch.zeros(self.num_ranks, dtype=torch.int32, device=topk_idx.device)
        per_expert = torch.zeros(num_experts, dtype=torch.int32, device=topk_idx.device)
        in_rank = torch.empty((n, self.num_ranks), dtype=torch.bool, device=topk_idx.device)
        self._buf.dispatch_layout(topk_idx.data_ptr(), n, k, num_experts, per_rank.data_ptr(), per_expert.data_ptr(),
                                  in_rank.data_ptr(), self._stream())
        return per_rank, per_expert, in_rank

    # ---- dispatch ------------------------------------------------------------------------------------
    def dispatch(self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert, expert_alignment, num_worst_tokens, config):
        self._check()
        R, me = self.num_ranks, self.rank
        dev = x.device
        x = _aligned(x)
        n, hidden = x.shape
        x_bytes = hidden * x.element_size()
        if x_scales is not None:
            x_scales = x_scales.to(torch.float32).contiguous()
        scale_bytes = 0 if x_scales is None else x_scales.size(1) * 4
        num_experts = num_tokens_per_expert.numel()
        epr = num_experts // R
        num_topk = 0 if topk_idx is None else topk_idx.size(1)
        if topk_idx is not None:
            topk_idx = topk_idx.to(torch.int64).contiguous()
            if topk_weights is not None:
                topk_weights = topk_weights.to(torch.float32).contiguous()
        is_token_in_rank = is_token_in_rank.to(torch.bool).contiguous()
        per_rank = num_tokens_per_rank.to(torch.int32).contiguous()
        per_expert = num_tokens_per_expert.to(torch.int32).contiguous()

        send_pos = torch.empty((n, R), dtype=torch.int32, device=dev)
        info = torch.empty(R * R + epr, dtype=torch.int32, device=dev)
        stream = self._stream()
        self._buf.notify(per_rank.data_ptr(), per_expert.data_ptr(), is_token_in_rank.data_ptr(), n, num_experts,
                         send_pos.data_ptr(), info.data_ptr(), int(num_worst_tokens), stream)
        rank_prefix = info[: R * R].view(R, R)

        if num_worst_tokens:
            out_rows = int(num_worst_tokens)
            per_expert_list: list[int] = []
            # Assumes every rank passes the same num_worst_tokens and token count (the kernels check the
            # real counts against the buffer and report instead of overflowing).
            max_recv, max_send = out_rows, min(n * R, R * out_rows)
        else:
            host = info.tolist()  # the one host sync: it sizes the outputs (plain ints from here on)
            self._check()
            last = host[(R - 1) * R: R * R]  # prefix over source ranks: rows each rank receives in all
            out_rows = last[me]
            max_recv = max(last)
            # rows source s sends in all = row s of the prefix matrix minus row s - 1, summed over receivers
            max_send = max(sum(host[s * R: (s + 1) * R]) - (sum(host[(s - 1) * R: s * R]) if s else 0)
                           for s in range(R))
            per_expert_list = [_align_up(c, expert_alignment) for c in host[R * R:]]
        with_topk = topk_idx is not None
        self._ensure(max_recv, x_bytes, scale_bytes, num_topk, True)
        self._ensure(max_send, hidden * 4 if x.dtype == torch.float32 else hidden * 2, 0, num_topk, False)  # combine

        recv_x = torch.empty((out_rows, hidden), dtype=x.dtype, device=dev)
        recv_scales = None if x_scales is None else torch.empty((out_rows, x_scales.size(1)), dtype=torch.float32,
                                                                device=dev)
        recv_topk_idx = torch.empty((out_rows, num_topk), dtype=torch.int64, device=dev) if with_topk else None
        recv_topk_weights = torch.empty((out_rows, num_topk), dtype=torch.float32, device=dev) if with_topk else None
        recv_src_idx = torch.empty(out_rows, dtype=torch.int32, device=dev)
        flags = 4 | (1 if with_topk else 0) | (2 if topk_weights is not None else 0)
        self._buf.dispatch(
            x.data_ptr(), x_bytes, _ptr(x_scales), scale_bytes, _ptr(topk_idx), _ptr(topk_weights), flags, num_topk,
            epr, n, send_pos.data_ptr(), rank_prefix.data_ptr(), recv_x.data_ptr(), _ptr(recv_scales),
            _ptr(recv_topk_idx), _ptr(recv_topk_weights), recv_src_idx.data_ptr(), out_rows,
            self._num_sms(config), self._push_warps("UCCL_EP_DISPATCH_PUSH_WARPS", _DISPATCH_PUSH_WARPS),
            _env_int("UCCL_EP_FLAG_BATCH", _FLAG_BATCH), stream)

        handle = IntranodeHandle.with_one_channel(
            rank_prefix, per_rank, me, recv_src_idx, is_token_in_rank, send_pos, num_recv_tokens=out_rows,
            num_tokens=n, owner=self.owner,
            private=NativeHandleState(out_rows, max_recv, max_send, bool(num_worst_tokens)))
        return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle

    def _state(self, handle: IntranodeHandle) -> NativeHandleState:
        st = handle.private
        if not isinstance(st, NativeHandleState):
            raise ValueError("handle: not made by the native backend")
        return st

    def cached_dispatch(self, x, x_scales, handle, config):
        self._check()
        st = self._state(handle)
        x = _aligned(x)
        n, hidden = x.shape
        x_bytes = hidden * x.element_size()
        if x_scales is not None:
            x_scales = x_scales.to(torch.float32).contiguous()
        scale_bytes = 0 if x_scales is None else x_scales.size(1) * 4
        self._ensure(st.max_recv_rows, x_bytes, scale_bytes, 0, False)
        dev = x.device
        recv_x = torch.empty((st.out_rows, hidden), dtype=x.dtype, device=dev)
        recv_scales = None if x_scales is None else torch.empty((st.out_rows, x_scales.size(1)), dtype=torch.float32,
                                                                device=dev)
        self._buf.dispatch(
            x.data_ptr(), x_bytes, _ptr(x_scales), scale_bytes, 0, 0, 0, 0, 0, n, handle.send_head.data_ptr(),
            handle.rank_prefix_matrix.data_ptr(), recv_x.data_ptr(), _ptr(recv_scales), 0, 0, 0, st.out_rows,
            self._num_sms(config), self._push_warps("UCCL_EP_DISPATCH_PUSH_WARPS", _DISPATCH_PUSH_WARPS),
            _env_int("UCCL_EP_FLAG_BATCH", _FLAG_BATCH), self._stream())
        return recv_x, recv_scales

    # ---- combine -------------------------------------------------------------------------------------
    def combine(self, x, handle, topk_weights, bias_0, bias_1, config):
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
        biases = [None if b is None else _aligned(b.to(x.dtype)) for b in (bias_0, bias_1)]
        n = handle.num_tokens
        out = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
        out_w = None if topk_weights is None else torch.empty((n, num_topk), dtype=torch.float32, device=x.device)
        self._buf.combine(x.data_ptr(), _COMBINE_DTYPES[x.dtype], hidden, _ptr(topk_weights), topk_weights is not None, num_topk, n,
                          handle.send_head.data_ptr(), handle.rank_prefix_matrix.data_ptr(), _ptr(biases[0]),
                          _ptr(biases[1]), out.data_ptr(), _ptr(out_w), self._num_sms(config),
                          self._push_warps("UCCL_EP_COMBINE_PUSH_WARPS", _COMBINE_PUSH_WARPS),
                          _env_int("UCCL_EP_COMBINE_FLAG_BATCH", _COMBINE_FLAG_BATCH), self._stream())
        return out, out_w

    # ---- low latency (not here) ----------------------------------------------------------------------
    def low_latency_dispatch(self, *args, **kwargs):
        raise NotImplementedError("native backend: low-latency mode")

    def low_latency_combine(self, *args, **kwargs):
        raise NotImplementedError("native backend: low-latency mode")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        raise NotImplementedError("native backend: low-latency mode")


def _env_int(var: str, default: int) -> int:
    v = env_number(var, default, int)
    if v < 1:
        raise ValueError(f"{var} must be >= 1, got {v}")
    return v


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned: the kernels move rows in 16-byte vectors whenever the row size
    allows, so a view starting mid-allocation (e.g. `x[1:]` of a 1-D-offset storage) is copied first."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()
