"""The native low-latency (LL) backend: DeepEP's `low_latency_dispatch` / `low_latency_combine` on our kernels.

Every token goes straight to each rank that holds any of its experts, once per rank (the receiver expands it
into one row per expert): node peers over NVLink/xGMI (CUDA/HIP IPC), ranks of other nodes through the CPU
proxies (per destination rank and call, a write and an ordered atomic for a dispatch's counts header, then for
its row index and messages; one of each for a combine). Sizes are fixed by
(num_max_dispatch_tokens_per_rank, hidden, ranks, experts): no host sync, and a dispatch + combine pair replays
exactly in a CUDA graph. Kernels: csrc/kernels/low_latency{,_buffer}.cu;
design and numbers: docs/low_latency.md.

This module is also the one home of the LL memory layout (`low_latency_layout`): the size hint
(`Buffer.get_low_latency_rdma_size_hint`) and the kernels' offsets both come from it.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..config import timeout_s
from ..events import current_raw_stream
from ..errors import RankLocalError
from ..fp8 import FP8_BLOCK, fp8_dtype_for
from ..handles import LowLatencyHandle
from ..topology import MAX_RANKS_PER_NODE, Topology, native_limit
from .base import Backend
from .native import RaisesRecordedErrors, SharesMemoryWithPeers, _module, module_serves, quiesce

MAX_TOPK = 32  # top-k slots per token the layout has room for (the native LL_MAX_TOPK)
_MSG_HEADER = 16  # a dispatch message: {source token, -, -, -}, then x (BF16, or FP8 and its scales)
_ERROR_WORDS = 4096  # the region starts with the kernels' claim word and error words
_COUNTERS_BYTES = 12288  # counters the kernels keep, at the same place for every shape
_SIGNALS = _ERROR_WORDS + _COUNTERS_BYTES
_PROXY_REACH = 1 << 32  # a proxy command's offsets are 32-bit
# Proxy groups a rank of a low-latency Buffer runs across nodes: the HT backend's and the LL calls' own (each
# with its threads and ipc copy agents; _shared_gpu_proxy_options divides the cores between them).
PROXY_GROUPS = 2
_MAX_BLOCKS = 32  # blocks (one per SM) of each LL kernel, at most this rank's share of the GPU


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class LowLatencyLayout:
    """Byte offsets in a rank's LL region for calls of one shape (two halves that calls alternate over).

    Per half: d_send / d_recv (R dispatch blocks: a counts header, the message index of each of up to `slots`
    rows, then up to M messages: a token goes once to a rank, however many of its experts are there), c_send /
    c_recv (R combine blocks of `slots` BF16 rows, one per row); the proxies read and write only these, so they
    come first. Then per half c_zero (the zero-copy combine input).
    """

    num_ranks: int
    num_local: int
    max_tokens: int
    hidden: int
    msg_bytes: int
    block_bytes: int
    cblock_bytes: int
    hdr_bytes: int
    idx_bytes: int
    slots: int
    areas: tuple  # per half: (d_send, d_recv, c_send, c_recv, c_zero)
    proxied_end: int  # the end of the last proxied area (must stay below 4 GiB when proxies are used)
    total_bytes: int

    @functools.cached_property
    def kernel_args(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per half, the 15 int64 of the native `Layout` in its field order (built once per shape: every
        call passes them)."""
        R = self.num_ranks
        per_half = []
        for half, (d_send, d_recv, c_send, c_recv, c_zero) in enumerate(self.areas):
            per_half.append((self.msg_bytes, self.block_bytes, self.cblock_bytes, self.hdr_bytes, self.idx_bytes,
                             d_send, d_recv, c_send, c_recv,
                             _SIGNALS + 8 * R * half, _SIGNALS + 8 * R * (2 + half),  # node peers' signals (bytes)
                             R * half, R * (2 + half),  # signals the proxies raise (uint64 words of the host flags)
                             c_zero, _ERROR_WORDS))
        return per_half[0], per_half[1]

    def combine_input(self, half: int) -> tuple[int, tuple[int, int, int]]:
        """(byte offset, shape) of the zero-copy combine input of `half`: [L, R * M, hidden] BF16."""
        return self.areas[half][4], (self.num_local, self.num_ranks * self.max_tokens, self.hidden)


