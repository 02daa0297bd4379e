"""Build megatron-core MoE modules on spawned ranks for parity tests (uccl vs alltoall)."""
from __future__ import annotations

import torch

import megatron_patch


def init_parallel(ep: int) -> None:
    megatron_patch.apply()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)


def moe_config(dispatcher: str, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
              num_moe_experts=8, moe_router_topk=3, moe_ffn_hidden_size=32,
              moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type="aux_loss",
              moe_aux_loss_coeff=0.01, moe_shared_expert_intermediate_size=48, use_cpu_initialization=True,
              add_bias_linear=False, expert_model_parallel_size=torch.distributed.get_world_size(),
              moe_router_dtype="fp32", bf16=False, params_dtype=torch.float32)
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_moe_layer(dispatcher: str, grouped: bool = False, **overrides):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    config = moe_config(dispatcher, **overrides)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=grouped)
    torch.manual_seed(42)
    layer = MoELayer(config, spec.submodules.mlp.keywords["submodules"])
    return layer


def replay_forward_exactly(layer, rank: int, shape: tuple, replays: int) -> None:
    """A MoE layer's forward (no grad) on `shape` inputs, warmed up on a side stream (the first dispatch may
    bootstrap or grow buffers: not in a capture), captured once in a CUDA graph and replayed `replays` times
    with new inputs: each replay must equal the same forward run eagerly right after it, bit for bit."""
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(rank)
    static_x = torch.randn(*shape, generator=gen).to(dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):
            layer(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out, _ = layer(static_x)
    for i in range(replays):
        static_x.copy_(torch.randn(*shape, generator=gen).to(dev))
        graph.replay()
        with torch.no_grad():
            eager, _ = layer(static_x)
        if not torch.equal(static_out, eager):
            raise AssertionError(f"rank {rank}, replay {i}: differs from eager by "
                                 f"{(static_out - eager).abs().max().item()}")
