"""Primus-Turbo's EP backends (primus_turbo/pytorch/kernels/moe/moe_dispatch_combine_impl.py), reduced to
what a backend meets: classes registered by name (`register_ep_backend(name, cls)`); the name taken from
PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND, upper-cased; one instance per process, made when the class says
it is available; `init_buffer(group, hidden_bytes, EPBufferConfig)` before every dispatch and combine, then
the call with Primus-Turbo's keywords. DEEP_EP is registered from the start, as there: a backend on whatever
`import deep_ep` finds, making the deep_ep calls Primus-Turbo's makes."""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class EPBufferConfig:
    num_sms: int = 32
    dispatch_config: Any = None
    combine_config: Any = None


class DeepEPRoute:
    """The DEEP_EP backend: a `deep_ep.Buffer` sized by deep_ep's Configs, made with the extra keyword only
    UCCL's own deep_ep takes (`is_intranode`, when its Buffer has it), events from `deep_ep.utils`."""

    def __init__(self) -> None:
        self._buffer = None

    @staticmethod
    def is_available() -> bool:
        try:
            import deep_ep  # noqa: F401
        except ImportError:
            return False
        return True

    def init_buffer(self, group, hidden_bytes: int, config: EPBufferConfig) -> None:
        import deep_ep
        deep_ep.Buffer.set_num_sms(config.num_sms)
        n = group.size()
        configs = (config.dispatch_config or deep_ep.Buffer.get_dispatch_config(n),
                   config.combine_config or deep_ep.Buffer.get_combine_config(n))
        nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, n) for c in configs)
        rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, n) for c in configs)
        kwargs = {}
        if getattr(inspect.signature(deep_ep.Buffer).parameters.get("is_intranode"), "default", None) is False:
            kwargs["is_intranode"] = n <= 8
        b = self._buffer
        if b is None or b.group != group or b.num_nvl_bytes < nvl or b.num_rdma_bytes < rdma:
            self._buffer = deep_ep.Buffer(group, nvl, rdma, **kwargs)

    def _start(self, async_finish: bool):
        from deep_ep import utils
        return utils.EventOverlap(utils.EventHandle()) if async_finish else None

    def dispatch(self, x, handle=None, topk_idx=None, token_weights=None, num_experts=None, async_finish=False,
                 allocate_on_comm_stream=False, num_worst_tokens=0):
        start, b = self._start(async_finish), self._buffer
        if handle is not None:
            out = b.dispatch(x, handle=handle, previous_event=start, async_finish=async_finish,
                             allocate_on_comm_stream=allocate_on_comm_stream)
        else:
            per_rank, per_node, per_expert, in_rank, event = b.get_dispatch_layout(
                topk_idx, num_experts, previous_event=start, async_finish=async_finish,
                allocate_on_comm_stream=allocate_on_comm_stream)
            out = b.dispatch(x, topk_idx=topk_idx, topk_weights=token_weights, num_tokens_per_rank=per_rank,
                             num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                             num_tokens_per_expert=per_expert, previous_event=event, async_finish=async_finish,
                             allocate_on_comm_stream=allocate_on_comm_stream, num_worst_tokens=num_worst_tokens)
        if async_finish:
            out[-1].current_stream_wait()
        return out[:-1]

    def combine(self, x, handle, topk_weights=None, async_finish=False, allocate_on_comm_stream=False):
        combined, combined_w, event = self._buffer.combine(
            x, handle=handle, topk_weights=None if topk_weights is None else topk_weights.float(),
            async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream,
            previous_event=self._start(async_finish))
        if async_finish:
            event.current_stream_wait()
        return combined, combined_w


_REGISTRY: dict = {"DEEP_EP": DeepEPRoute}
_INSTANCES: dict = {}
_config = EPBufferConfig()


def register_ep_backend(name: str, cls: type) -> None:
    _REGISTRY[name] = cls


def set_buffer_global_config(num_use_cu: int = 32, autotune_config: Any = None) -> None:
    global _config
    dispatch_config, combine_config = autotune_config or (None, None)
    _config = EPBufferConfig(num_use_cu, dispatch_config, combine_config)


def backend():
    """The backend the environment names (made once)."""
    name = os.environ.get("PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND", "TURBO").strip().upper()
    if name not in _INSTANCES:
        if name not in _REGISTRY:
            raise ValueError(f"Unknown EP backend '{name}'. Available: {list(_REGISTRY)}")
        if not _REGISTRY[name].is_available():
            raise RuntimeError(f"EP backend '{name}' is registered but its dependencies are not installed")
        _INSTANCES[name] = _REGISTRY[name]()
    return _INSTANCES[name]


def _hidden_bytes(x) -> int:
    t = x if isinstance(x, torch.Tensor) else x[0]
    return t.size(1) * max(t.element_size(), 2)


def moe_dispatch_impl(x, group, handle=None, topk_idx=None, token_weights=None, num_experts=None,
                      async_finish=False, allocate_on_comm_stream=False, num_worst_tokens=0):
    b = backend()
    b.init_buffer(group, _hidden_bytes(x), _config)
    return b.dispatch(x, handle=handle, topk_idx=topk_idx, token_weights=token_weights, num_experts=num_experts,
                      async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream,
                      num_worst_tokens=num_worst_tokens)


def moe_combine_impl(x, group, handle, topk_weights=None, async_finish=False, allocate_on_comm_stream=False):
    b = backend()
    b.init_buffer(group, _hidden_bytes(x), _config)
    return b.combine(x, handle=handle, topk_weights=topk_weights, async_finish=async_finish,
                     allocate_on_comm_stream=allocate_on_comm_stream)
