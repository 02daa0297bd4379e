"""Build a recipe's GPT model with megatron-core on the meta device (no memory, no GPU) and count parameters.

Used by the tests to check recipe shapes against the published totals, and by anyone who wants the exact
megatron-core parameter list of a recipe without a cluster. The full model is built (TP = PP = EP = 1, so
every parameter exists once) inside a one-rank gloo group backed by a file store, so no network is used.

Two stand-ins make megatron-core 0.19 build MLA without a GPU or TransformerEngine; neither owns
parameters, so counts and shapes are exact:
- the core attention of MLA layers is a parameter-free placeholder (the local DotProductAttention spec
  does not accept MLA's separate key/value head dims; TE's kernel does);
- without query compression (q_lora_rank None, V2-Lite) the local spec cannot build the KV-latent norm
  (it wants TE's fused norm+linear), so that model is built without it and its kv_lora_rank weights per
  layer are added to the counts by hand (`uccl_unbuilt_params`);
- `torch.cuda.current_device()` answers 'cpu' while building (YaRN RoPE asks for it to place its
  frequency buffers).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from typing import Iterator
from unittest import mock

import torch

from . import Recipe


class _MetaCoreAttention(torch.nn.Module):
    """Parameter-free placeholder for MLA's core attention (softmax(QK^T)V has no weights)."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, *args, **kwargs):  # pragma: no cover - meta models are never run
        raise RuntimeError("meta-device model: core attention placeholder cannot run")


@contextlib.contextmanager
def _model_parallel_world() -> Iterator[None]:
    """A one-rank process group + megatron parallel state for building an unsharded model."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    created = False
    tmp = None
    if not dist.is_initialized():
        tmp = tempfile.NamedTemporaryFile(prefix="uccl_meta_", delete=False)
        tmp.close()
        os.unlink(tmp.name)
        dist.init_process_group("gloo", init_method=f"file://{tmp.name}", rank=0, world_size=1)
        created = True
    elif dist.get_world_size() != 1:
        raise RuntimeError("build_meta_model: run it in a process without a multi-rank process group")
    ps.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
            if tmp is not None and os.path.exists(tmp.name):
                os.unlink(tmp.name)


def build_meta_model(recipe: Recipe, num_layers: int | None = None):
    """megatron-core GPTModel for `recipe` with every parameter on the meta device.

    `num_layers` (optional) builds only the first layers (with the matching MoE pattern) to save time.
    The dispatcher is built as 'allgather' (dispatchers hold no parameters; this one needs no streams).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    r = recipe.with_args(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                         expert_model_parallel_size=1, expert_tensor_parallel_size=1, context_parallel_size=1,
                         decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                         sequence_parallel=False, recompute_granularity=None, recompute_method=None,
                         recompute_num_layers=None)
    if num_layers is not None:
        pattern = r.moe_layers()[:num_layers]
        r = r.with_args(num_layers=num_layers, moe_layer_freq=str(pattern).replace(" ", ""))
    unbuilt = 0
    if r.args.get("multi_latent_attention") and r.args.get("q_lora_rank") is None and r.args.get("qk_layernorm"):
        # megatron-core's local spec cannot place the KV norm without TE's fused norm+linear when queries
        # are not compressed: build without QK norm and count the KV norms (kv_lora_rank each) by hand.
        unbuilt = int(r.args["num_layers"]) * int(r.args["kv_lora_rank"])
        r = r.with_args(qk_layernorm=False)
    cfg = r.transformer_config(moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
                               perform_initialization=False, persist_layer_norm=False,
                               gradient_accumulation_fusion=False)
    with _model_parallel_world():
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                          normalization=r.args.get("normalization"))
        if r.args.get("multi_latent_attention"):
            for layer_spec in spec.layer_specs:
                attn = layer_spec.submodules.self_attention.submodules
                attn.core_attention = _MetaCoreAttention
        mtp_spec = None
        if r.args.get("mtp_num_layers"):
            mtp_spec = get_gpt_mtp_block_spec(cfg, spec.layer_specs[-1], use_transformer_engine=False)
        with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), torch.device("meta"):
            model = GPTModel(
                config=cfg,
                transformer_layer_spec=spec,
                vocab_size=int(r.args["vocab_size"]),
                max_sequence_length=int(r.args.get("max_position_embeddings") or r.args["seq_length"]),
                position_embedding_type=r.args.get("position_embedding_type", "learned_absolute"),
                share_embeddings_and_output_weights=not r.args.get("untie_embeddings_and_output_weights", False),
                rotary_base=int(r.args.get("rotary_base", 10000)),
                mtp_block_spec=mtp_spec,
            )
    model.uccl_unbuilt_params = unbuilt
    return model


@dataclass
class ParamCounts:
    """Parameter counts. `active` follows DeepSeek's convention (V2: 2.4B of 15.7B, V3: 37B of 671B): the
    weights one token's compute uses in the main model, i.e. everything except the routed experts it is
    not sent to (top-k of E per MoE layer), the input embedding table (a lookup, not a matmul) and the MTP
    layers. `total` includes MTP layers when the recipe enables them."""
    total: int            # every parameter
    active: int           # see above
    routed_experts: int   # all routed-expert parameters
    input_embedding: int  # the input embedding table
    output_layer: int     # the untied output projection (0 when tied)
    per_layer: list[int]  # parameters of each decoder layer
    mtp: int = 0          # multi-token prediction layers (in `total`, not in `active`)


def count_parameters(model, recipe: Recipe) -> ParamCounts:
    """Total / active parameter counts of a model built by `build_meta_model`."""
    total = routed = embedding = output = mtp_total = 0
    n_layers = len(model.decoder.layers)
    per_layer = [0] * n_layers
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if name.startswith("mtp."):
            mtp_total += n
            continue
        if ".mlp.experts." in name:
            routed += n
        if name.startswith("embedding."):
            embedding += n
        if name.startswith("output_layer."):
            output += n
        if name.startswith("decoder.layers."):
            per_layer[int(name.split(".")[2])] += n
    experts = int(recipe.args.get("num_experts") or 0)
    topk = int(recipe.args.get("moe_router_topk") or 0)
    extra = int(getattr(model, "uccl_unbuilt_params", 0))
    total += extra
    active = total - mtp_total - embedding - (routed - routed * topk // experts if experts else 0)
    return ParamCounts(total, active, routed, embedding, output, per_layer, mtp_total)
