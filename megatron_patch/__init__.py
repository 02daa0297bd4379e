"""Megatron integration: `apply()` registers `uccl` as a moe_token_dispatcher_type.

After `apply()`:
- `TransformerConfig(..., moe_token_dispatcher_type='uccl')` validates (with the alltoall dispatcher's
  rules plus ours, e.g. no expert tensor parallelism) and builds MoELayers with `UCCLTokenDispatcher`;
- Megatron-LM's argument parser (megatron.training) accepts `--moe-token-dispatcher-type uccl`; our own
  flags come from `megatron_patch.settings.add_arguments` (the launcher passes it as extra_args_provider);
- on machines without CUDA, the CPU shims let megatron-core run on gloo ranks.
`apply()` is idempotent.
"""
from __future__ import annotations

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


def apply() -> None:
    """Register the uccl dispatcher with megatron-core (and Megatron-LM's parser when present)."""
    global _applied
    if _applied:
        return
    from . import cpu_shims
    cpu_shims.install()

    from megatron.core.transformer import transformer_config as tc
    from megatron.core.transformer.moe import moe_layer

    from .dispatcher import UCCLTokenDispatcher, check_config

    for cls in (tc.TransformerConfig, getattr(tc, "MLATransformerConfig", None)):
        if cls is not None:
            _extend_literal(cls, "moe_token_dispatcher_type", DISPATCHER)

    original_post_init = tc.TransformerConfig.__post_init__

    def __post_init__(self):
        if self.moe_token_dispatcher_type != DISPATCHER:
            return original_post_init(self)
        check_config(self)
        # uccl takes the alltoall dispatcher's validation rules (capacity factor, shared-expert overlap...)
        self.moe_token_dispatcher_type = "alltoall"
        try:
            original_post_init(self)
        finally:
            self.moe_token_dispatcher_type = DISPATCHER

    tc.TransformerConfig.__post_init__ = __post_init__

    original_init = moe_layer.MoELayer.__init__

    def __init__(self, config, *args, **kwargs):
        if config.moe_token_dispatcher_type != DISPATCHER:
            return original_init(self, config, *args, **kwargs)
        config.moe_token_dispatcher_type = "alltoall"
        try:
            original_init(self, config, *args, **kwargs)
        finally:
            config.moe_token_dispatcher_type = DISPATCHER
        pg_collection = kwargs.get("pg_collection") or (args[2] if len(args) > 2 else None)
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_layer import get_default_pg_collection
            pg_collection = get_default_pg_collection()
        self.token_dispatcher = UCCLTokenDispatcher(self.num_local_experts, self.local_expert_indices,
                                                    config=config, pg_collection=pg_collection)
        if self.use_shared_expert and self.shared_expert_overlap:
            self.token_dispatcher.set_shared_experts(self.shared_experts)

    moe_layer.MoELayer.__init__ = __init__
    _applied = True
