"""The contract between `Buffer` and a backend.

`Buffer` validates every argument (before any communication), picks the stream, waits on
`previous_event` and records the completion event; a backend only moves data, enqueuing its work on the
current stream (CUDA) or running it (CPU). Every backend must give the same results as `reference`:
bit-exact for dispatch (same rows, same order), within reduction tolerance for combine.

The expert-major methods (`dispatch_expert_major`, `cached_dispatch_expert_major`, `combine_expert_major`)
have default bodies composed of the abstract primitives and `uccl_ep_train.permute`'s non-autograd
expand/reduce, so every backend has them; a backend overrides them to fuse the expansion into the
dispatch's copy-out and the fold-back into the combine.
"""
from __future__ import annotations

import abc
from typing import Callable, Optional

import torch

from .. import permute
from ..config import Config
from ..errors import RankLocalError
from ..events import host_values
from ..handles import HTHandle, LowLatencyHandle, nodes_of_tokens, rows_per_source
from ..topology import Topology

# How an expert-major call ran (Buffer.expert_major_paths): its expansion / fold inside the communication
# kernels, on blocks beside them, or around a receive-order call by the separate permute kernels (the fallback).
FUSED, SIDE_BLOCKS, PERMUTE = "fused", "side_blocks", "permute"


class Backend(abc.ABC):
    name: str = "abstract"
    supports_low_latency: bool = True  # False: Buffer serves low-latency calls with the reference backend
    # Why its calls cannot be captured in a CUDA graph ("": they can, as long as their sizes need no host sync:
    # Buffer checks that part); Buffer refuses capture with this reason before any work.
    capture_refusal: str = "it has not been made capture-safe"
    # True: its kernels check the values the host would otherwise read back (expert ids in range, counts that
    # match the mask) and report them as errors, so Buffer skips the host's value checks by default.
    checks_values_on_device: bool = False

    @property
    def checks_expert_ids_on_device(self) -> bool:
        """True: get_dispatch_layout's kernel checks topk_idx's expert ids and records the first bad one
        (position and value), raised at the next host sync or call, so Buffer skips the host's check (a GPU
        sync) there by default. Every backend that checks all values on the device checks these."""
        return self.checks_values_on_device

    def __init__(self, group, rank: int, num_ranks: int, owner: int, num_nvl_bytes: int, num_rdma_bytes: int, *,
                 topology: Optional[Topology] = None):
        """topology: which ranks form a node (Buffer detects it once); None means all ranks on one node."""
        self.group, self.rank, self.num_ranks, self.owner = group, rank, num_ranks, owner
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.topology = topology if topology is not None else Topology(num_ranks, num_ranks)
        self.expert_major_paths: dict[str, str] = {}  # Buffer.expert_major_paths: call -> FUSED / ... / PERMUTE

    # ---- high throughput -------------------------------------------------------------------------------
    @abc.abstractmethod
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """-> (num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank (`tokens_per_node`; None on one node),
        num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool): Buffer.get_dispatch_layout's order."""

    def tokens_per_node(self, is_token_in_rank: torch.Tensor) -> Optional[torch.Tensor]:
        """num_tokens_per_rdma_rank: [num_nodes] int32, tokens with at least one destination rank on node n
        (each token counted once per node); None on one node, as DeepEP returns it. The layout's internode
        part, the same for every backend (one may override it with a kernel giving the same values)."""
        if not self.topology.internode:
            return None
        return nodes_of_tokens(is_token_in_rank, self.topology.num_nodes).sum(dim=0, dtype=torch.int32)

    @abc.abstractmethod
    def dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], num_tokens_per_rank: torch.Tensor,
                 is_token_in_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor, expert_alignment: int,
                 num_worst_tokens: int, config: Config, num_tokens_per_rdma_rank: Optional[torch.Tensor],
                 num_max_tokens_per_rank: int = 0
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor],
                            list[int], HTHandle]:
        """Fresh dispatch -> (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle). Receive order: source rank, then source token index (on
        one node and across nodes alike). `num_tokens_per_rdma_rank` ([num_nodes] int32, `tokens_per_node`)
        is given exactly when `self.topology.internode`; the handle is then an InternodeHandle, else an
        IntranodeHandle. `num_max_tokens_per_rank` (0: none): with num_worst_tokens, a bound on every rank's
        token count that every rank passes alike (Buffer.dispatch checks this rank's); a backend that sizes
        buffers without a host sync may size by it."""

    @abc.abstractmethod
    def cached_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: HTHandle,
                        config: Config) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Dispatch with the layout of `handle` (no counts exchange) -> (recv_x, recv_x_scales)."""

    @abc.abstractmethod
    def combine(self, x: torch.Tensor, handle: HTHandle, topk_weights: Optional[torch.Tensor],
                bias_0: Optional[torch.Tensor], bias_1: Optional[torch.Tensor], config: Config
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Sum, per original token, the rows it was sent as (+ biases) -> (combined_x, combined_topk_weights)."""

    # ---- high throughput, expert-major (defaults: composed; backends may fuse) ----------------------------
    def _took(self, call: str, path: str) -> None:
        """Records how expert-major call `call` (the Buffer method's name) runs: FUSED, SIDE_BLOCKS or PERMUTE."""
        self.expert_major_paths[call] = path

    def dispatch_expert_major(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
                              num_tokens_per_rank: torch.Tensor, is_token_in_rank: torch.Tensor,
                              num_tokens_per_expert: torch.Tensor, config: Config, num_worst_tokens: int = 0,
                              expert_capacity: int = 0, num_tokens_per_rdma_rank: Optional[torch.Tensor] = None
                              ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], list[int], torch.Tensor,
                                         HTHandle]:
        """Fresh dispatch straight into expert-major order -> (x_em [M, H], recv_topk_idx [n, K] int64 local
        ids (-1 elsewhere), recv_topk_weights [n, K] float32 (zeros without weights), tokens_per_expert
        list[int] (M = sum), em_map [n, K] int32, handle).

        n = handle.num_recv_tokens (rows received, receive order: source rank, then token; num_worst_tokens
        when given, the rows after the received ones padded as `dispatch` pads them, em_map -1 there).
        em_map[i, j] is the expert-major row of received row i's slot j, -1 for slots of no local expert;
        x_em[em_map[i, j]] = received row i. Without expert_capacity the counts are exact and em_map is
        `permute.expert_major_map(recv_topk_idx, tokens_per_expert)`; with it, every (local expert, source
        rank) block has expert_capacity rows (`permute.expert_major_map_capacity`), tokens_per_expert is
        num_ranks * expert_capacity each, and the rows no token fills are zeros.
        num_tokens_per_rdma_rank: the layout's (`get_dispatch_layout`), else `tokens_per_node` computes it.
        Default: `dispatch` (expert_alignment=1), the map, a non-autograd expand."""
        if num_tokens_per_rdma_rank is None:
            num_tokens_per_rdma_rank = self.tokens_per_node(is_token_in_rank)
        recv_x, _, recv_idx, recv_w, counts, handle = self.dispatch(
            x, None, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, 1,
            num_worst_tokens, config, num_tokens_per_rdma_rank)
        return self._permuted(recv_x, recv_idx, recv_w, counts, handle, num_tokens_per_expert.numel(),
                              expert_capacity, capacity_checked=False)

    def _permuted(self, recv_x, recv_idx, recv_w, counts, handle, num_experts: int, expert_capacity: int,
                  capacity_checked: bool):
        """dispatch_expert_major's outputs from a receive-order dispatch's: the map, then a non-autograd expand.
        capacity_checked: the dispatch already refused a capacity overflow on every rank (else this rank checks
        its blocks here, reading two counts back: a RankLocalError)."""
        self._took("dispatch_expert_major", PERMUTE)
        if not expert_capacity:
            em_map = permute.expert_major_map(recv_idx, counts)
            return permute.expand_rows_raw(recv_x, em_map, sum(counts)), recv_idx, recv_w, counts, em_map, handle
        epr = num_experts // self.num_ranks
        em_map = permute.expert_major_map_capacity(recv_idx, rows_per_source(handle, self.rank), epr, expert_capacity)
        if not capacity_checked:
            local = (recv_idx >= 0) & (recv_idx < epr)
            named, slots = host_values(torch.stack([(em_map >= 0).sum(), local.sum()]))  # overflow: unnamed slots
            if named != slots:
                raise RankLocalError(f"expert_capacity: rank {self.rank} receives more than {expert_capacity} tokens "
                                     f"for one of its local experts from one source rank ({slots - named} over)")
        counts = [self.num_ranks * expert_capacity] * epr
        x_em = permute.expand_rows_raw(recv_x, em_map, sum(counts), padded=True)
        return x_em, recv_idx, recv_w, counts, em_map, handle

    def cached_dispatch_expert_major(self, x: torch.Tensor, handle: HTHandle, em_map: torch.Tensor,
                                     num_rows: int, config: Config, padded: bool = False) -> torch.Tensor:
        """Dispatch with the layout of `handle` (no counts exchange), each received row i landing at the
        expert-major rows em_map[i, :] names -> x_em [num_rows, H]. em_map names every row once, or (padded:
        a capacity layout) at most once, the rows named by none being zeros.
        Default: `cached_dispatch` then a non-autograd expand."""
        self._took("dispatch_expert_major_cached", PERMUTE)
        recv_x, _ = self.cached_dispatch(x, None, handle, config)
        return permute.expand_rows_raw(recv_x, em_map, num_rows, padded)

    def combine_expert_major(self, y_em: torch.Tensor, handle: HTHandle, em_map: torch.Tensor,
                             topk_weights: Optional[torch.Tensor], config: Config
                             ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Fold expert-major rows back per received row (row i = sum of y_em[em_map[i, :]], float32 in slot
        order) and combine -> (combined_x [N, H], combined_topk_weights [N, K] or None). `topk_weights`
        ([n, K] float32) are in receive order, not expert-major, and are combined as `combine` does.
        Default: a non-autograd reduce to n rows, then `combine` (no biases)."""
        self._took("combine_expert_major", PERMUTE)
        y = permute.reduce_rows_raw(y_em, em_map, em_map.size(0))
        return self.combine(y, handle, topk_weights, None, None, config)

    # ---- low latency -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor], return_recv_hook: bool
                             ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, LowLatencyHandle,
                                        Optional[Callable[[], None]]]:
        """-> (packed_recv_x, packed_recv_x_scales, packed_recv_count, handle, receive). With return_recv_hook
        the sends are issued and `receive()` (the recv hook) completes the arrival into the returned tensors;
        without, the call does both (as one launch where it can) and `receive` is None."""

    @abc.abstractmethod
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, out: torch.Tensor,
                            return_recv_hook: bool) -> Optional[Callable[[], None]]:
        """Weighted reduce of expert outputs back to their tokens into `out`; returns `receive()` with
        return_recv_hook (as low_latency_dispatch), else None."""

    def low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The buffer a zero-copy combine reads: `[num_local_experts, num_ranks * max_tokens, hidden]` bf16."""
        raise NotImplementedError(f"{self.name} backend: zero_copy low-latency combine")

    def local_buffer(self, use_rdma_buffer: bool) -> torch.Tensor:
        """This rank's communication buffer as a uint8 tensor (a view, for get_local_buffer_tensor)."""
        raise NotImplementedError(f"get_local_buffer_tensor: the {self.name} backend has no "
                                  f"{'RDMA' if use_rdma_buffer else 'NVLink'} communication buffer to expose")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: every rank must call it; returns once all ranks have cleaned."""

    def check_errors(self) -> None:
        """Raise RuntimeError if one of this backend's kernels recorded an error (cheap: no GPU sync). The
        reference backend's failures raise on the call itself."""

    def abort(self, op: str) -> bool:
        """This rank raised inside call `op` after its peers may have started it: tell them, so that their waits
        end now instead of at UCCL_EP_TIMEOUT_S. False: this backend cannot (the reference backend's
        collectives fail through the process group's own timeout)."""
        return False

    def recorded_error(self) -> Optional[str]:
        """The error this backend's kernels or proxies recorded (they told the peers), once raised; else None."""
        return None

    def aborted_by(self) -> Optional[tuple[int, str]]:
        """(rank, op) when this backend's kernels stopped on a peer's abort (`abort`), else None."""
        return None

    def occupied_sms(self, config: Config, expert_major: bool) -> Optional[dict]:
        """SMs one high-throughput call with `config` occupies while it runs: {"communication": its
        communication SMs, "side": the most blocks beside them the call adds (expert-major calls: the
        dispatch's expansion, the combine's fold; each holds an SM while it runs), "total": both}. None:
        the backend runs no kernels of its own (torch collectives)."""
        return None

    def release(self) -> None:
        """Release this rank's resources without talking to its peers (the caller knows that none of them
        uses them any more); idempotent."""

    def destroy(self) -> None:
        """Collective: release every resource once no rank uses them (idempotent); the Buffer can be rebuilt
        afterwards in the same process."""
        self.release()


class WithoutLowLatency:
    """For backends without low-latency kernels (mixed in before Backend): Buffer serves their LL calls with
    the reference backend (`supports_low_latency`), so these are never reached through it."""

    supports_low_latency = False

    def low_latency_dispatch(self, *args, **kwargs):
        raise NotImplementedError(f"{self.name} backend: low-latency mode")

    def low_latency_combine(self, *args, **kwargs):
        raise NotImplementedError(f"{self.name} backend: low-latency mode")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        raise NotImplementedError(f"{self.name} backend: low-latency mode")
