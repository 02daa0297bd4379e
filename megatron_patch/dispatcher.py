"""UCCLTokenDispatcher: megatron-core's token-dispatcher contract on uccl_ep_train's Buffer.

Each token crosses the EP group once per destination rank (not once per expert, as the alltoall
dispatcher sends it), through the autograd expert-major pair (uccl_ep_train.autograd.dispatch_expert_major
/ combine_expert_major). The dispatch delivers its rows already expanded into expert-major order — for
each local expert, rows by source rank, then source token index, exactly the order the alltoall
dispatcher hands its experts — so SequentialMLP, GroupedMLP and TE experts work unchanged and see
bit-identical inputs. The combine takes the expert outputs in that same order: it folds them back to one
row per received token (a local sum over this rank's experts) and sums across ranks.
The expansion and the fold-back live inside the communication calls rather than in separate permute
passes around them, so a backend can fuse them into its kernels (the native backend copies received rows
straight to their expert rows and folds while it combines); the reference backend composes dispatch +
permute.expand_rows and permute.reduce_rows + combine, with the same values.
Routing probabilities travel as the dispatch's top-k weights and are applied by the experts, as with
alltoall; their gradient flows back through the combine of the weight gradients.

Three paths, chosen from Megatron's settings and logged once:
- dropless, or token dropping without padding: the dispatch exchanges the per-expert counts and the host
  reads them (one sync per dispatch), because the experts need `tokens_per_expert` on the host anyway;
- drop-and-pad (`moe_pad_expert_input_to_capacity` with `moe_expert_capacity_factor`): every expert gets
  exactly `capacity` rows from each EP rank, as Megatron's alltoall dispatcher pads them, so every size is
  known on the host before the dispatch: no host sync at all, and the layer can be captured in a CUDA graph
  (one node and across nodes).
  The router's padding selections (probability 0) are not sent; their rows are zeros instead of the padding
  tokens' activations, which changes nothing the experts return (the probability multiplies them by 0).
- receive budget (`moe_expert_rank_capacity_factor`, Megatron-LM main; megatron_patch.budget): the same
  sync-free capacity layout, sized from the budget; selections past it are dropped and reported on the
  device (`check_over_budget`, `check_required_capacity`), so Megatron's paged-stash runner can replay the
  step without the budget (eager: the counts path) and grow it (`grow_ep_recv_capacity`).
"""
from __future__ import annotations

import logging
from typing import List, Optional

import torch

from megatron.core.transformer.moe.moe_utils import get_capacity
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig

from uccl_ep_train import Buffer, permute, sizing, validation
from uccl_ep_train.config import default_nvl_bytes
from uccl_ep_train import autograd as ep_autograd

from . import settings
from .budget import RecvBudget, capacity_factor_of

log = logging.getLogger("uccl_ep_train")
_BUFFER_DEFAULT_SMS = Buffer.num_sms  # DeepEP's class default (20), before anyone calls set_num_sms
_buffers: dict[int, Buffer] = {}
_retired: list[Buffer] = []  # outgrown Buffers: earlier layers' backward may still use their handles
_fits: set[tuple[int, int, int]] = set()  # (group id, hidden bytes, Buffer.num_sms) the group's Buffer holds
_logged_paths: set[str] = set()


def get_buffer(group: torch.distributed.ProcessGroup, hidden_bytes: int) -> Buffer:
    """One Buffer per EP group, replaced by a larger one when a layer needs more bytes than it holds.

    An outgrown Buffer is kept (not destroyed) until `destroy_buffers()`: autograd graphs of earlier layers
    hold handles made by it and run their backward through it."""
    key = id(group)
    fit = (key, hidden_bytes, Buffer.num_sms)
    buf = _buffers.get(key)
    if buf is not None and fit in _fits:
        return buf  # every call after a layer's first: no size arithmetic on the host's critical path
    num_ranks = group.size()
    need = default_nvl_bytes(hidden_bytes, num_ranks, Buffer.num_sms)
    if buf is None or buf.num_nvl_bytes < need:
        if buf is not None:
            _retired.append(buf)
        buf = Buffer(group, need, 0, explicitly_destroy=True)
        _buffers[key] = buf
        sms = buf.occupied_sms(expert_major=True)  # its dispatch / combine are the expert-major calls
        if buf.rank == 0 and sms is not None:
            topo = buf.topology
            path = (f"internode, {topo.num_nodes} nodes x {topo.ranks_per_node} ranks" if topo.internode else
                    "intranode")
            log.info("uccl dispatcher: %d EP ranks on the %s backend (%s); each dispatch / combine occupies %d "
                     "communication SMs and up to %d side blocks (%d SMs)", num_ranks, buf.backend_name, path,
                     sms["communication"], sms["side"], sms["total"])
    _fits.add(fit)  # (a replacement Buffer is larger: what fitted before still fits)
    return buf