@functools.lru_cache(maxsize=64)  # every call of a shape asks for it, up to three times: computed once
def low_latency_layout(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                       num_experts: int) -> LowLatencyLayout:
    M, H, R = num_max_dispatch_tokens_per_rank, hidden, num_ranks
    L = num_experts // R
    msg = _align(_MSG_HEADER + 2 * H, 16)  # BF16 row, or FP8 row + H/128 float scales (smaller)
    slots = M * min(MAX_TOPK, L)  # a token sends at most min(top-k, L) rows to one rank
    hdr = _align(4 * L, 16)
    idx = _align(4 * slots, 16)
    block = _align(hdr + idx + M * msg, 256)
    cblock = _align(slots * 2 * H, 256)
    at = _align(_SIGNALS + 4 * 8 * R, 4096)
    proxied = []
    for _ in range(2):
        offs = []
        for size in (R * block, R * block, R * cblock, R * cblock):
            offs.append(at)
            at = _align(at + size, 4096)
        proxied.append(offs)
    proxied_end = at
    areas = []
    for half in range(2):
        areas.append(tuple(proxied[half]) + (at,))
        at = _align(at + L * R * M * 2 * H, 4096)
    return LowLatencyLayout(R, L, M, H, msg, block, cblock, hdr, idx, slots, tuple(areas), proxied_end, at)


def low_latency_available() -> bool:
    """True when the native module has the LL kernels and a GPU is visible."""
    return module_serves("LowLatencyBuffer")


@dataclass
class LowLatencyState:
    """Backend-private part of a LowLatencyHandle: where each (token, top-k slot) went (combine reads it back)."""

    pair_pos: torch.Tensor  # [T, K] int32: row in the destination rank's block
    num_tokens: int
    num_topk: int


class _Raw:
    """A device pointer as an array interface, so torch can view memory it does not own."""

    def __init__(self, ptr: int, shape: tuple, typestr: str) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr, "version": 2}


