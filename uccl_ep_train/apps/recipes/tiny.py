"""tiny: a DeepSeek-V3-shaped MoE small enough to train on CPU ranks (gloo) in seconds.

Same structure as DeepSeek-V3 (first layer dense, then MoE layers with routed experts + a shared expert,
sigmoid router with expert bias, RMSNorm, SwiGLU, untied embeddings), scaled down. Attention is plain
multi-head attention, not MLA: megatron-core's MLA needs TransformerEngine's attention kernel (its local
DotProductAttention takes no separate key/value head dims), which CPU machines lack.
Layout: one node, EP over all ranks (8 experts: EP 1, 2, 4 or 8).
"""

from uccl_ep_train.apps.recipes.common import DEEPSEEK_ARGS, NO_FUSED_KERNEL_ARGS

RECIPE = dict(
    name="tiny",
    description="tiny DeepSeek-V3-shaped MoE (4 layers, 8 experts top-2, 1 shared) for CPU ranks",
    cluster=dict(nodes=1, gpus_per_node=2),
    published=dict(),
    args={
        **DEEPSEEK_ARGS,
        "num_layers": 4,
        "hidden_size": 64,
        "ffn_hidden_size": 256,
        "num_attention_heads": 4,
        "kv_channels": 16,
        "init_method_std": 0.02,
        **NO_FUSED_KERNEL_ARGS,
        "num_experts": 8,
        "moe_ffn_hidden_size": 64,
        "moe_shared_expert_intermediate_size": 64,
        "moe_layer_freq": "([0]*1+[1]*3)",
        "moe_router_topk": 2,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 1e-3,
        "moe_router_load_balancing_type": "seq_aux_loss",
        "moe_aux_loss_coeff": 1e-3,
        "moe_router_dtype": "fp32",
        "moe_grouped_gemm": False,
        "vocab_size": 1024,
        "seq_length": 64,
        "max_position_embeddings": 64,
        "micro_batch_size": 2,
        "global_batch_size": 8,
        "train_iters": 20,
        "lr": 1e-3,
        "min_lr": 1e-4,
        "lr_warmup_iters": 2,
        "weight_decay": 0.01,
        "bf16": False,
        "pipeline_model_parallel_size": 1,
        "expert_model_parallel_size": 2,
    },
    env=dict(),
)