def destroy_buffers() -> None:
    """Free every Buffer the dispatchers made (e.g. between tests or before process exit)."""
    for buf in list(_buffers.values()) + _retired:
        buf.destroy()
    _buffers.clear()
    _retired.clear()
    _fits.clear()


def _log_path(buffer: Buffer, capacity: int, layout: str) -> None:
    """Say once per process (rank 0) which path the dispatcher takes: sync-free (a capacity layout: `layout`
    is drop-and-pad or the receive budget) or the counts."""
    path = layout if capacity else "counts"
    if path in _logged_paths:
        return
    _logged_paths.add(path)
    if buffer.rank == 0:
        if capacity:
            capture = "not capturable" if buffer.backend.capture_refusal else "CUDA-graph capturable"
            log.info("uccl dispatcher: %s (capacity %d rows per expert and EP rank): every size is known before "
                     "the dispatch: no host sync, %s on the %s backend", layout, capacity, capture,
                     buffer.backend_name)
        else:
            log.info("uccl dispatcher: dropless / token dropping: each dispatch reads the per-expert counts on the "
                     "host (one sync); moe_pad_expert_input_to_capacity with moe_expert_capacity_factor, or a "
                     "receive budget (moe_expert_rank_capacity_factor), avoids it")


def _log_expert_major_paths(buffer: Buffer) -> None:
    """Say (rank 0) how the expert-major calls ran (Buffer.expert_major_paths), once per distinct answer: the
    backend picks per call shape whether its kernels expand / fold the rows or the separate permute kernels do."""
    paths = ", ".join(f"{call} {path}" for call, path in sorted(buffer.expert_major_paths.items()))
    if not paths or f"paths: {paths}" in _logged_paths:
        return
    _logged_paths.add(f"paths: {paths}")
    if buffer.rank == 0:
        log.info("uccl dispatcher: expert-major calls on the %s backend: %s", buffer.backend_name, paths)


def check_config(config: TransformerConfig) -> None:
    """Reject, at config time, what this dispatcher does not do (with the flag to change)."""
    if getattr(config, "expert_tensor_parallel_size", 1) not in (None, 1):
        raise ValueError(f"moe_token_dispatcher_type='uccl' does not support expert tensor parallelism "
                         f"(expert_tensor_parallel_size={config.expert_tensor_parallel_size}); set it to 1")
    if getattr(config, "moe_router_padding_for_quantization", False):
        raise ValueError("moe_token_dispatcher_type='uccl' does not support moe_router_padding_for_quantization")
    if getattr(config, "moe_latent_size", None):
        raise ValueError("moe_token_dispatcher_type='uccl' does not support moe_latent_size")
    # Megatron-LM main's fields (megatron-core 0.19 may lack them: getattr)
    sms = getattr(config, "moe_flex_dispatcher_num_sms", None)
    if sms is not None and (isinstance(sms, bool) or not isinstance(sms, int) or sms <= 0 or sms % 2):
        raise ValueError(f"moe_flex_dispatcher_num_sms must be a positive even number for "
                         f"moe_token_dispatcher_type='uccl', got {sms!r}")
    factor = capacity_factor_of(config)
    if factor is not None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"moe_expert_rank_capacity_factor must be a positive number (or None for eager "
                             f"receives), got {factor!r}")
        if config.moe_pad_expert_input_to_capacity:
            raise ValueError("moe_token_dispatcher_type='uccl': moe_expert_rank_capacity_factor (a receive budget "
                             "that drops and reports overflow) and moe_pad_expert_input_to_capacity (drop-and-pad) "
                             "are two static layouts; set one of them")
    if getattr(config, "moe_paged_stash", False) and factor is None:
        raise ValueError("moe_paged_stash requires moe_expert_rank_capacity_factor to be set (Megatron-LM's rule): "
                         "without a receive budget nothing overflows and nothing needs replaying")


