"""The reference backend: every Buffer call on torch.distributed alone (gloo on CPU, NCCL on GPU).

It defines the semantics the native kernels must reproduce and is the oracle of every test. It favours
obviously-correct over fast: per-token data (x, scales, top-k ids, weights, source index) is packed into
one byte row per (token, destination rank) and moved by one `all_to_all_single`; counts travel first in a
small all-gather (the "notify" phase), which the host reads to size the receive.

Order rules (DeepEP's): received rows are grouped by source rank, then source token index, whether or not
the ranks span several nodes (the rows are the same; only the handle differs: an InternodeHandle, whose
items need the routing of this rank's same-index peers, gathered here). Low-latency rows of one local
expert are grouped by source rank, then token index.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..config import Config
from ..errors import ranks_disagree
from ..fp8 import per_token_cast_to_fp8
from ..handles import (InternodeHandle, IntranodeHandle, LowLatencyHandle, forwarded_rows, prefix_matrix_from_counts,
                       rows_per_source, send_head_of, send_positions)
from ..topology import Topology
from ..validation import check_expert_capacity
from .base import Backend
from .collectives import Comm
from .rows import pack_rows, unpack_rows

# Identifies x's dtype in the cross-rank consistency check of the notify phase.
_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float8_e4m3fn: 4,
                torch.float8_e4m3fnuz: 5}
_HEADER = ("num_experts", "hidden", "x dtype", "num_topk", "FP8 scales", "topk_weights given")


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class ReferenceBackend(Backend):
    name = "reference"
    capture_refusal = "it synchronises with the host in every call (torch.distributed collectives)"

    def __init__(self, group, rank, num_ranks, owner, num_nvl_bytes, num_rdma_bytes, device: torch.device, *,
                 topology: Optional[Topology] = None):
        super().__init__(group, rank, num_ranks, owner, num_nvl_bytes, num_rdma_bytes, topology=topology)
        self.device = device
        self.comm = Comm(group, rank, num_ranks, device)
        self._ll_combine_buffers: dict[tuple, torch.Tensor] = {}

    # ---- layout --------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts):
        num_local = num_experts // self.num_ranks
        valid = topk_idx >= 0
        rank_idx = torch.where(valid, topk_idx // num_local, -1)
        num_tokens_per_expert = torch.bincount(topk_idx[valid].view(-1), minlength=num_experts).to(torch.int32)
        ranks = torch.arange(self.num_ranks, device=topk_idx.device)
        is_token_in_rank = (rank_idx.unsqueeze(2) == ranks.view(1, 1, -1)).any(dim=1)
        num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
        return num_tokens_per_rank, self.tokens_per_node(is_token_in_rank), num_tokens_per_expert, is_token_in_rank

    # ---- notify: counts and a cross-rank consistency check -----------------------------------------
    def _notify(self, header: list[int], counts: Optional[torch.Tensor], phase: str) -> Optional[torch.Tensor]:
        """Check that every rank called with the same shapes (else a ValueError on every rank), then
        all-gather `counts` ([num_ranks, *])."""
        h = torch.tensor(header + [0] * (len(_HEADER) - len(header)), dtype=torch.int64, device=self.device)
        all_h = self.comm.all_gather(h, f"{phase}: notify header").tolist()
        for i, name in enumerate(_HEADER):
            values = [row[i] for row in all_h]
            if len(set(values)) > 1:
                raise ValueError(ranks_disagree(phase, name, values))
        return None if counts is None else self.comm.all_gather(counts.to(torch.int64), f"{phase}: notify counts")

    # ---- high throughput -------------------------------------------------------------------------------
    def dispatch(self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert, expert_alignment, num_worst_tokens, config: Config, num_tokens_per_rdma_rank,
                 num_max_tokens_per_rank=0):
        R, me = self.num_ranks, self.rank
        num_experts = num_tokens_per_expert.numel()
        num_local = num_experts // R
        header = [num_experts, x.size(1), _DTYPE_CODES[x.dtype], 0 if topk_idx is None else topk_idx.size(1),
                  0 if x_scales is None else 1, int(topk_weights is not None)]
        num_tokens = num_tokens_per_rank.new_tensor([x.size(0)])
        gathered = self._notify(header, torch.cat([num_tokens_per_rank, num_tokens_per_expert, num_tokens]),
                                "dispatch")
        counts = gathered[:, :R]  # counts[i][r]: tokens rank i sends to rank r
        recv_counts = counts[:, me].tolist()
        per_expert = gathered[:, R + me * num_local: R + (me + 1) * num_local].sum(dim=0).tolist()

        token_ids, dest = self._send_order(is_token_in_rank)
        cols = [x[token_ids], None if x_scales is None else x_scales[token_ids]]
        if topk_idx is not None:
            idx = topk_idx[token_ids]
            lo = (dest * num_local).unsqueeze(1)
            local = (idx >= lo) & (idx < lo + num_local)
            cols.append(torch.where(local, idx - lo, -1).to(torch.int64))
            if topk_weights is not None:
                cols.append(torch.where(local, topk_weights[token_ids], 0.0))
        cols.append(token_ids.to(torch.int32))
        rows, specs = pack_rows(cols)
        recv = unpack_rows(self.comm.all_to_all_rows(rows, num_tokens_per_rank.tolist(), recv_counts,
                                                     "dispatch: payload"), specs)
        recv_x = recv.pop(0)
        recv_scales = recv.pop(0) if x_scales is not None else None
        recv_topk_idx = recv.pop(0) if topk_idx is not None else None
        recv_topk_weights = recv.pop(0) if topk_idx is not None and topk_weights is not None else None
        recv_src_idx = recv.pop(0)
        if recv_topk_idx is not None and recv_topk_weights is None:
            recv_topk_weights = torch.zeros(recv_topk_idx.shape, dtype=torch.float32, device=x.device)

        num_recv = recv_x.size(0)
        per_expert_list = [_align_up(int(c), expert_alignment) for c in per_expert]
        if num_worst_tokens:
            if num_recv > num_worst_tokens:
                raise RuntimeError(f"dispatch: rank {me} received {num_recv} tokens, more than "
                                   f"num_worst_tokens={num_worst_tokens}")
            recv_x = _pad_rows(recv_x, num_worst_tokens, 0)
            recv_scales = _pad_rows(recv_scales, num_worst_tokens, 0)
            recv_topk_idx = _pad_rows(recv_topk_idx, num_worst_tokens, -1)
            recv_topk_weights = _pad_rows(recv_topk_weights, num_worst_tokens, 0)
            recv_src_idx = _pad_rows(recv_src_idx, num_worst_tokens, -1)
            per_expert_list = []

        if self.topology.internode:
            same_index = self._same_index_routing(is_token_in_rank, int(gathered[:, -1].max()))
            per_node, nvl_head = forwarded_rows(counts, same_index, self.topology, me)
            handle = InternodeHandle.with_one_channel(
                counts, num_tokens_per_rdma_rank, is_token_in_rank, per_node, nvl_head, self.topology, me,
                recv_src_idx, num_tokens=x.size(0), owner=self.owner)
        else:
            handle = IntranodeHandle.with_one_channel(
                prefix_matrix_from_counts(counts).to(x.device), num_tokens_per_rank, me, recv_src_idx,
                is_token_in_rank, send_positions(is_token_in_rank), num_recv_tokens=num_worst_tokens or num_recv,
                num_tokens=x.size(0), owner=self.owner)
        return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle

    def dispatch_expert_major(self, x, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                              num_tokens_per_expert, config: Config, num_worst_tokens: int = 0,
                              expert_capacity: int = 0, num_tokens_per_rdma_rank=None):
        """The composed default (base.Backend), after a capacity check every rank makes alike: with
        `expert_capacity`, one all-gather of (capacity, per-expert counts) before the data moves, and a source
        that sends one expert more tokens than its rank's capacity raises the same ValueError on every rank,
        naming source, count, expert and rank as the native notify's report does (docs/api.md)."""
        if expert_capacity:
            counts = torch.cat([num_tokens_per_expert.new_tensor([expert_capacity]), num_tokens_per_expert])
            gathered = self.comm.all_gather(counts.to(torch.int64), "dispatch_expert_major: capacity check")
            check_expert_capacity(gathered[:, 1:], gathered[:, 0])  # [source, expert], [R]
        return super().dispatch_expert_major(x, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                                             num_tokens_per_expert, config, num_worst_tokens, expert_capacity,
                                             num_tokens_per_rdma_rank)

    def _same_index_routing(self, is_token_in_rank: torch.Tensor, max_tokens: int) -> torch.Tensor:
        """[num_nodes, max_tokens, R] bool: is_token_in_rank of the rank with this rank's local index on each
        node (rows past its token count False), for InternodeHandle.send_nvl_head. A host all-gather of
        every rank's routing: the oracle favours plain over lean."""
        topo = self.topology
        padded = torch.zeros((max_tokens, self.num_ranks), dtype=torch.uint8, device=is_token_in_rank.device)
        padded[: is_token_in_rank.size(0)] = is_token_in_rank
        routing = self.comm.all_gather(padded, "dispatch: routing of same-index ranks")
        peers = [topo.rank_of(n, topo.local_of(self.rank)) for n in range(topo.num_nodes)]
        return routing[peers].bool()

    @staticmethod
    def _send_order(is_token_in_rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token index, destination rank) of every sent row, grouped by destination, then token index."""
        dest, token_ids = torch.nonzero(is_token_in_rank.t(), as_tuple=True)
        return token_ids, dest

    def cached_dispatch(self, x, x_scales, handle, config):
        self._notify([0, x.size(1), _DTYPE_CODES[x.dtype], 0, int(x_scales is not None)], None, "cached dispatch")
        token_ids, _ = self._send_order(handle.is_token_in_rank)
        rows, specs = pack_rows([x[token_ids], None if x_scales is None else x_scales[token_ids]])
        send_counts = handle.is_token_in_rank.sum(dim=0).tolist()
        recv = unpack_rows(self.comm.all_to_all_rows(rows, send_counts, rows_per_source(handle, self.rank).tolist(),
                                                     "cached dispatch: payload"), specs)
        rows_out = handle.num_recv_tokens  # padded like the dispatch that made the handle
        return _pad_rows(recv[0], rows_out, 0), _pad_rows(recv[1] if x_scales is not None else None, rows_out, 0)

    def combine(self, x, handle, topk_weights, bias_0, bias_1, config):
        self._notify([0, x.size(1), _DTYPE_CODES[x.dtype], 0 if topk_weights is None else topk_weights.size(1), 0,
                      int(topk_weights is not None)], None, "combine")
        recv_counts = rows_per_source(handle, self.rank).tolist()
        n = sum(recv_counts)  # valid rows; the rest is num_worst_tokens padding
        rows, specs = pack_rows([x[:n], None if topk_weights is None else topk_weights[:n]])
        back_counts = handle.is_token_in_rank.sum(dim=0).tolist()
        back = unpack_rows(self.comm.all_to_all_rows(rows, recv_counts, back_counts, "combine: payload"), specs)
        send_head = send_head_of(handle)
        acc = torch.zeros((handle.num_tokens, x.size(1)), dtype=torch.float32, device=x.device)
        acc_w = None if topk_weights is None else torch.zeros(
            (handle.num_tokens, topk_weights.size(1)), dtype=torch.float32, device=x.device)
        start = 0
        for r, count in enumerate(back_counts):  # reduce in rank order: deterministic
            pos = send_head[:, r]
            sel = torch.nonzero(pos >= 0, as_tuple=True)[0]
            acc[sel] += back[0][start:start + count][pos[sel].long()].float()
            if acc_w is not None:
                acc_w[sel] += back[1][start:start + count][pos[sel].long()]
            start += count
        for b in (bias_0, bias_1):
            if b is not None:
                acc += b.float()
        return acc.to(x.dtype), acc_w

    # ---- low latency -----------------------------------------------------------------------------------
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                             round_scale, use_ue8m0, cumulative_local_expert_recv_stats, return_recv_hook):
        R, T, H = self.num_ranks, num_max_dispatch_tokens_per_rank, x.size(1)
        num_local = num_experts // R
        # One row per (token, expert) pair, grouped by destination rank, then expert, then token.
        token_ids, slot = torch.nonzero(topk_idx >= 0, as_tuple=True)
        experts = topk_idx[token_ids, slot]
        order = torch.argsort(experts * (T + 1) + token_ids, stable=True)
        token_ids, experts = token_ids[order], experts[order]
        dest = experts // num_local
        send_counts = torch.bincount(dest, minlength=R).tolist()
        header = [num_experts, H, _DTYPE_CODES[x.dtype], T, int(use_fp8)]
        recv_counts = self._notify(header, torch.tensor(send_counts, device=x.device),
                                   "low_latency_dispatch")[:, self.rank].tolist()
        if use_fp8:
            q, scales = per_token_cast_to_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
            cols = [q[token_ids], scales[token_ids]]
        else:
            cols = [x[token_ids], None]
        cols += [(experts % num_local).to(torch.int32), token_ids.to(torch.int32)]
        rows, specs = pack_rows(cols)
        _, finish = self.comm.all_to_all_rows(rows, send_counts, recv_counts, "low_latency_dispatch: payload",
                                              async_op=True)

        recv_x = torch.zeros((num_local, R * T, H), dtype=cols[0].dtype, device=x.device)
        recv_scales = None
        if use_fp8:
            n_scales = scales.size(1)  # column-major in the last two dims, as DeepEP returns them
            recv_scales = torch.zeros((num_local, n_scales, R * T), dtype=scales.dtype,
                                      device=x.device).transpose(1, 2)
        recv_count = torch.zeros(num_local, dtype=torch.int32, device=x.device)
        src_info = torch.zeros((num_local, R * T), dtype=torch.int32, device=x.device)
        layout_range = torch.zeros((num_local, R), dtype=torch.int64, device=x.device)

        def receive() -> None:
            got = unpack_rows(finish(), specs)
            data, sc = got[0], (got[1] if use_fp8 else None)
            local_expert, src_tok = got[-2].long(), got[-1]
            src_rank = torch.repeat_interleave(torch.arange(R, device=x.device),
                                               torch.tensor(recv_counts, device=x.device))
            # rows arrive grouped by source rank, then expert, then token: regroup by expert (stable)
            order = torch.argsort(local_expert * R + src_rank, stable=True)
            local_expert, src_rank, src_tok, data = local_expert[order], src_rank[order], src_tok[order], data[order]
            per_pair = torch.bincount(local_expert * R + src_rank, minlength=num_local * R).view(num_local, R)
            counts = per_pair.sum(dim=1)
            begins = torch.cumsum(per_pair, dim=1) - per_pair
            expert_start = torch.cumsum(counts, dim=0) - counts
            slot_in_expert = torch.arange(local_expert.numel(), device=x.device) - expert_start[local_expert]
            recv_x[local_expert, slot_in_expert] = data
            if sc is not None:
                recv_scales[local_expert, slot_in_expert] = sc[order]
            src_info[local_expert, slot_in_expert] = src_tok
            recv_count.copy_(counts.to(torch.int32))
            layout_range.copy_((begins << 32) | per_pair)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(counts.to(cumulative_local_expert_recv_stats.dtype))

        handle = LowLatencyHandle(src_info, layout_range, T, H, num_experts, owner=self.owner)
        return recv_x, recv_scales, recv_count, handle, _hook_or_run(receive, return_recv_hook)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, out, return_recv_hook):
        R, me = self.num_ranks, self.rank
        num_local = handle.num_experts // R
        counts = (handle.layout_range & 0xFFFFFFFF)  # [num_local, R]
        begins = handle.layout_range >> 32
        # Rows go back grouped by source rank, then local expert, then slot.
        per_expert = counts.sum(dim=1)
        expert_of = torch.repeat_interleave(torch.arange(num_local, device=x.device), per_expert)
        slot_of = torch.arange(expert_of.numel(), device=x.device) - (torch.cumsum(per_expert, 0) - per_expert)[expert_of]
        rank_of = (slot_of.unsqueeze(1) >= (begins + counts)[expert_of]).sum(dim=1)
        order = torch.argsort((rank_of * num_local + expert_of) * x.size(1) + slot_of)
        local_expert, slot_of = expert_of[order], slot_of[order]
        flat = local_expert * x.size(1) + slot_of
        send_counts = torch.bincount(rank_of, minlength=R).tolist()
        rows_x = x.reshape(-1, x.size(2))[flat]
        tokens = handle.src_info.reshape(-1)[flat]
        global_expert = (local_expert + me * num_local).to(torch.int32)
        rows, specs = pack_rows([rows_x, global_expert, tokens])
        recv_counts = self._notify([handle.num_experts, x.size(2), _DTYPE_CODES[x.dtype], 0, 0],
                                   torch.tensor(send_counts, device=x.device),
                                   "low_latency_combine")[:, me].tolist()
        _, finish = self.comm.all_to_all_rows(rows, send_counts, recv_counts, "low_latency_combine: payload",
                                              async_op=True)

        def receive() -> None:
            data, expert, token = unpack_rows(finish(), specs)
            token, expert = token.long(), expert.long()
            weight = (_slot_of_row(token, expert, topk_idx, handle.num_experts) * topk_weights[token]).sum(dim=1)
            acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
            acc.index_add_(0, token, data.float() * weight.unsqueeze(1))
            out.copy_(acc)

        return _hook_or_run(receive, return_recv_hook)

    def low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        key = (handle.num_experts // self.num_ranks, self.num_ranks * handle.num_max_dispatch_tokens_per_rank,
               handle.hidden)
        if key not in self._ll_combine_buffers:
            self._ll_combine_buffers[key] = torch.zeros(key, dtype=torch.bfloat16, device=self.device)
        return self._ll_combine_buffers[key]

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        for buf in self._ll_combine_buffers.values():
            buf.zero_()
        self.comm.barrier("clean_low_latency_buffer")

    def release(self):
        self._ll_combine_buffers.clear()


def _slot_of_row(token: torch.Tensor, expert: torch.Tensor, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[rows, K] float one-hot: the top-k slot each combine row answers. A token that names one expert in
    several slots sent one row per slot (in slot order, which the rows of one (token, expert) keep on the way
    back); the i-th row of a (token, expert) pair takes the weight of its i-th slot naming that expert, so each
    slot's weight counts once, as in the native kernels (one row per (token, slot) pair)."""
    key = token * num_experts + expert
    order = torch.argsort(key, stable=True)
    ranked = key[order]
    occurrence = torch.empty_like(key)
    occurrence[order] = torch.arange(key.numel(), device=key.device) - torch.searchsorted(ranked, ranked)
    match = topk_idx[token] == expert.unsqueeze(1)
    return (match & (match.cumsum(dim=1) - 1 == occurrence.unsqueeze(1))).float()


def _hook_or_run(receive: Callable[[], None], return_recv_hook: bool) -> Optional[Callable[[], None]]:
    """A low-latency call's receive: handed back as the recv hook, or run now (the call completes)."""
    if return_recv_hook:
        return receive
    receive()
    return None


def _pad_rows(t: Optional[torch.Tensor], rows: int, value) -> Optional[torch.Tensor]:
    if t is None or t.size(0) == rows:
        return t
    out = t.new_full((rows,) + tuple(t.shape[1:]), value)
    out[: t.size(0)] = t
    return out

