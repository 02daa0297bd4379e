"""DeepEP V2's `ElasticBuffer` call shapes for the training path, over our `Buffer`.

DeepEP V2 (2.x, 2026-04; `deep_ep/buffers/elastic.py`) moved its users to `ElasticBuffer.dispatch /
combine`, whose training-relevant novelties are the *expanding* layout (`do_expand=True`: one received row
per (token, local expert), grouped by local expert, each expert's block starting at a multiple of
`expert_alignment`), dispatches without a CPU sync (`do_cpu_sync=False`: outputs sized for the worst case,
counts on the device only: CUDA-graph friendly) and a handle (`EPHandle`) that carries the layout for the
combine and for cached dispatches. This module gives code written for those calls our Buffer underneath, so
it switches by import (`from deep_ep import ElasticBuffer` with our deep_ep, uccl_ep_train.compat), as V1
code does today. docs/deep_ep.md ("DeepEP V2: ElasticBuffer") lists the semantics side by side with V2's.

How the calls map: a dispatch is `Buffer.get_dispatch_layout` + `Buffer.dispatch` (with
`num_worst_tokens = num_ranks * num_max_tokens_per_rank` when `do_cpu_sync=False`); the expanding layout is
`permute.expert_major_map` shifted to aligned expert starts + `permute.expand_rows_raw` (rows keep their
receive order within an expert: source rank, then source token, which is V2's order with
`deterministic=True`); the expanded combine folds each received token's expert rows (`permute.reduce_rows_raw`,
float32 in slot order) and combines the sums (`Buffer.combine`), V2's `allow_multiple_reduction=True`.
Every step is device work with sizes known on the host, so without a CPU sync nothing waits for the GPU,
within one node: across nodes the internode backend still reads the per-node counts on the host (one
sync per fresh dispatch, `num_worst_tokens` included) to size its transfers, so there `do_cpu_sync=False`
gives the worst-case shapes but not a sync-free call.
With a CPU sync and expert_alignment 1 the expanded layout is exactly our expert-major one, so those calls
go to `Buffer.dispatch_expert_major` / `dispatch_expert_major_cached` / `combine_expert_major`, which the
native backend fuses with the transfer (the same values: the reference backend composes them as above).
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import permute
from .buffer import Buffer
from .config import Config, default_nvl_bytes
from .events import EventHandle, EventOverlap, host_values
from .handles import HTHandle, rows_per_source

topk_idx_t = torch.int64  # DeepEP V2's `deep_ep.topk_idx_t`

_NOT_OURS = "not supported by uccl-ep-train's ElasticBuffer"


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _always(event: Optional[EventOverlap]) -> EventOverlap:
    """V2 returns an event from every call and its users wait on it unconditionally; our Buffer returns one
    without a CUDA event when the call was not async (its work is then already ordered before the current
    stream's next work), so an event recorded here, on the current stream, marks the same point."""
    return event if event is not None and event.event is not None else EventOverlap(EventHandle())


@dataclasses.dataclass
class EPHandle:
    """The layout of one `ElasticBuffer.dispatch`, for its combine and for cached dispatches (V2's EPHandle
    fields, plus ours).

    V2's fields, with V2's meaning (one node = one scaleup domain; across nodes the "scaleup" sums are over
    all ranks): do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms, topk_idx (the
    sender's ids), num_recv_tokens (received rows: exact with a CPU sync, else the worst case),
    num_expanded_tokens (rows of the expanded outputs), num_recv_tokens_per_expert_list (aligned counts on
    the host; empty without a CPU sync), psum_num_recv_tokens_per_scaleup_rank (int32 [num_ranks], inclusive
    prefix sum of the rows received from each source rank), psum_num_recv_tokens_per_expert (int32
    [num_local_experts]: expand mode: aligned start + real count of each expert; otherwise the inclusive prefix
    sum of the aligned counts), num_unaligned_recv_tokens_per_expert (int32 [num_local_experts], expand mode),
    recv_src_metadata (int32 [num_recv_tokens, 2 + num_topk]: column 0 the source's global token index
    `src_rank * num_max_tokens_per_rank + token`, column 1 the source rank (V2: a buffer slot), columns 2.. the
    expanded row of each top-k slot, -1 for none (expand mode; -1 otherwise); rows past the received ones
    are -1).
    Ours: `inner` (the Buffer's handle), `expand_map` (= recv_src_metadata[:, 2:], the map the combine folds
    with), `recv_topk_idx` (local ids in receive order, returned again by cached dispatches), `fused` (the
    expert-major calls serve this layout: expand mode with a CPU sync and expert_alignment 1)."""
    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: torch.Tensor
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: List[int]
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor
    psum_num_recv_tokens_per_expert: torch.Tensor
    num_unaligned_recv_tokens_per_expert: Optional[torch.Tensor]
    recv_src_metadata: torch.Tensor
    inner: HTHandle
    expand_map: Optional[torch.Tensor]
    recv_topk_idx: torch.Tensor
    fused: bool = False  # made by Buffer.dispatch_expert_major (exact counts, alignment 1): its pair serves it


class ElasticBuffer:
    """DeepEP V2's ElasticBuffer for expert-parallel dispatch / combine, on uccl_ep_train's Buffer.

    Not provided: Engram, pipeline-parallel send/recv and all-gather / reduce-scatter (V2's other uses of
    the buffer), FP8 in the expanding layout, TMA-aligned scale factors, CPU memory (`num_cpu_bytes`)."""

    def __init__(self, group: dist.ProcessGroup, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False) -> None:
        """Arguments as V2's. Used: group; num_bytes (our Buffer's NVLink bytes) or, without it, hidden
        (the size our kernels' chunked layout needs for rows of `hidden` bf16 values: it does not grow with
        the token count); num_max_tokens_per_rank (the default for dispatch); use_fp8_dispatch (rows of
        `hidden` FP8 bytes + scales when sizing); explicitly_destroy. `deterministic` is accepted either way:
        our receive order is always deterministic (source rank, then token). allow_multiple_reduction=False
        (one reduction per token) is refused: the expanded combine folds on the expert's rank first.
        allow_hybrid_mode, prefer_overlap_with_compute, sl_idx, num_allocated_qps and the timeouts tune V2's
        NCCL-GIN transport and have no counterpart here (our deadline: UCCL_EP_TIMEOUT_S; our SMs:
        `num_sms` per call or Buffer.set_num_sms)."""
        if num_cpu_bytes:
            raise NotImplementedError(f"ElasticBuffer: num_cpu_bytes (CPU / Engram storage) is {_NOT_OURS}; pass 0")
        if not allow_multiple_reduction:
            raise NotImplementedError("ElasticBuffer: allow_multiple_reduction=False is " + _NOT_OURS + ": the "
                                      "expanded combine sums a token's expert rows on their rank, then across ranks")
        for name, v in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("hidden", hidden),
                        ("num_topk", num_topk)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"ElasticBuffer: {name} must be a non-negative int, got {v!r}")
        num_ranks = group.size()
        if num_bytes is None:
            if not hidden:
                raise ValueError("ElasticBuffer: pass num_bytes, or hidden (and num_max_tokens_per_rank) to size "
                                 "the buffer from")
            num_bytes = self.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk,
                                                  use_fp8_dispatch)
        self.group = group
        self.rank_idx = group.rank()
        self.num_ranks = num_ranks
        self.deterministic = deterministic
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.buffer = Buffer(group, int(num_bytes), 0, explicitly_destroy=explicitly_destroy)
        self.num_bytes = self.buffer.num_nvl_bytes
        topology = self.buffer.topology
        self.num_scaleout_ranks, self.num_scaleup_ranks = topology.num_nodes, topology.ranks_per_node
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks

    # ---- sizes, lifecycle, streams ---------------------------------------------------------------------
    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """NVLink bytes our kernels need for rows of `hidden` values (bf16, or FP8 + float32 scales per 128):
        the largest of the dispatch's and combine's chunked layouts (as megatron_patch sizes its Buffers).
        It does not grow with num_max_tokens_per_rank: the kernels stream rows through fixed chunks."""
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden <= 0:
            raise ValueError(f"get_buffer_size_hint: hidden must be a positive int, got {hidden!r}")
        num_ranks = group.size()
        dispatch_bytes = hidden + hidden // 128 * 4 if use_fp8_dispatch else hidden * 2
        return default_nvl_bytes(dispatch_bytes, num_ranks, Buffer.num_sms, combine_bytes=hidden * 2)

    def destroy(self) -> None:
        """Release the Buffer (collective); requires explicitly_destroy=True at construction, as V2's."""
        if not self.explicitly_destroy:
            raise RuntimeError("ElasticBuffer.destroy: construct with explicitly_destroy=True to destroy explicitly")
        self.buffer.destroy()

    @staticmethod
    def capture() -> EventOverlap:
        """An event at the current point of the current stream (for `previous_event`)."""
        return Buffer.capture()

    def get_comm_stream(self) -> Optional[torch.Stream]:
        return self.buffer.get_comm_stream()

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """(nodes, ranks per node)."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """A barrier over the group (the host waits for the device first when with_cpu_sync)."""
        if with_cpu_sync and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        dist.barrier(group=self.group)

    # ---- dispatch / combine ----------------------------------------------------------------------------
    def _config(self, num_sms: int, default: Config) -> Optional[Config]:
        if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 0:
            raise ValueError(f"num_sms must be a non-negative int (0: the Buffer's), got {num_sms!r}")
        return dataclasses.replace(default, num_sms=num_sms) if num_sms else None

    @staticmethod
    def _event(previous_event) -> Optional[EventOverlap]:
        if previous_event is None or isinstance(previous_event, EventOverlap):
            return previous_event
        if isinstance(previous_event, EventHandle):
            return EventOverlap(previous_event)
        raise ValueError(f"previous_event: expected an event from ElasticBuffer.capture(), got {type(previous_event)}")

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False):
        """V2's dispatch: returns (recv_x, recv_topk_idx, recv_topk_weights, handle, event).

        Non-expand: recv_x `[num_recv_tokens, hidden]` in receive order (source rank, then token),
        recv_topk_idx `[num_recv_tokens, num_topk]` local expert ids (-1: elsewhere), recv_topk_weights the
        same shape (0 there). Expand (`do_expand=True`): recv_x `[num_expanded_tokens, hidden]`, expert e's
        rows at `align(psum[e-1]) .. psum[e]` (psum = handle.psum_num_recv_tokens_per_expert), within an
        expert by source rank then token, padding rows zero (always: `do_zero_padding` is what we do anyway),
        recv_topk_idx None, recv_topk_weights `[num_expanded_tokens]` (the weight of each row, 0 in padding).
        do_cpu_sync (default True, False with a handle): exact sizes read on the host; False: worst-case
        sizes (`num_ranks * num_max_tokens_per_rank` received rows; expanded: that times
        min(num_topk, num_local_experts) plus alignment slack), nothing read on the host, rows past the
        received ones zero / -1.
        With `handle` (cached): the same layout, `topk_idx` None; recv_topk_idx is the handle's; topk_weights
        are not re-sent (None). The expansion runs on the current stream after the dispatch: with
        async_with_compute_stream the Buffer's dispatch runs on its comm stream and the current stream waits for it
        before expanding. num_qps and previous_event_before_epilogue (V2's RDMA QPs and copy epilogue)
        have no counterpart and must be left at their defaults."""
        if num_qps:
            raise NotImplementedError(f"dispatch: num_qps is {_NOT_OURS} (no RDMA QPs to pick); leave it 0")
        if previous_event_before_epilogue is not None:
            raise NotImplementedError(f"dispatch: previous_event_before_epilogue is {_NOT_OURS}; use previous_event")
        if use_tma_aligned_col_major_sf:
            raise NotImplementedError(f"dispatch: use_tma_aligned_col_major_sf is {_NOT_OURS}")
        if do_zero_padding and not do_expand:
            raise ValueError("dispatch: do_zero_padding needs do_expand=True (as in DeepEP V2)")
        if do_expand and isinstance(x, tuple):
            raise NotImplementedError(f"dispatch: FP8 (x, scales) pairs with do_expand=True are {_NOT_OURS}; "
                                      "dispatch bf16 rows, or FP8 without do_expand")
        previous_event = self._event(previous_event)
        config = self._config(num_sms, Buffer.get_dispatch_config(self.num_ranks))
        used_sms = num_sms or Buffer.num_sms
        buf = self.buffer
        if handle is not None:
            if not isinstance(handle, EPHandle):
                raise ValueError(f"handle: expected an EPHandle from ElasticBuffer.dispatch, got {type(handle)}")
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("dispatch: topk_idx and topk_weights must be None with a cached handle (the handle "
                                 "holds the layout; weights are not re-sent)")
            if do_cpu_sync:
                raise ValueError("dispatch: do_cpu_sync=True with a cached handle (nothing to sync: the handle has "
                                 "the sizes)")
            for name, v, h in (("num_experts", num_experts, handle.num_experts),
                               ("num_max_tokens_per_rank", num_max_tokens_per_rank, handle.num_max_tokens_per_rank),
                               ("expert_alignment", expert_alignment, handle.expert_alignment)):
                if v is not None and v != h:
                    raise ValueError(f"dispatch: {name}={v} disagrees with the cached handle's {h}")
            if do_expand != handle.do_expand:
                raise ValueError(f"dispatch: do_expand={do_expand} disagrees with the cached handle's "
                                 f"{handle.do_expand}")
            if handle.fused:
                x_exp, event = buf.dispatch_expert_major_cached(
                    x, handle.inner, handle.expand_map, handle.num_expanded_tokens, config=config,
                    previous_event=previous_event, async_finish=async_with_compute_stream,
                    allocate_on_comm_stream=allocate_on_comm_stream)
                return x_exp, None, None, handle, _always(event)
            recv_x, _, _, _, _, event = buf.dispatch(x, handle=handle.inner, config=config,
                                                     previous_event=previous_event,
                                                     async_finish=async_with_compute_stream,
                                                     allocate_on_comm_stream=allocate_on_comm_stream)
            event = _always(event)
            if not handle.do_expand:
                return recv_x, handle.recv_topk_idx, None, handle, event
            event.current_stream_wait()
            x_exp = permute.expand_rows_raw(recv_x, handle.expand_map, handle.num_expanded_tokens, padded=True)
            return x_exp, None, None, handle, Buffer.capture()

        if topk_idx is None or num_experts is None:
            raise ValueError("dispatch: topk_idx and num_experts are required without a cached handle")
        num_tokens = (x[0] if isinstance(x, tuple) else x).size(0)
        T = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
        if isinstance(T, bool) or not isinstance(T, int) or T < num_tokens or T <= 0:
            raise ValueError(f"num_max_tokens_per_rank: {T!r} must be an int >= this rank's {num_tokens} tokens "
                             "(the same on every rank; set it here or in the ElasticBuffer constructor)")
        align = 1 if expert_alignment is None else expert_alignment
        if isinstance(align, bool) or not isinstance(align, int) or align < 1:
            raise ValueError(f"expert_alignment must be a positive int, got {expert_alignment!r}")
        sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        R, k = self.num_ranks, topk_idx.size(1) if topk_idx.dim() == 2 else 0
        # exact counts without alignment: our expert-major dispatch lands V2's expanded layout as it is (the
        # native backend copies received rows straight to their expert rows)
        fused = do_expand and sync and align == 1
        if fused:
            x_exp, recv_idx, recv_w, counts, em, inner, event = buf.dispatch_expert_major(
                x, topk_idx, topk_weights, num_experts, config=config, previous_event=previous_event,
                async_finish=async_with_compute_stream, allocate_on_comm_stream=allocate_on_comm_stream)
        else:
            per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(
                topk_idx, num_experts, previous_event=previous_event, async_finish=False,
                allocate_on_comm_stream=False)
            recv_x, recv_idx, recv_w, counts, inner, event = buf.dispatch(
                x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                expert_alignment=1 if do_expand else align, num_worst_tokens=0 if sync else T * R, config=config,
                async_finish=async_with_compute_stream, allocate_on_comm_stream=allocate_on_comm_stream,
                num_max_tokens_per_rank=0 if sync else T)
        event = _always(event)
        if do_expand or cumulative_local_expert_recv_stats is not None:
            event.current_stream_wait()
        L = num_experts // R
        exact = permute.tokens_per_expert(recv_idx, L)  # int32 [L], device: real counts per local expert
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(exact.to(cumulative_local_expert_recv_stats.dtype))
        num_recv = recv_idx.size(0)
        sources = rows_per_source(inner, self.rank_idx)  # int64 [R]
        metadata = self._metadata(inner, sources, num_recv, T, k)
        saved_idx = topk_idx.clone() if do_handle_copy else topk_idx
        if not do_expand:
            # the aligned counts on the device (with sync, the same values as `counts`: no host-to-device copy)
            psum = ((exact + align - 1) // align * align).cumsum(0, dtype=torch.int32)
            h = EPHandle(False, num_experts, align, T, used_sms, saved_idx, num_recv, 0, list(counts) if sync else [],
                         sources.cumsum(0).to(torch.int32), psum, None, metadata, inner, None, recv_idx)
            return recv_x, recv_idx, recv_w, h, event

        aligned = (exact + align - 1) // align * align
        starts = aligned.cumsum(0, dtype=torch.int32) - aligned  # aligned start of each expert's block
        if fused:
            counts_list = list(counts)
            rows = sum(counts_list)
        elif sync:
            counts_list = host_values(aligned)
            rows = sum(counts_list)
        else:
            counts_list = []
            rows = _align(R * T * min(k, L) + (align - 1) * L, align)
        if not fused:
            em = permute.expert_major_map(recv_idx, exact)  # rows at exact (unaligned) expert starts
            if align > 1:
                shift = torch.cat([starts - (exact.cumsum(0, dtype=torch.int32) - exact), starts.new_zeros(1)])
                key = torch.where(em >= 0, recv_idx, L).long()
                em = torch.where(em >= 0, em + shift[key], em).to(torch.int32).contiguous()
            x_exp = permute.expand_rows_raw(recv_x, em, rows, padded=True)
        metadata[:, 2:] = em
        w_exp = (None if recv_w is None else
                 permute.expand_rows_raw(recv_w.reshape(-1, 1), em.reshape(-1, 1), rows, padded=True).reshape(-1))
        h = EPHandle(True, num_experts, align, T, used_sms, saved_idx, num_recv, rows, counts_list,
                     sources.cumsum(0).to(torch.int32), (starts + exact).to(torch.int32), exact, metadata, inner,
                     em, recv_idx, fused)
        return x_exp, None, w_exp, h, Buffer.capture()

    def _metadata(self, inner: HTHandle, sources: torch.Tensor, num_recv: int, T: int, k: int) -> torch.Tensor:
        """recv_src_metadata: global source token index, source rank, then k columns of -1 (expand: the map)."""
        dev = sources.device
        src_rank = torch.bucketize(torch.arange(num_recv, device=dev), sources.cumsum(0), right=True)
        src_tok = inner.recv_src_idx.to(torch.int64)[:num_recv]
        valid = src_rank < sources.numel()
        meta = torch.full((num_recv, 2 + k), -1, dtype=torch.int32, device=dev)
        meta[:, 0] = torch.where(valid, src_rank * T + src_tok, -1).to(torch.int32)
        meta[:, 1] = torch.where(valid, src_rank, -1).to(torch.int32)
        return meta

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None, num_sms: int = 0,
                num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """V2's combine: returns (combined_x `[num_tokens, hidden]`, combined_topk_weights `[num_tokens,
        num_topk]` or None, event).

        Non-expand: x `[num_recv_tokens, hidden]` in receive order, topk_weights `[num_recv_tokens, num_topk]`:
        both summed over the ranks each token went to (Buffer.combine). Expand: x `[num_expanded_tokens,
        hidden]` (one row per token and local expert, the dispatch's layout; padding rows are not read),
        topk_weights `[num_expanded_tokens]`: each token's expert rows are summed on this rank (float32, slot
        order), then over ranks; the weights return to their (token, slot) places, so a round trip gives back
        the sender's top-k weights. bias: one or two `[num_tokens, hidden]` tensors added to the result."""
        if num_qps:
            raise NotImplementedError(f"combine: num_qps is {_NOT_OURS}; leave it 0")
        if previous_event_before_epilogue is not None:
            raise NotImplementedError(f"combine: previous_event_before_epilogue is {_NOT_OURS}; use previous_event")
        if not isinstance(handle, EPHandle):
            raise ValueError(f"handle: expected an EPHandle from ElasticBuffer.dispatch, got {type(handle)}")
        config = self._config(num_sms or handle.num_sms, Buffer.get_combine_config(self.num_ranks))
        previous_event = self._event(previous_event)
        if handle.do_expand:
            if x.dim() != 2 or x.size(0) != handle.num_expanded_tokens:
                raise ValueError(f"x: expected [{handle.num_expanded_tokens}, hidden] expanded rows (the dispatch's), "
                                 f"got {list(x.shape)}")
            if topk_weights is not None and tuple(topk_weights.shape) != (handle.num_expanded_tokens,):
                raise ValueError(f"topk_weights: expected [{handle.num_expanded_tokens}] (one weight per expanded "
                                 f"row), got {list(topk_weights.shape)}")
            em = handle.expand_map
            if topk_weights is not None:  # each (received token, slot) takes its row's weight back
                topk_weights = torch.where(em >= 0, topk_weights[em.clamp(min=0).long()], 0).to(torch.float32)
            if handle.fused and bias is None:  # the fold inside the combine (native: in its kernel, where faster)
                combined, combined_w, event = self.buffer.combine_expert_major(
                    x, handle.inner, em, topk_weights=topk_weights, config=config, previous_event=previous_event,
                    async_finish=async_with_compute_stream, allocate_on_comm_stream=allocate_on_comm_stream)
                return combined, combined_w, _always(event)
            if previous_event is not None:
                previous_event.current_stream_wait()
                previous_event = None
            x = permute.reduce_rows_raw(x, em, em.size(0))
        combined, combined_w, event = self.buffer.combine(
            x, handle.inner, topk_weights=topk_weights, bias=bias, config=config, previous_event=previous_event,
            async_finish=async_with_compute_stream, allocate_on_comm_stream=allocate_on_comm_stream)
        return combined, combined_w, _always(event)
