"""Primus-Turbo's MoE dispatch/combine on uccl_ep_train: an EP backend for its `register_ep_backend`.

Primus's `use_turbo_deepep: true` (with `enable_primus_turbo: true`) swaps in Primus-Turbo's DeepEP token
dispatcher, whose `moe_dispatch` / `moe_combine` run on the EP backend named by
PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND, among the classes given to
`primus_turbo.pytorch.kernels.moe.moe_dispatch_combine_impl.register_ep_backend(name, cls)`. `register()`
adds ours as UCCL_EP, so those users keep their Primus settings and set the variable to UCCL_EP.

The class meets Primus-Turbo's EPBackend protocol (structural, nothing to inherit): `is_available()`, a
constructor without arguments (one instance per process), `init_buffer(group, hidden_bytes, config)`
before every dispatch and combine, `dispatch(...)` -> (recv_x, recv_topk_idx, recv_topk_weights,
tokens_per_expert, handle), `combine(...)` -> (combined_x, combined_topk_weights).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist

from uccl_ep_train.buffer import Buffer
from uccl_ep_train.config import Config
from uccl_ep_train.events import EventOverlap

BACKEND_NAME = "UCCL_EP"
BACKEND_ENV = "PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND"
DEEP_EP_BACKEND = "DEEP_EP"  # Primus-Turbo's backend on `import deep_ep`; primus-cli's USING_UEP=1 selects it

XType = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


class UcclEPBackend:
    """Primus-Turbo's dispatch/combine on a uccl_ep_train Buffer (one per process, made on first use)."""

    def __init__(self) -> None:
        # `_buffer` is the name Primus-Turbo reads to tell whether a backend already holds a buffer
        # (it then refuses to drop the backend, and warns when the buffer settings change).
        self._buffer: Optional[Buffer] = None
        self._sized_for: tuple = ()
        self._dispatch_config: Optional[Config] = None
        self._combine_config: Optional[Config] = None

    @staticmethod
    def is_available() -> bool:
        """Always: this module already imported the Buffer, which runs without the native module too."""
        return True

    def init_buffer(self, group: dist.ProcessGroup, hidden_bytes: int, config: Any) -> None:
        """Have a Buffer on `group` large enough for rows of `hidden_bytes` bytes.

        `config` is Primus-Turbo's EPBufferConfig: `num_sms`, and `dispatch_config` / `combine_config`
        (None: ours for the group size). Primus-Turbo calls this before every dispatch and combine, so an
        unchanged request returns at once; a larger one makes a new Buffer (collective: every rank of the
        group gets the same request, since dispatch and combine are collective)."""
        request = (group, config, hidden_bytes)
        if request == self._sized_for:
            return
        Buffer.set_num_sms(config.num_sms)
        ranks = group.size()
        self._dispatch_config = config.dispatch_config or Buffer.get_dispatch_config(ranks)
        self._combine_config = config.combine_config or Buffer.get_combine_config(ranks)
        configs = (self._dispatch_config, self._combine_config)
        nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, ranks) for c in configs)
        rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, ranks) for c in configs)
        held = self._buffer
        if held is None or held.group is not group or held.num_nvl_bytes < nvl or held.num_rdma_bytes < rdma:
            self._buffer = Buffer(group, nvl, rdma)
        self._sized_for = request

    def dispatch(self, x: XType, handle: Optional[tuple] = None, topk_idx: Optional[torch.Tensor] = None,
                 token_weights: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, num_worst_tokens: int = 0):
        """Send each token to the ranks of its experts; with `handle`, along an earlier dispatch's layout
        (Primus-Turbo's combine backward does that, without routing arguments).

        Arguments as Buffer.dispatch's, plus `token_weights` (its topk_weights) and `num_experts` (for
        the layout). Returns recv_x, recv_topk_idx, recv_topk_weights, received tokens per local expert
        (a list) and the handle for combine; a dispatch with `handle` returns recv_x and four None."""
        buffer = self._ready("dispatch")
        start = Buffer.capture() if async_finish else None
        if handle is not None:
            recv_x, *_, done = buffer.dispatch(x, handle=handle, config=self._dispatch_config, previous_event=start,
                                               async_finish=async_finish,
                                               allocate_on_comm_stream=allocate_on_comm_stream)
            _join(done, async_finish)
            return recv_x, None, None, None, None
        per_rank, per_node, per_expert, in_rank, laid_out = buffer.get_dispatch_layout(
            topk_idx, num_experts, previous_event=start, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        # A synchronous call waits for nothing: passing the layout's event would move the Buffer onto its
        # comm stream for good (Buffer._run), which only overlapping callers need.
        recv_x, recv_idx, recv_w, per_local_expert, handle, done = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=token_weights,
            num_worst_tokens=num_worst_tokens, config=self._dispatch_config,
            previous_event=laid_out if async_finish else None, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        _join(done, async_finish)
        return recv_x, recv_idx, recv_w, per_local_expert, handle

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: Optional[torch.Tensor] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Sum each token's rows back on the rank it came from (and its `topk_weights`: Primus-Turbo's
        dispatch backward passes the gradient of the dispatched weights here, which our combine takes as
        float32). Returns combined_x and the combined weights (None without `topk_weights`)."""
        buffer = self._ready("combine")
        start = Buffer.capture() if async_finish else None
        combined, combined_w, done = buffer.combine(
            x, handle, topk_weights=None if topk_weights is None else topk_weights.float(),
            config=self._combine_config, previous_event=start, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        _join(done, async_finish)
        return combined, combined_w

    def _ready(self, op: str) -> Buffer:
        if self._buffer is None:
            raise RuntimeError(f"UcclEPBackend.{op}: init_buffer() comes first (Primus-Turbo calls it before "
                               "every dispatch and combine)")
        return self._buffer


def _join(done: EventOverlap, async_finish: bool) -> None:
    """With async_finish the kernels ran on the comm stream: the caller's stream waits for them here, as with
    Primus-Turbo's own backends, since its callers use the outputs right away (without async_finish the
    Buffer already made it wait)."""
    if async_finish:
        done.current_stream_wait()


def deep_ep_route_advice(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """When the environment selects Primus-Turbo's DEEP_EP backend (primus-cli's USING_UEP=1 exports it) but
    `import deep_ep` does not give ours: which deep_ep runs instead and how to get ours. None otherwise."""
    from . import deep_ep_origin, serves_deep_ep
    environ = os.environ if environ is None else environ
    if environ.get(BACKEND_ENV) != DEEP_EP_BACKEND:
        return None
    origin = deep_ep_origin()
    if serves_deep_ep(origin):
        return None
    why = "USING_UEP=1 (primus-cli's hook exports it)" if environ.get("USING_UEP") == "1" else "the environment"
    found = f"runs on the deep_ep at {origin}, not on uccl-ep-train" if origin else \
        "finds no importable deep_ep (Primus-Turbo's DEEP_EP backend will fail)"
    return (f"{BACKEND_ENV}={DEEP_EP_BACKEND}, set by {why}: Primus-Turbo's DeepEP dispatch/combine {found}. "
            "To run them on uccl-ep-train: `uccl-ep-train install-deep-ep` with the python that primus-cli runs "
            "(installs ours as the `deep_ep` distribution, in place of the one installed; the USING_UEP=1 hook "
            "also needs UCCL's own `uccl` package, and REBUILD_UEP=1 would reinstall UCCL's deep_ep over ours), "
            f"or select ours by name: `primus-cli direct --env {BACKEND_ENV}={BACKEND_NAME} ...` "
            "(docs/recipes.md)")


def warn_deep_ep_route(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """deep_ep_route_advice, printed on stderr by the first rank (RANK unset or 0); returns it."""
    environ = os.environ if environ is None else environ
    advice = deep_ep_route_advice(environ)
    if advice and environ.get("RANK", "0") == "0":
        print(f"uccl-ep-train: warning: {advice}", file=sys.stderr, flush=True)
    return advice


def register() -> bool:
    """Offer UcclEPBackend to Primus-Turbo as UCCL_EP. Returns False, doing nothing, when Primus-Turbo is
    not importable."""
    try:
        from primus_turbo.pytorch.kernels.moe.moe_dispatch_combine_impl import register_ep_backend
    except ImportError:
        return False
    register_ep_backend(BACKEND_NAME, UcclEPBackend)
    return True
