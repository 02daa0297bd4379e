"""The native internode backend: NVLink/xGMI aggregation inside a node, CPU-proxy RDMA between nodes.

Kernels and buffers: `uccl_ep_train._native.InternodeBuffer` (csrc/kernels/internode*.{h,cu}; the design
and the wire format are in docs/internode.md). This class is the thin Python side:
- bootstrap: the topology (ranks per node, `uccl_ep_train.topology`), one InternodeBuffer per rank, its
  NVL buffer's IPC handle opened by the other ranks of its node, and a `ProxyGroup` (CPU proxy threads)
  over its RDMA region (region 0, GPU) and flag region (region 1, pinned host memory). The transport is
  chosen at run time: `ipc` on one host (several "nodes" on one machine: the copy engine writes exactly
  where a NIC would), `verbs` (RC) on RDMA NICs, `fabric` elsewhere; UCCL_EP_TRANSPORT overrides.
- a fresh dispatch sends its count row to every rank through the proxies (notify); the counts kernel waits
  for every rank's row on the GPU, checks them and writes the call info from which every kernel computes its
  tables (sender and receiver derive the same layout from the same global per-node counts; host sizing:
  `_native.internode_layout`). With num_worst_tokens that is all (no host sync); without it the host also
  reads the rows once, to size the outputs exactly (docs/internode.md, "Notify and counts").
- dispatch / cached dispatch / combine launch the kernels on the current stream; a fresh expert-major
  dispatch has the same kernels store its rows in expert-major order (docs/internode.md, "Expert-major
  landing") when `lands_expert_major` says so.
Receive order is intranode's (source rank, then source token index), so dispatch is bit-exact with the
reference backend; combine reduces inside the node first (float32 in local rank order, rounded to x's dtype
for the trip back), then over nodes (float32 in node order): within reduction tolerance of the reference.

Buffers grow on demand, collectively (every rank derives the same sizes from the global counts, or from bounds
every rank shares: sizing.internode_worst_counts). CUDA graphs: a fresh dispatch with num_worst_tokens, the
cached dispatch and the combine can be captured and replayed: what changes per call (the op numbers, the node
barriers, the count rows' parity) lives in GPU counters the kernels advance (internode_api.h, OpCounters), and
the proxies act on the commands the kernels push, whoever launched them. Inside capture the host refuses what
it cannot capture: a grow, opening the buffers, the host read of the counts.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from .. import sizing
from ..config import Config, env_number, timeout_s
from ..errors import RankLocalError
from ..events import current_raw_stream, to_device
from ..handles import InternodeHandle
from ..proxy import check_caller_stream
from ..topology import MAX_NODES, MAX_RANKS_PER_NODE, Topology, native_limit
from ..validation import check_expert_capacity
from .base import FUSED, Backend, WithoutLowLatency
from .native import (_FUSE_MAX_WIDTH, _MAX_FUSED_TOPK, RaisesRecordedErrors, SharesMemoryWithPeers, _combine_row_bytes,
                     _expected_width, _module, check_same_shape, module_serves, positions_in_expert,
                     recorded_errors, refuse_grow_in_capture, refuse_in_capture, shape_header)

log = logging.getLogger("uccl_ep_train")

# Bytes per RDMA chunk (one proxy write + its flag), by transport: large enough that the per-command cost is
# small against the transfer, small enough that forwarding starts early. A NIC's work request costs about a
# microsecond; the ipc copy agent's copy (a copy launch and an event in another process) tens of them:
# measured, 2 ranks on one H100, seed shape, BF16 dispatch 45 GB/s with 2 MiB chunks, 71 GB/s with 8 MiB.
# UCCL_EP_RDMA_CHUNK_BYTES overrides (the same value on every rank).
_CHUNK_BYTES = {"ipc": 8 << 20, "verbs": 2 << 20, "fabric": 2 << 20}
_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def internode_available() -> bool:
    """True when the native module has the internode kernels and proxies, and a GPU is visible."""
    from .. import proxy

    return module_serves("InternodeBuffer") and proxy.available()


@dataclass
class InternodeState:
    """Backend-private part of an InternodeHandle: what the kernels need again (cached dispatch, combine)."""

    info: torch.Tensor  # int32 call info on the GPU (the counts kernel's, _native.internode_info_offsets)
    # What the buffers were sized for: the global per-node counts (rd[s * N + n]: tokens rank s sends to node n)
    # and the most rows any rank receives, read on the host (a synced dispatch), or their bounds (sync-free)
    rd: list
    max_recv: int
    send_pos: torch.Tensor  # [T, R] int32


class NativeInternodeBackend(SharesMemoryWithPeers, RaisesRecordedErrors, WithoutLowLatency, Backend):
    name = "native"
    error_prefix = "native internode backend"
    capture_refusal = ""  # the per-call numbers live on the GPU (OpCounters); refuse_in_capture names the rest
    _unopened: Optional[tuple[int, int]] = None  # (nvl, rdma) bytes of the open the first dispatch still owes

    def __init__(self, group, rank, num_ranks, owner, num_nvl_bytes, num_rdma_bytes, device, topology: Topology,
                 proxy_groups: int = 1, open_at_first_dispatch: bool = False):
        """open_at_first_dispatch: build the buffers and start the proxies in the first dispatch (collective, as
        every dispatch) instead of here; a low-latency Buffer's HT backend, so that ranks making LL calls only
        (decoding) do not run a second proxy group that waits for HT calls."""
        super().__init__(group, rank, num_ranks, owner, num_nvl_bytes, num_rdma_bytes, topology=topology)
        if not topology.internode:
            raise ValueError("NativeInternodeBackend: the topology has one node; use the intranode backend")
        self._native = _module()
        self.device = device
        self.L, self.N = topology.ranks_per_node, topology.num_nodes
        self.node, self.local = topology.node_of(rank), topology.local_of(rank)
        max_local = native_limit(self._native, "INTERNODE_MAX_LOCAL", MAX_RANKS_PER_NODE)
        max_nodes = native_limit(self._native, "INTERNODE_MAX_NODES", MAX_NODES)
        if self.L > max_local or self.N > max_nodes:
            raise ValueError(f"native internode backend: {self.L} ranks per node x {self.N} nodes; at most "
                             f"{max_local} per node and {max_nodes} nodes")
        from ..gpu_sharing import check_gpu_sharing, comm_sms_share

        per_gpu = check_gpu_sharing(group, device, "the native internode backend")
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._device_sms = comm_sms_share(sms, per_gpu)  # ranks sharing a GPU must all stay resident
        self._timeout = float(timeout_s())
        self._chunk_bytes = int(env_number("UCCL_EP_RDMA_CHUNK_BYTES", 0, int))  # 0: the transport's default
        if "UCCL_EP_RDMA_CHUNK_BYTES" in os.environ and self._chunk_bytes < 1:
            raise ValueError(f"UCCL_EP_RDMA_CHUNK_BYTES must be >= 1, got {self._chunk_bytes}")
        sizes: list = [None] * num_ranks
        dist.all_gather_object(sizes, (int(num_nvl_bytes), int(num_rdma_bytes), len(os.sched_getaffinity(0))),
                               group=group)  # (UCCL_EP_RDMA_CHUNK_BYTES agrees: Buffer checked it, agreement.py)
        self._proxy_options = _shared_gpu_proxy_options(per_gpu, min(s[2] for s in sizes), proxy_groups)
        self._buf = None
        self._proxy = None
        self._failed: Optional[str] = None
        self._pinned: Optional[torch.Tensor] = None
        first = sizing.internode_start(max(s[0] for s in sizes), max(s[1] for s in sizes))
        self._unopened = first if open_at_first_dispatch else None
        if not open_at_first_dispatch:
            self._open(*first)

    # ---- lifetime ------------------------------------------------------------------------------------
    def _open(self, nvl_bytes: int, rdma_bytes: int) -> None:
        """Collective: the buffers, the node peers' NVL mappings, the proxies over the two regions."""
        from ..proxy import ProxyGroup

        with torch.cuda.device(self.device):
            buf = self._native.InternodeBuffer(self.device.index, self.rank, self.num_ranks, self.L, int(nvl_bytes),
                                               int(rdma_bytes), self._timeout)
            handles: list = [None] * self.num_ranks
            dist.all_gather_object(handles, buf.ipc_handle(), group=self.group)
            buf.open_peers(handles[self.node * self.L:(self.node + 1) * self.L])
            regions = {0: (buf.rdma_ptr(), buf.rdma_bytes(), True), 1: (buf.flag_ptr(), buf.flag_bytes(), False)}
            proxy = ProxyGroup(self.rank, self.num_ranks, regions, group=self.group, gpu=self.device.index,
                               **self._proxy_options)
        rings = []
        for t in range(proxy.num_threads):
            d = proxy.ring_desc(t, device=True)
            rings.append([d["slots"], d["claim"], d["tail_cache"], d["tail"], d["flushed"], d["echo"], d["capacity"],
                          1 if d["publish"] == "vector" else 0])
        buf.set_rings(rings, proxy.failure_record(device=True), proxy.failure_record(device=False))
        self._buf, self._proxy = buf, proxy

    def _close(self) -> None:
        proxy, buf = self._proxy, self._buf
        self._proxy = self._buf = None
        try:
            if proxy is not None:
                proxy.close()
        finally:
            if buf is not None:
                buf.destroy()

    def release(self) -> None:
        self._unopened = None  # (never opened: nothing to release, and nothing opens any more)
        if self._buf is None:
            return
        torch.cuda.synchronize(self.device)  # this rank's kernels still using the buffers and rings
        self._close()

    def destroy(self) -> None:
        self._unopened = None
        super().destroy()

    def _check_usable(self) -> None:
        if self._unopened is None:  # an unopened backend has failed nothing yet
            super()._check_usable()

    def _check(self) -> None:
        if self._unopened is None:  # an unopened backend has recorded nothing
            super()._check()

    def _ensure(self, rdma_need: int, nvl_need: int) -> None:
        """Collective (every rank passes the global maxima): rebuilds buffers and proxies when too small. A
        need past the largest RDMA region raises before anything is released (every rank alike)."""
        if rdma_need <= self._buf.rdma_bytes() and nvl_need <= self._buf.nvl_bytes():
            return
        refuse_grow_in_capture(self.error_prefix, f"the RDMA region ({self._buf.rdma_bytes()} bytes) and NVL "
                               f"buffer ({self._buf.nvl_bytes()} bytes) must grow to {rdma_need} and {nvl_need} "
                               "bytes", "num_rdma_bytes / num_nvl_bytes")
        most = sizing.internode_max_rdma_bytes()
        if rdma_need > most:
            raise ValueError(f"this call needs an RDMA region of {rdma_need} bytes; the internode backend addresses "
                             f"at most {most} (fewer tokens per call, or more nodes)")
        rdma = sizing.internode_grow(self._buf.rdma_bytes(), rdma_need, most)
        nvl = sizing.internode_grow(self._buf.nvl_bytes(), nvl_need)
        if self.rank == 0:
            log.warning("uccl_ep_train native internode: growing the RDMA region to %d and the NVL buffer to %d "
                        "bytes (pass num_rdma_bytes / num_nvl_bytes at least this large to avoid it)", rdma, nvl)
        self._quiesce_before_grow()  # nothing in flight; no error recorded in the buffers a grow drops
        self._close()
        self._open(nvl, rdma)

    def proxy_stats(self) -> Optional[dict]:
        """The proxies' counters (cumulative): bytes_to / commands_to per destination rank, and totals; None
        before the first dispatch opened them (open_at_first_dispatch)."""
        return None if self._proxy is None else self._proxy.stats()

    @property
    def proxy_transport(self) -> Optional[str]:
        """The transport the proxies carry the inter-node bytes on ('ipc', 'fabric (shm)', 'verbs'); None before
        the first dispatch opened them."""
        return None if self._proxy is None else self._proxy.described_transport

    @property
    def waits_for_default_stream(self) -> bool:
        """True when the proxies' GPU copies queue on the legacy default stream (they call the CUDA runtime: fabric
        on shm): the caller's stream must then be another one (Buffer refuses calls from the default stream)."""
        return self._proxy is not None and self._proxy.calls_gpu_runtime

    def occupied_sms(self, config, expert_major):
        n = self._num_sms(config)  # every kernel of a call runs on them (no side blocks)
        return {"communication": n, "side": 0, "total": n}

    def _num_sms(self, config: Config) -> int:
        """The call's SMs: its Config's (Buffer resolves a missing one to its defaults), at most this rank's share."""
        return max(1, min(config.num_sms, self._device_sms))

    def _chunk_rows(self, row_bytes: int) -> int:
        return max(1, (self._chunk_bytes or _CHUNK_BYTES[self._proxy.transport]) // row_bytes)

    # ---- layout --------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts):
        self._check()
        topk_idx = topk_idx.to(torch.int64).contiguous()
        n, k = topk_idx.shape
        R, N = self.num_ranks, self.N
        counts = torch.zeros(R + N + num_experts, dtype=torch.int32, device=topk_idx.device)  # one fill
        per_rank, per_node, per_expert = counts[:R], counts[R:R + N], counts[R + N:]
        in_rank = torch.empty((n, R), dtype=torch.bool, device=topk_idx.device)
        ptrs = (per_rank.data_ptr(), per_node.data_ptr(), per_expert.data_ptr(), in_rank.data_ptr())
        if self._buf is not None:  # records a bad expert id (raised at a synced dispatch's count read, or later)
            self._buf.dispatch_layout(topk_idx.data_ptr(), n, k, num_experts, *ptrs, current_raw_stream())
        else:  # not opened yet (a low-latency Buffer's first HT call): the host checked the ids
            self._native.dispatch_layout(topk_idx.data_ptr(), n, k, num_experts, R, self.L, *ptrs,
                                         current_raw_stream())
        return per_rank, per_node, per_expert, in_rank

    @property
    def checks_expert_ids_on_device(self) -> bool:
        """False: the host checks the ids (one sync), so a bad one raises before any communication and its
        abort reaches every rank at once. Once the buffers are open the layout kernel also records a bad id
        (tests/test_errors.py, internode-2x1), which is what calls that skip the host's checks rely on
        (`trusted_values()`, UCCL_EP_CHECK_VALUES=0); but only the rank that recorded it raises it, and the other
        nodes' ranks wait for that rank until their timeout, so it does not replace the host's check."""
        return False

    # ---- dispatch ------------------------------------------------------------------------------------
    def _wait_counts(self) -> np.ndarray:
        """The host sync of a dispatch without num_worst_tokens: every rank's count row (host int32 [R, stride]),
        after checking that the ranks agree on the shape of the call (the same error on every rank: all of
        them read every row)."""
        stride = int(self._native.internode_count_row_ints(self.num_ranks, int(self._native.INTERNODE_MAX_EXPERTS),
                                                           self.L))
        size = self.num_ranks * stride
        if self._pinned is None or self._pinned.numel() < size:
            self._pinned = torch.empty(size, dtype=torch.int32, pin_memory=True)
        try:
            self._buf.wait_counts(self._pinned.data_ptr())
        except RuntimeError as exc:  # with the proxies' own text where they recorded one (what _check raises)
            self._failed = recorded_errors(self._buf, self._proxy, str(exc))
            raise RuntimeError(f"{self.error_prefix}: {self._failed}") from exc
        rows = self._pinned[:size].numpy().reshape(self.num_ranks, stride).copy()
        check_same_shape(rows.tolist())
        return rows

    def dispatch(self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert, expert_alignment, num_worst_tokens, config, num_tokens_per_rdma_rank=None,
                 num_max_tokens_per_rank=0):
        return self._fresh(x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                           num_tokens_per_expert, expert_alignment, num_worst_tokens, config,
                           num_tokens_per_rdma_rank, num_max_tokens_per_rank=num_max_tokens_per_rank)[:6]

    def dispatch_expert_major(self, x, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                              num_tokens_per_expert, config, num_worst_tokens=0, expert_capacity=0,
                              num_tokens_per_rdma_rank=None):
        """Expert-major rows written by the dispatch kernels themselves when the rule allows
        (`lands_expert_major`): each received row is stored at its expert-major rows by whichever kernel
        outputs it (the pack for this rank's own tokens, the forward for rows it forwards to itself, the
        copy-out for the rows node peers wrote), the sender's positions riding in the rows' id words; no
        receive-order x is written; a source that sends one expert more tokens than expert_capacity is refused
        on every rank with the same sentence (every rank has every rank's counts after notify): a ValueError
        before any row moves when the host reads the counts, else found by the counts kernel and raised later
        (_fresh). Otherwise a receive-order dispatch, then the permute kernels (base.Backend); its counts are
        checked against the capacity as the landing's are."""
        if not self.lands_expert_major(topk_idx.size(1), num_tokens_per_expert.numel(), config):
            recv_x, _, recv_idx, recv_w, counts, handle, _ = self._fresh(
                x, None, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, 1,
                num_worst_tokens, config, num_tokens_per_rdma_rank, capacity=expert_capacity)
            return self._permuted(recv_x, recv_idx, recv_w, counts, handle, num_tokens_per_expert.numel(),
                                  expert_capacity, capacity_checked=True)
        if x.size(0) > int(self._native.INTERNODE_MAX_EM_POSITION) + 1:
            raise RankLocalError(f"x: {x.size(0)} tokens on rank {self.rank}; an expert-major dispatch across nodes "
                                 f"carries each token's position in 20 bits (at most "
                                 f"{int(self._native.INTERNODE_MAX_EM_POSITION) + 1} tokens per rank)")
        topk_idx = topk_idx.to(torch.int64).contiguous()
        em = _ExpertMajor(positions_in_expert(topk_idx, num_tokens_per_expert.numel(), current_raw_stream()),
                          expert_capacity)
        _, _, recv_idx, recv_w, _, handle, em = self._fresh(
            x, None, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, 1,
            num_worst_tokens, config, num_tokens_per_rdma_rank, em)
        out_rows = handle.num_recv_tokens  # (both made with a row at least: the kernels tell the mode by pointers)
        self._took("dispatch_expert_major", FUSED)
        return em.x_em[:sum(em.per_expert)], recv_idx, recv_w, em.per_expert, em.em_map[:out_rows], handle

    def lands_expert_major(self, num_topk: int, num_experts: int, config: Config) -> bool:
        """Whether dispatch_expert_major stores the expert-major rows from the dispatch kernels (True) or runs
        the separate permute kernels after a receive-order dispatch (False). The kernels give each top-k slot
        a lane (at most _MAX_FUSED_TOPK slots); and as in one node (backends/native.py, _FUSE_MAX_WIDTH)
        rows that land at more than ~2 expert-major rows each are left to the permute kernels, which use the
        whole GPU, rather than to the call's few SMs (one node's "or from 32 SMs" does not apply: a call
        across nodes has few); Config.fuse_max_width replaces that width. The same on every rank (the call's
        shape and Config)."""
        if num_topk > _MAX_FUSED_TOPK:
            return False
        limit = _FUSE_MAX_WIDTH if config.fuse_max_width is None else config.fuse_max_width
        return _expected_width(num_topk, num_experts, self.num_ranks) <= limit

    def _fresh(self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
               num_tokens_per_expert, expert_alignment, num_worst_tokens, config, num_tokens_per_rdma_rank,
               em: Optional["_ExpertMajor"] = None, num_max_tokens_per_rank: int = 0, capacity: int = 0):
        """A fresh dispatch: DeepEP's six outputs, then `em` with its outputs filled (expert-major landing:
        recv_x is then None). `capacity`: an expert-major dispatch's expert_capacity (em's when em is given),
        checked with the counts.

        notify sends this rank's count row to every rank; the counts kernel (on the GPU) waits for every rank's
        row, checks the call against them and writes the call info every kernel of the dispatch, its cached
        dispatches and its combines take. With num_worst_tokens nothing else needs the counts: the outputs are
        sized num_worst_tokens, the buffers from bounds every rank computes alike (sizing.internode_worst_counts,
        grown before notify), and a violation (a rank receiving more, an expert over its capacity, ranks that
        disagree on the shape) is recorded on every rank and raised by a later call or check_errors (the refused
        call's outputs are unspecified; the Buffer must be recreated). A bound past the largest RDMA region
        (no num_max_tokens_per_rank, no capacity) falls back to the host read, every rank alike. Without
        num_worst_tokens the host reads the rows once (the one sync): exact output sizes, growth to the exact
        layout, and those checks raised before any row moves."""
        self._check_usable()  # (the records below, after a sync-free grow: _quiesce_before_grow)
        R, L, N, me = self.num_ranks, self.L, self.N, self.rank
        x = x.contiguous()
        T, hidden = x.shape
        dev = x.device
        x_bytes = hidden * x.element_size()
        scale_bytes = 0 if x_scales is None else x_scales.size(1) * 4
        if x_scales is not None:
            x_scales = x_scales.to(torch.float32).contiguous()
        K = 0 if topk_idx is None else topk_idx.size(1)
        if topk_idx is not None:
            topk_idx = topk_idx.to(torch.int64).contiguous()
            if topk_weights is not None:
                topk_weights = topk_weights.to(torch.float32).contiguous()
        is_token_in_rank = is_token_in_rank.to(torch.bool).contiguous()
        num_experts = num_tokens_per_expert.numel()
        epr = num_experts // R
        if num_tokens_per_rdma_rank is None:
            num_tokens_per_rdma_rank = self.tokens_per_node(is_token_in_rank)
        per_rank = num_tokens_per_rank.to(torch.int32).contiguous()
        per_node = num_tokens_per_rdma_rank.to(torch.int32).contiguous()
        per_expert = num_tokens_per_expert.to(torch.int32).contiguous()
        capacity = capacity if em is None else em.capacity
        header = shape_header(x, x_scales, topk_idx, topk_weights, num_experts, capacity,
                              expert_major_ids=em is not None)
        y_bytes = _combine_row_bytes(x)  # the combine's rows, sized for now too
        if self._unopened is not None:  # collective: every rank is in this dispatch
            refuse_in_capture(self.error_prefix, "the first dispatch of this Buffer opens its buffers and proxies, "
                              "which cannot happen inside CUDA-graph capture; run one dispatch before capturing")
            sizes, self._unopened = self._unopened, None
            try:
                self._open(*sizes)
            except Exception as exc:  # the ranks that got further wait on this one: no second try
                self._failed = f"opening the buffers and proxies in the first dispatch failed: {exc}"
                raise
            # The Buffer checks the caller's stream before each call, but learns what the proxies need only now.
            check_caller_stream(self.waits_for_default_stream, dev, me)
        sync_free = bool(num_worst_tokens)
        if sync_free:  # every size from bounds every rank computes alike: a grow is every rank's or none's
            rd, max_recv = sizing.internode_worst_counts(R, L, int(num_worst_tokens), epr, capacity,
                                                         int(num_max_tokens_per_rank))
            need = _uniform_need(R, L, rd[0], max_recv, x_bytes, scale_bytes, K, y_bytes)
            # a bound past the largest region (no num_max_tokens_per_rank, no capacity, many ranks per node):
            # every rank alike counts on the host instead
            sync_free = need[0] <= sizing.internode_max_rdma_bytes()
            if sync_free:
                self._ensure(*need)
                if em is not None:  # a capacity layout's blocks need no counts: placed before notify's kernels
                    em.place(None, R, num_experts, me, dev)
            else:
                most = sizing.internode_max_rdma_bytes()
                refuse_in_capture(self.error_prefix, f"num_worst_tokens={num_worst_tokens} bounds the buffers at "
                                  f"{need[0]} bytes of RDMA region, past the {most} it can have, so this dispatch "
                                  "reads the counts on the host, which cannot be captured in a CUDA graph; pass "
                                  "num_max_tokens_per_rank (or an expert_capacity) to bound them")
                _say_once(f"uccl_ep_train native internode: num_worst_tokens={num_worst_tokens} bounds the buffers "
                          f"at {need[0]} bytes of RDMA region, past the {sizing.internode_max_rdma_bytes()} it "
                          f"can have: these dispatches read the counts on the host (one sync each); pass "
                          f"num_max_tokens_per_rank to bound them", self.rank)
        self._check()  # every rank grew (and agreed on the records first) or none did
        stream = current_raw_stream()
        self._buf.notify(header, per_rank.data_ptr(), per_node.data_ptr(), per_expert.data_ptr(), num_experts, stream)
        info = torch.empty(self._info_offsets["ints"], dtype=torch.int32, device=dev)
        if sync_free:
            self._buf.counts(int(num_worst_tokens), capacity, rd[0], info.data_ptr(), stream)
            out_rows = int(num_worst_tokens)
            forwarded = N * rd[0]  # what the counts kernel lets the RDMA peers send this node (max_node_rows)
            per_expert_list: list = []
        else:
            rows = self._wait_counts()
            h = int(self._native.INTERNODE_HEADER_INTS)
            counts = rows[:, h:h + R].astype(np.int64)  # counts[s][r]: tokens rank s sends to rank r
            recv_per_rank = counts.sum(axis=0)
            check_worst_tokens(recv_per_rank.tolist(), num_worst_tokens)  # (in the counts kernel's order)
            sent = rows[:, h + R + N:h + R + N + num_experts].astype(np.int64)  # every rank's: one verdict
            if em is not None:
                em.place(sent, R, num_experts, me, dev)
            elif capacity:
                check_expert_capacity(torch.from_numpy(sent), capacity)
            rd_rows = rows[:, h + R:h + R + N]
            rd, max_recv = rd_rows.reshape(-1).tolist(), int(recv_per_rank.max())
            out_rows = int(num_worst_tokens) or int(recv_per_rank[me])
            forwarded = int(rd_rows[[n * L + self.local for n in range(N)], self.node].sum())
            expert_counts = rows[:, h + R + N + me * epr:h + R + N + (me + 1) * epr].sum(axis=0)
            per_expert_list = [] if num_worst_tokens else [-(-int(c) // expert_alignment) * expert_alignment
                                                           for c in expert_counts]
            # before a grow: the rows live in the RDMA region a grow replaces (the host checked them already)
            self._buf.counts(0, capacity, 0, info.data_ptr(), stream)
            self._ensure(*self._need(rd, max_recv, x_bytes, scale_bytes, K, y_bytes))
        send_pos = torch.empty((T, R), dtype=torch.int32, device=dev)  # DeepEP's send_head, send_rdma_head
        node_head = torch.empty((T, N), dtype=torch.int32, device=dev)
        self._buf.send_positions(is_token_in_rank.data_ptr(), T, send_pos.data_ptr(), node_head.data_ptr(), stream)
        state = InternodeState(info, rd, max_recv, send_pos)
        recv_x = torch.empty((out_rows, hidden), dtype=x.dtype, device=dev) if em is None else None
        recv_scales = None if x_scales is None else torch.empty((out_rows, x_scales.size(1)), dtype=torch.float32,
                                                                device=dev)
        recv_idx = torch.empty((out_rows, K), dtype=torch.int64, device=dev) if K else None
        recv_w = torch.empty((out_rows, K), dtype=torch.float32, device=dev) if K else None
        recv_meta = torch.empty((out_rows, 2), dtype=torch.int32, device=dev)
        fwd_head = torch.empty((forwarded, L), dtype=torch.int32, device=dev)
        if em is not None:
            em.allocate(out_rows, K, x)
        self._launch_dispatch(state, x, x_bytes, x_scales, scale_bytes, topk_idx, topk_weights, K, num_experts,
                              node_head, out_rows, recv_x, recv_scales, recv_idx, recv_w, recv_meta, fwd_head, config,
                              em)
        # DeepEP's items, as InternodeHandle.with_one_channel defines them: the counts kernel wrote the prefixes
        # and the dispatch kernels each row's source (token, rank; -1 for padding), so no torch op derives them
        item = lambda name, n: info[self._info_offsets[name]:self._info_offsets[name] + n]  # noqa: E731
        handle = InternodeHandle(
            is_token_in_rank, per_node.reshape(N, 1).clone(), item("counts", R * R)[me * R:(me + 1) * R].view(R, 1),
            item("from_nodes", N).view(N, 1), item("from_ends", N), item("recv_starts", R).view(R, 1),
            item("recv_ends", R), recv_meta.view(torch.uint8), node_head, fwd_head, out_rows, T, L, self.owner, state)
        if recv_idx is not None and recv_w is None:
            recv_w = torch.zeros_like(recv_idx, dtype=torch.float32)
        return recv_x, recv_scales, recv_idx, recv_w, per_expert_list, handle, em

    @functools.cached_property
    def _info_offsets(self) -> dict:
        return dict(self._native.internode_info_offsets(self.num_ranks, self.L))

    def _need(self, rd: list, max_recv: int, x_bytes: int, scale_bytes: int, num_topk: int,
              y_bytes: int) -> tuple[int, int]:
        """(RDMA, NVL) bytes a dispatch of these rows and its combine need on any rank (sizing.internode_need;
        counts alike for every rank, as a bound's are: _uniform_need)."""
        if len(set(rd)) <= 1:
            return _uniform_need(self.num_ranks, self.L, rd[0] if rd else 0, max_recv, x_bytes, scale_bytes,
                                 num_topk, y_bytes)
        return sizing.internode_need(rd, self.num_ranks, self.L, x_bytes, scale_bytes, num_topk, y_bytes, max_recv)

    def _ensure_for(self, st: InternodeState, x_bytes: int, scale_bytes: int, num_topk: int, y_bytes: int) -> None:
        """Grows the buffers (collectively) to what a dispatch of these rows and its combine need on any rank."""
        self._ensure(*self._need(st.rd, st.max_recv, x_bytes, scale_bytes, num_topk, y_bytes))

    def _launch_dispatch(self, st, x, x_bytes, x_scales, scale_bytes, topk_idx, topk_weights, num_topk, num_experts,
                         node_head, out_rows, recv_x, recv_scales, recv_idx, recv_w, recv_meta, fwd_head, config,
                         em: Optional["_ExpertMajor"] = None):
        row = int(self._native.internode_row_bytes(x_bytes, scale_bytes, num_topk, self.L))
        em_args = (0, 0, 0, 0, 0) if em is None else (
            em.topk_pos.data_ptr(), em.em_base.data_ptr(), em.x_em.data_ptr(), em.em_map.data_ptr(), em.x_em.size(0))
        self._buf.dispatch(st.info.data_ptr(), x.size(0), x.data_ptr(), x_bytes, _ptr(x_scales), scale_bytes,
                           _ptr(topk_idx), _ptr(topk_weights), num_topk, num_experts, st.send_pos.data_ptr(),
                           node_head.data_ptr(), out_rows, _ptr(recv_x), _ptr(recv_scales), _ptr(recv_idx),
                           _ptr(recv_w), _ptr(recv_meta), _ptr(fwd_head), *em_args, self._num_sms(config),
                           self._chunk_rows(row), current_raw_stream())

    @staticmethod
    def _state(handle) -> InternodeState:
        if not isinstance(handle, InternodeHandle) or not isinstance(handle.private, InternodeState):
            raise ValueError("handle: not made by the native internode backend")
        return handle.private

    def cached_dispatch(self, x, x_scales, handle, config):
        self._check()
        st = self._state(handle)
        x = x.contiguous()
        hidden = x.size(1)
        x_bytes = hidden * x.element_size()
        if x_scales is not None:
            x_scales = x_scales.to(torch.float32).contiguous()
        scale_bytes = 0 if x_scales is None else x_scales.size(1) * 4
        self._ensure_for(st, x_bytes, scale_bytes, 0, 0)
        out_rows = handle.num_recv_tokens
        recv_x = torch.empty((out_rows, hidden), dtype=x.dtype, device=x.device)
        recv_scales = None if x_scales is None else torch.empty((out_rows, x_scales.size(1)), dtype=torch.float32,
                                                                device=x.device)
        self._launch_dispatch(st, x, x_bytes, x_scales, scale_bytes, None, None, 0, self.num_ranks,
                              handle.send_rdma_head, out_rows, recv_x, recv_scales, None, None, None, None, config)
        return recv_x, recv_scales

    # ---- combine -------------------------------------------------------------------------------------
    def combine(self, x, handle, topk_weights, bias_0, bias_1, config):
        self._check()
        st = self._state(handle)
        if x.dtype not in _DTYPE_CODES:
            raise TypeError(f"x: the native backend combines bfloat16, float16 or float32 rows, got {x.dtype}")
        x = x.contiguous()
        hidden = x.size(1)
        K = 0 if topk_weights is None else topk_weights.size(1)
        if topk_weights is not None:
            topk_weights = topk_weights.to(torch.float32).contiguous()
        self._ensure_for(st, 0, 0, K, hidden * x.element_size())
        biases = [None if b is None else b.to(x.dtype).contiguous() for b in (bias_0, bias_1)]
        T = handle.num_tokens
        out = torch.empty((T, hidden), dtype=x.dtype, device=x.device)
        out_w = torch.empty((T, K), dtype=torch.float32, device=x.device) if K else None
        crow = int(self._native.internode_combine_row_bytes(hidden * x.element_size(), K))
        self._buf.combine(st.info.data_ptr(), T, x.data_ptr(), _DTYPE_CODES[x.dtype], hidden, _ptr(topk_weights), K,
                          x.size(0), handle.send_rdma_head.data_ptr(), handle.send_nvl_head.data_ptr(),
                          _ptr(biases[0]), _ptr(biases[1]), out.data_ptr(), _ptr(out_w), self._num_sms(config),
                          self._chunk_rows(crow), current_raw_stream())
        return out, out_w


@dataclass
class _ExpertMajor:
    """An expert-major dispatch across nodes (NativeInternodeBackend.dispatch_expert_major): its inputs, then,
    once notify gave every rank's counts, where each (source, local expert) block lands and the outputs."""

    topk_pos: torch.Tensor  # int32 [T, K]: each slot's row among this rank's tokens for its expert, -1: none
    capacity: int  # expert_capacity (0: exact counts)
    em_base: Optional[torch.Tensor] = None  # int32 [R, experts per rank]: first expert-major row of each block
    per_expert: Optional[list] = None  # rows per local expert (tokens_per_expert)
    x_em: Optional[torch.Tensor] = None
    em_map: Optional[torch.Tensor] = None

    def place(self, sent: Optional[np.ndarray], num_ranks: int, num_experts: int, rank: int, device) -> None:
        """This rank's block bases, in expert-major order (local expert, then source). With a capacity, whole
        blocks of `capacity` rows, known without the counts; `sent` (every source's tokens per expert [R, E],
        a synced dispatch's) is then checked here (every rank checks every block: the same error everywhere;
        None: the counts kernel checks them on the GPU). Exact counts need `sent`."""
        R, epr = num_ranks, num_experts // num_ranks
        if self.capacity:
            if sent is not None:
                check_expert_capacity(torch.from_numpy(sent), self.capacity)
            self.em_base = _capacity_bases(R, epr, self.capacity, torch.device(device))
            self.per_expert = [R * self.capacity] * epr
            return
        mine = sent[:, rank * epr:(rank + 1) * epr]
        totals = mine.sum(axis=0)
        base = (np.cumsum(totals) - totals)[None, :] + (np.cumsum(mine, axis=0) - mine)
        self.per_expert = [int(t) for t in totals]
        self.em_base = to_device(base.astype(np.int32), device)

    def allocate(self, out_rows: int, num_topk: int, x: torch.Tensor) -> None:
        """The outputs: x_em (a capacity layout's unfilled rows stay zeros; at least one row, so that the kernels
        see a pointer) and em_map [out_rows, K] (the kernels write every row of it)."""
        rows = max(sum(self.per_expert), 1)
        self.x_em = (torch.zeros if self.capacity else torch.empty)((rows, x.size(1)), dtype=x.dtype,
                                                                    device=x.device)
        self.em_map = torch.empty((max(out_rows, 1), num_topk), dtype=torch.int32, device=x.device)


@functools.lru_cache(maxsize=256)
def _uniform_need(num_ranks: int, ranks_per_node: int, per_node: int, max_recv: int, x_bytes: int,
                  scale_bytes: int, num_topk: int, y_bytes: int) -> tuple[int, int]:
    """sizing.internode_need of counts alike for every (source, node) pair, as a sync-free dispatch's bound is:
    one rank's layout serves all. Cached: a sync-free dispatch asks on every call, with the same shape."""
    rd = [per_node] * (num_ranks * (num_ranks // ranks_per_node))
    return sizing.internode_need(rd, num_ranks, ranks_per_node, x_bytes, scale_bytes, num_topk, y_bytes, max_recv,
                                 ranks=[0])


@functools.lru_cache(maxsize=64)
def _capacity_bases(num_ranks: int, num_local_experts: int, capacity: int, device: torch.device) -> torch.Tensor:
    """int32 [R, local experts] on `device`: block (expert e, source s) of a capacity layout starts at row
    (e x R + s) x capacity. Read only (the kernels take it as const): one per shape and device, not a copy per
    call."""
    e, s = np.arange(num_local_experts)[None, :], np.arange(num_ranks)[:, None]
    return to_device(((e * num_ranks + s) * capacity).astype(np.int32), device)


def check_worst_tokens(recv_per_rank: list[int], num_worst_tokens: int) -> None:
    """Raises unless num_worst_tokens (0: not given) bounds what every rank receives (a dispatch that counts on
    the host). It takes every rank's receive count (notify gives each rank all of them), not this rank's, so
    every rank raises, before its kernels, or none does: a rank refusing alone would leave its peers' kernels
    waiting for it until the timeout (UCCL_EP_TIMEOUT_S). (Without a host sync the counts kernel checks it.)"""
    if not num_worst_tokens:
        return
    busiest = max(range(len(recv_per_rank)), key=lambda r: recv_per_rank[r])
    if recv_per_rank[busiest] > num_worst_tokens:
        raise RuntimeError(f"dispatch: rank {busiest} receives {recv_per_rank[busiest]} tokens, more than "
                           f"num_worst_tokens={num_worst_tokens} (pass at least that many on every rank)")


_said: set = set()


def _say_once(message: str, rank: int) -> None:
    """A warning rank 0 logs once per process."""
    if rank == 0 and message not in _said:
        _said.add(message)
        log.warning(message)


def _shared_gpu_proxy_options(ranks_per_gpu: int, cpus: int, proxy_groups: int) -> dict:
    """Proxy options when ranks share a GPU (emulated nodes): every rank's proxy threads spin, so pinning them
    (each rank would take the same cores near the GPU) or running more of them than the cores hold makes
    spinners time-slice one core, at milliseconds per command. Then: no pinning, and as many threads as a
    rank's share of the cores holds, counting each thread's ipc copy agent (a process that spins while copies
    come), the rank's own thread and every proxy group the rank runs (`proxy_groups`: 2 for a low-latency
    Buffer, whose LL calls have proxies of their own): (cpus / ranks per GPU - 1) / (2 x groups), at least 1,
    at most 4, unless UCCL_EP_PROXY_THREADS says otherwise. Measured on 16 cores, 2 x 2 emulated ranks, BF16
    dispatch: 1 thread 37 GB/s, 2 threads 12 GB/s; 2 x 1 LL dispatch (one H100, 2 groups per rank): 3 threads
    per group, the write landed 3-7 ms after the send kernel; 1 thread, 11 µs. `cpus`: the fewest any rank
    may run on (every rank must run as many threads)."""
    if ranks_per_gpu <= 1:
        return {}
    options: dict = {"pin_threads": False}
    if "UCCL_EP_PROXY_THREADS" not in os.environ:
        options["num_threads"] = max(1, min(4, (cpus // ranks_per_gpu - 1) // (2 * proxy_groups)))
    return options


def _ptr(t: Optional[torch.Tensor]) -> int:
    """A tensor's address for the native module: 0 for None, and for no elements (an empty tensor's data_ptr()
    is 0 anyway). What the ranks must agree on never rides on it: row layouts and checks take counts (num_topk,
    scale bytes, the shape header's weights bit), so a 0 from an empty tensor only ever stands for zero rows,
    which no kernel reads or writes (a rank that received nothing passes [0, K] weights to combine)."""
    return 0 if t is None or t.numel() == 0 else t.data_ptr()
