"""Megatron integration: `apply()` registers `uccl` as a moe_token_dispatcher_type (and flex backend).

After `apply()`:
- `TransformerConfig(..., moe_token_dispatcher_type='uccl')` validates (with the alltoall dispatcher's
  rules plus ours, e.g. no expert tensor parallelism) and builds MoELayers with `UCCLTokenDispatcher`;
- `moe_token_dispatcher_type='flex', moe_flex_dispatcher_backend='uccl'` runs Megatron's own flex/DeepEP
  path with our `deep_ep` drop-in underneath (uccl_ep_train.compat); why it is registered this way and not
  as a manager of its own: docs/megatron.md, "Megatron-LM main";
- Megatron-LM's argument parser (megatron.training) accepts `--moe-token-dispatcher-type uccl` and
  `--moe-flex-dispatcher-backend uccl`; our own flags come from `megatron_patch.settings.add_arguments`
  (the pretrain-gpt launcher passes them);
- on machines without CUDA, the CPU shims let megatron-core run on gloo ranks.
`apply()` is idempotent.
"""
from __future__ import annotations

import contextlib
import dataclasses
import typing
from typing import Literal

DISPATCHER = "uccl"
_applied = False


def _extend_literal(cls: type, field_name: str, value: str) -> None:
    for f in dataclasses.fields(cls):
        if f.name == field_name and typing.get_origin(f.type) is Literal and value not in typing.get_args(f.type):
            f.type = Literal[typing.get_args(f.type) + (value,)]
            cls.__annotations__[field_name] = f.type


@contextlib.contextmanager
def _field_as(obj, name: str, value):
    """Let Megatron code that only knows its own choices see `value` for a while, then restore ours."""
    with _fields_as(obj, {name: value}):
        yield


@contextlib.contextmanager
def _fields_as(obj, values: dict):
    """_field_as for several fields; fields `obj` lacks (an older megatron-core) are left alone."""
    ours = {name: getattr(obj, name) for name in values if hasattr(obj, name)}
    for name in ours:
        setattr(obj, name, values[name])
    try:
        yield
    finally:
        for name, value in ours.items():
            setattr(obj, name, value)


# Megatron-LM main validates these against its own backends (the receive budget "requires hybridep or ncclep",
# paged stash requires the budget); the uccl dispatcher implements them and checks them itself (check_config),
# so Megatron's post-init sees them unset.
_OURS_WHEN_UCCL = {"moe_token_dispatcher_type": "alltoall", "moe_expert_rank_capacity_factor": None,
                   "moe_paged_stash": False}


def apply() -> None:
    """Register the uccl dispatcher with megatron-core (and Megatron-LM's parser when present)."""
    global _applied
    if _applied:
        return
    from . import cpu_shims
    cpu_shims.install()

    from megatron.core.transformer import transformer_config as tc
    from megatron.core.transformer.moe import moe_layer, token_dispatcher

    from .dispatcher import UCCLTokenDispatcher, check_config, check_flex_config

    for cls in (tc.TransformerConfig, getattr(tc, "MLATransformerConfig", None)):
        if cls is not None:
            _extend_literal(cls, "moe_token_dispatcher_type", DISPATCHER)
            _extend_literal(cls, "moe_flex_dispatcher_backend", DISPATCHER)

    original_post_init = tc.TransformerConfig.__post_init__

    def __post_init__(self):
        if self.moe_token_dispatcher_type == DISPATCHER:
            check_config(self)
            # uccl takes the alltoall dispatcher's validation rules (capacity factor, shared-expert overlap...)
            with _fields_as(self, _OURS_WHEN_UCCL):
                return original_post_init(self)
        if self.moe_flex_dispatcher_backend == DISPATCHER:
            check_flex_config(self)
            with _field_as(self, "moe_flex_dispatcher_backend", "deepep"):
                return original_post_init(self)
        return original_post_init(self)

    tc.TransformerConfig.__post_init__ = __post_init__

    original_layer_init = moe_layer.MoELayer.__init__

    def layer_init(self, config, *args, **kwargs):
        if config.moe_token_dispatcher_type != DISPATCHER:
            return original_layer_init(self, config, *args, **kwargs)
        with _field_as(config, "moe_token_dispatcher_type", "alltoall"):
            original_layer_init(self, config, *args, **kwargs)
        pg_collection = kwargs.get("pg_collection") or (args[2] if len(args) > 2 else None)
        if pg_collection is None:
            pg_collection = moe_layer.get_default_pg_collection()
        self.token_dispatcher = UCCLTokenDispatcher(self.num_local_experts, self.local_expert_indices,
                                                    config=config, pg_collection=pg_collection)
        if self.use_shared_expert and self.shared_expert_overlap:
            self.token_dispatcher.set_shared_experts(self.shared_experts)

    moe_layer.MoELayer.__init__ = layer_init

    original_flex_init = token_dispatcher.MoEFlexTokenDispatcher.__init__

    def flex_init(self, num_local_experts, local_expert_indices, config, *args, **kwargs):
        if config.moe_flex_dispatcher_backend != DISPATCHER:
            return original_flex_init(self, num_local_experts, local_expert_indices, config, *args, **kwargs)
        from uccl_ep_train.compat import install_deep_ep
        install_deep_ep()
        with _field_as(config, "moe_flex_dispatcher_backend", "deepep"):
            original_flex_init(self, num_local_experts, local_expert_indices, config, *args, **kwargs)

    token_dispatcher.MoEFlexTokenDispatcher.__init__ = flex_init
    _applied = True