class NativeLowLatencyBackend(SharesMemoryWithPeers, RaisesRecordedErrors, Backend):
    """LL calls of a Buffer made with `low_latency_mode=True` on GPUs (the HT calls use the Buffer's backend)."""

    name = "native"
    error_prefix = "native low-latency kernels"
    capture_refusal = ""  # fixed sizes; every signal target lives in device memory
    checks_values_on_device = True  # expert ids (dispatch send)

    def __init__(self, group, rank, num_ranks, owner, num_nvl_bytes, num_rdma_bytes, device, topology: Topology):
        super().__init__(group, rank, num_ranks, owner, num_nvl_bytes, num_rdma_bytes, topology=topology)
        from ..gpu_sharing import check_gpu_sharing
        from .internode import _shared_gpu_proxy_options

        self._native = _module()
        self.device = device
        self.L = topology.ranks_per_node
        max_local = native_limit(self._native, "LL_MAX_LOCAL", MAX_RANKS_PER_NODE)
        if self.L > max_local or num_ranks > int(self._native.LL_MAX_RANKS):
            raise ValueError(f"native low-latency kernels: {self.L} ranks per node x {topology.num_nodes} nodes; at "
                             f"most {max_local} per node and {self._native.LL_MAX_RANKS} ranks")
        per_gpu = check_gpu_sharing(group, device, "the native low-latency kernels")
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._blocks = max(1, min(_MAX_BLOCKS, sms // per_gpu))  # every rank's blocks stay resident
        self._half = [0, 0]  # the half the next dispatch / combine uses (they alternate, as DeepEP's buffers)
        self._failed: Optional[str] = None
        self._proxy = None
        cpus: list = [None] * num_ranks
        dist.all_gather_object(cpus, len(os.sched_getaffinity(0)), group=group)
        with torch.cuda.device(device):
            self._buf = self._native.LowLatencyBuffer(device.index, rank, num_ranks, self.L, int(num_rdma_bytes),
                                                      4 * num_ranks, self._blocks, float(timeout_s()))
            handles: list = [None] * num_ranks
            dist.all_gather_object(handles, self._buf.ipc_handle(), group=group)
            node = topology.node_of(rank)
            if self.L > 1:
                self._buf.open_peers(handles[node * self.L:(node + 1) * self.L])
            if topology.internode:
                from ..proxy import ProxyGroup

                regions = {0: (self._buf.ptr(), self._buf.bytes(), True),
                           1: (self._buf.flag_ptr(), self._buf.flag_bytes(), False)}
                self._proxy = ProxyGroup(rank, num_ranks, regions, group=group, gpu=device.index, low_latency=True,
                                         **_shared_gpu_proxy_options(per_gpu, min(cpus), PROXY_GROUPS))
                rings = []
                for t in range(self._proxy.num_threads):
                    d = self._proxy.ring_desc(t, device=True)
                    rings.append([d["slots"], d["claim"], d["tail_cache"], d["tail"], d["flushed"], d["echo"],
                                  d["capacity"], 1 if d["publish"] == "vector" else 0])
                self._buf.set_rings(rings, self._proxy.failure_record(device=True))
        self._fnuz = fp8_dtype_for(device) == torch.float8_e4m3fnuz
        self._send, self._recv = int(self._native.LL_SEND_PHASE), int(self._native.LL_RECV_PHASE)

    # ---- lifetime ------------------------------------------------------------------------------------
    def release(self) -> None:
        if self._buf is None:
            return
        torch.cuda.synchronize(self.device)
        proxy, buf = self._proxy, self._buf
        self._proxy = self._buf = None
        try:
            if proxy is not None:
                proxy.close()
        finally:
            buf.destroy()

    def proxy_stats(self) -> Optional[dict]:
        """The LL proxies' counters (None with one node: nothing goes through proxies)."""
        return None if self._proxy is None else self._proxy.stats()

    @property
    def proxy_transport(self) -> Optional[str]:
        """The transport the proxies carry the other nodes' bytes on; None with every rank in one node."""
        return None if self._proxy is None else self._proxy.described_transport

    @property
    def waits_for_default_stream(self) -> bool:
        """True when the proxies' GPU copies queue on the legacy default stream (they call the CUDA runtime: fabric
        on shm): the caller's stream must then be another one (Buffer refuses calls from the default stream)."""
        return self._proxy is not None and self._proxy.calls_gpu_runtime

    # ---- calls ---------------------------------------------------------------------------------------
    def _layout(self, max_tokens: int, hidden: int, num_experts: int) -> LowLatencyLayout:
        lay = low_latency_layout(max_tokens, hidden, self.num_ranks, num_experts)
        if lay.total_bytes > self._buf.bytes():
            raise ValueError(f"num_rdma_bytes: the low-latency region has {self._buf.bytes()} bytes, this shape needs "
                             f"{lay.total_bytes} (Buffer.get_low_latency_rdma_size_hint)")
        if self._proxy is not None and lay.proxied_end > _PROXY_REACH:
            raise ValueError(f"low_latency_dispatch: {max_tokens} tokens x hidden {hidden} x {num_experts} experts "
                             f"over {self.num_ranks} ranks needs {lay.proxied_end} bytes of proxied buffers; the "
                             f"proxies reach 4 GiB (lower num_max_dispatch_tokens_per_rank)")
        return lay

    def _next(self, kind: int) -> int:
        half = self._half[kind]
        self._half[kind] ^= 1
        return half

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                             round_scale, use_ue8m0, cumulative_local_expert_recv_stats, return_recv_hook):
        self.check_errors()
        M, H, R = num_max_dispatch_tokens_per_rank, x.size(1), self.num_ranks
        T, K = topk_idx.shape
        if K > MAX_TOPK:
            raise ValueError(f"topk_idx: {K} experts per token; the low-latency kernels take at most {MAX_TOPK}")
        if H % FP8_BLOCK:
            raise ValueError(f"x: hidden ({H}) must be a multiple of {FP8_BLOCK} for the low-latency kernels")
        lay = self._layout(M, H, num_experts)  # (raises before the halves move)
        half = self._next(0)
        args = lay.kernel_args[half]
        L = num_experts // R
        dev = x.device
        x = x.contiguous()
        topk_idx = topk_idx.contiguous()
        rows = R * M
        recv_scales = None
        if use_fp8:
            recv_x = torch.empty((L, rows, H), dtype=fp8_dtype_for(dev), device=dev)
            n_scales = H // FP8_BLOCK // 4 if use_ue8m0 else H // FP8_BLOCK  # column-major in the last two dims
            recv_scales = torch.empty((L, n_scales, rows), dtype=torch.int32 if use_ue8m0 else torch.float32,
                                      device=dev).transpose(1, 2)
        else:
            recv_x = torch.empty((L, rows, H), dtype=torch.bfloat16, device=dev)
        # one torch.empty per output: views carved from one allocation took more host time (measured on an H100 host)
        pair_pos = torch.empty((T, K), dtype=torch.int32, device=dev)
        src_info = torch.empty((L, rows), dtype=torch.int32, device=dev)
        layout_range = torch.empty((L, R), dtype=torch.int64, device=dev)
        recv_count = torch.empty((L,), dtype=torch.int32, device=dev)
        stats = cumulative_local_expert_recv_stats
        call = (args, x.data_ptr(), topk_idx.data_ptr(), T, K, num_experts, M, H, use_fp8, round_scale, use_ue8m0,
                self._fnuz, half, pair_pos.data_ptr(), recv_x.data_ptr(),
                0 if recv_scales is None else recv_scales.data_ptr(), src_info.data_ptr(), layout_range.data_ptr(),
                recv_count.data_ptr(), 0 if stats is None else stats.data_ptr())
        handle = LowLatencyHandle(src_info, layout_range, M, H, num_experts, owner=self.owner,
                                  private=LowLatencyState(pair_pos, T, K))
        return recv_x, recv_scales, recv_count, handle, self._launch(self._buf.dispatch, call, return_recv_hook)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, out, return_recv_hook):
        self.check_errors()
        state = handle.private
        if not isinstance(state, LowLatencyState):
            raise ValueError("handle: not made by the native low-latency dispatch of this Buffer")
        if tuple(topk_idx.shape) != (state.num_tokens, state.num_topk):
            raise RankLocalError(f"topk_idx: expected [{state.num_tokens}, {state.num_topk}] as in the dispatch, got "
                                 f"{list(topk_idx.shape)}")
        M, H, E = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        lay = self._layout(M, H, E)
        half = self._next(1)
        args = lay.kernel_args[half]
        x = x.contiguous()
        topk_idx = topk_idx.to(torch.int64).contiguous()
        topk_weights = topk_weights.to(torch.float32).contiguous()
        call = (args, x.data_ptr(), handle.layout_range.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(),
                state.pair_pos.data_ptr(), state.num_tokens, state.num_topk, E, M, H, half, out.data_ptr())
        return self._launch(self._buf.combine, call, return_recv_hook)

    def _launch(self, kernel, call: tuple, return_recv_hook: bool) -> Optional[Callable[[], None]]:
        """Both phases of a call in one launch on the current stream, or (recv hook) the send phase now and the
        receive phase when the returned hook runs (on the stream current then)."""
        if not return_recv_hook:
            kernel(*call, self._send | self._recv, current_raw_stream(self.device.index))
            return None
        kernel(*call, self._send, current_raw_stream(self.device.index))
        return lambda: kernel(*call, self._recv, current_raw_stream(self.device.index))

    def low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The next combine's zero-copy input (its half of the region), [L, R * M, hidden] BF16."""
        lay = self._layout(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        offset, shape = lay.combine_input(self._half[1])
        return torch.as_tensor(_Raw(self._buf.ptr() + offset, shape, "<i2"), device=self.device).view(torch.bfloat16)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Collective: after every rank stopped using the buffer, zero every signal, counter and area."""
        quiesce(self.device, self.group)
        self._buf.clean()
        self._half = [0, 0]
        if dist.is_initialized():
            dist.barrier(group=self.group)

    # the high-throughput calls belong to the Buffer's other backend
    def get_dispatch_layout(self, *args, **kwargs):
        raise NotImplementedError("the native low-latency backend serves low-latency calls only")

    dispatch = cached_dispatch = combine = get_dispatch_layout