def check_flex_config(config: TransformerConfig) -> None:
    """`moe_flex_dispatcher_backend='uccl'` is Megatron's DeepEP manager over our deep_ep: what that manager
    does not do is rejected here, naming our dispatcher type, which does it."""
    if capacity_factor_of(config) is not None:
        raise ValueError("moe_expert_rank_capacity_factor is not supported with moe_flex_dispatcher_backend='uccl' "
                         "(Megatron's DeepEP manager over our deep_ep receives eagerly); use "
                         "moe_token_dispatcher_type='uccl', which implements the receive budget and its hooks")


def num_sms_for(config: TransformerConfig) -> Optional[int]:
    """The SM count the dispatcher's kernels get: --uccl-ep-num-sms, else Megatron-LM main's one flex SM count
    (moe_flex_dispatcher_num_sms), else None (keep Buffer.num_sms if someone chose it, or ours)."""
    if settings.num_sms is not None:
        return settings.num_sms
    return getattr(config, "moe_flex_dispatcher_num_sms", None)


class UCCLTokenDispatcher(MoETokenDispatcher):
    """Token dispatcher on uccl_ep_train (`--moe-token-dispatcher-type uccl`)."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config: TransformerConfig,
                 pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        check_config(config)
        if self.tp_size > 1:
            raise ValueError(f"moe_token_dispatcher_type='uccl': expert tensor-parallel group has size "
                             f"{self.tp_size}; expert tensor parallelism is not supported")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.num_experts = config.num_moe_experts
        self.router_topk = config.moe_router_topk
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_moe_experts ({self.num_experts}) must be divisible by the expert-parallel "
                             f"size ({self.ep_size})")
        if local_expert_indices and local_expert_indices[0] != self.ep_rank * num_local_experts:
            raise ValueError("UCCLTokenDispatcher: local experts must be the contiguous block of this EP rank")
        sms = num_sms_for(config)
        if sms is not None:
            Buffer.set_num_sms(sms)
        elif Buffer.num_sms == _BUFFER_DEFAULT_SMS:  # nobody chose a count (Buffer.set_num_sms): ours
            Buffer.set_num_sms(settings.DEFAULT_NUM_SMS)
        self.hidden_shape = None
        self.topk_idx = None
        self.handle = None
        self.expert_map = None
        self.tokens_per_expert_list = None
        self.drop_and_pad = bool(config.moe_pad_expert_input_to_capacity)
        # rows per (local expert, EP rank) of this batch's capacity layout (drop-and-pad or a static receive
        # budget), None for exact counts
        self.capacity: Optional[int] = None
        self.worst_tokens = 0  # receive-order rows of the capacity layout (sizing.capacity_recv_tokens)
        # Megatron-LM main's paged-stash runner reads and writes the budget as `_comm_manager` (budget.py)
        self._comm_manager = RecvBudget(config, num_local_experts, self.ep_size, self.router_topk, self.ep_group)

    # ---- dispatch --------------------------------------------------------------------------------------
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Routing map + probs -> top-k ids (-1 for dropped slots) and float32 top-k weights. Local only."""
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        num_tokens = hidden_states.size(0)
        if self.drop_and_pad:
            # the router's capacity (the same formula on the same token count) and its real selections: the
            # padding ones it added to fill each expert's capacity have probability 0
            self.capacity = get_capacity(num_tokens=num_tokens * self.router_topk,
                                         num_experts=self.num_experts,
                                         capacity_factor=self.config.moe_expert_capacity_factor)
            self.worst_tokens = sizing.capacity_recv_tokens(num_tokens, self.num_local_experts, self.ep_size,
                                                            self.capacity)
            routing_map = routing_map & (probs != 0)
        else:
            budget = self._comm_manager
            budget.bootstrap(num_tokens, routing_map.device)
            routing_map = budget.limit(routing_map)  # static: drops what overflows the budget (reported)
            self.capacity = budget.capacity
            self.worst_tokens = budget.worst_recv_tokens
        # The first k selected experts of each token, in expert order (a token dropped by a capacity
        # factor has fewer than k: its remaining slots are -1, weight 0); one kernel on GPUs.
        self.topk_idx, weights = permute.topk_from_routing_map(routing_map, probs, self.router_topk)
        self.probs_dtype = probs.dtype
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        return hidden_states, weights

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """One dispatch through the autograd pair: each token once per destination rank, received rows
        landing directly in expert-major order."""
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        buffer = get_buffer(self.ep_group, hidden_states.size(1) * hidden_states.element_size())
        capacity = self.capacity or 0
        _log_path(buffer, capacity, "drop-and-pad" if self.drop_and_pad else "receive budget")
        with validation.trusted_values():  # top-k ids come from dispatch_preprocess: no value-reading syncs
            x_em, _, recv_w, counts, em_map, handle = ep_autograd.dispatch_expert_major(
                buffer, hidden_states.contiguous(), self.topk_idx, probs, self.num_experts,
                num_worst_tokens=self.worst_tokens, expert_capacity=capacity)
        self.buffer, self.handle, self.expert_map, self.tokens_per_expert_list = buffer, handle, em_map, counts
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(x_em)
        return x_em, recv_w

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """(expert-major rows, tokens_per_expert on the host, the probability of each row).

        The rows are already expert-major (the dispatch placed them); only the per-slot probabilities
        are spread to their rows (a scatter; no host sync: the counts came with the dispatch, or are the
        capacity's; padding rows get probability 0)."""
        num_rows = sum(self.tokens_per_expert_list)
        tokens_per_expert = torch.tensor(self.tokens_per_expert_list, dtype=torch.int64)
        permuted_probs = permute.expand_probs(probs, self.expert_map, num_rows,
                                              padded=self.capacity is not None).to(self.probs_dtype)
        return hidden_states, tokens_per_expert, permuted_probs

    # ---- combine ---------------------------------------------------------------------------------------
    def combine_preprocess(self, hidden_states: torch.Tensor):
        """Nothing to do: the rows stay expert-major; token_combine folds them back as it combines."""
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor):
        """One combine through the autograd pair: fold each received token's expert rows, sum across ranks."""
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        with validation.trusted_values():  # the map is the one our dispatch returned: no value-reading syncs
            out = ep_autograd.combine_expert_major(self.buffer, hidden_states.contiguous(), self.handle,
                                                   self.expert_map,
                                                   expert_capacity=self.capacity or 0)
        _log_expert_major_paths(self.buffer)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(out)
            self.shared_experts.post_forward_comm()
        self.handle = None
        self.expert_map = None
        return out

    def combine_postprocess(self, hidden_states: torch.Tensor):
        output = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output

    # ---- Megatron-LM main's budget hooks (paged_stash.py calls them on every MoE layer) ----------------
    def check_over_budget(self) -> Optional[torch.Tensor]:
        """bool [1] device tensor: whether a dispatch since the last reset dropped selections past the
        receive budget (static mode); None before the first dispatch."""
        return self._comm_manager.over_budget

    def check_required_capacity(self) -> Optional[torch.Tensor]:
        """int64 [1] device tensor: the most receive rows per rank any dispatch since the last reset needed
        (static mode; 0 in eager mode); None before the first dispatch."""
        return self._comm_manager.required_recv

    def reset_over_budget(self) -> None:
        """Clear the overflow flag and the capacity needed."""
        self._comm_manager.reset()

    def grow_ep_recv_capacity(self, new_capacity: int) -> None:
        """Grow the static receive budget to `new_capacity` rows per rank (from check_required_capacity), so
        the routing that overflowed fits when the static mode is back."""
        self._comm_manager.grow_recv_capacity(new_capacity)

    def invalidate_ep_bootstrap(self) -> None:
        """Re-derive the mode (static / eager, from `_comm_manager.moe_expert_rank_capacity_factor`) and the
        capacity on the next dispatch."""
        self._comm_manager._bootstrapped = False

