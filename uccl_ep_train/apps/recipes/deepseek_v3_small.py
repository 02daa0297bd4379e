"""deepseek-v3-small: what DeepSeek-V3 training exercises in the dispatcher, at a size one GPU (or a few CPU
ranks) trains in minutes: several MoE layers (first layer dense, then 3 MoE layers), top-8 of 64 routed
experts with node-limited routing (8 groups, each token's experts drawn from its top-4 groups, Megatron's
`moe_router_num_groups` / `moe_router_group_topk`, as V3's 8 / 4), sigmoid scores with expert bias and V3's
top-k scaling factor, one shared expert, the sequence auxiliary loss.

What it leaves out, and why: MLA (megatron-core's MLA needs TransformerEngine's attention kernel, absent on
CPU machines and without TE; plain multi-head attention here, as in `tiny`), and FP8 dispatch: Megatron turns
FP8 on only through TransformerEngine (`--fp8-format`), whose FP8 tensors reach the dispatcher as TE
Float8Tensors; without TE the hidden states are BF16 (on GPUs) and are dispatched as such.
Reference layout: 2 nodes x 2 GPUs, EP 4 across the nodes (64 experts divide EP 1, 2, 4 or 8).
"""

from uccl_ep_train.apps.recipes.common import DEEPSEEK_ARGS, NO_FUSED_KERNEL_ARGS, V3_ROUTER_ARGS

RECIPE = dict(
    name="deepseek-v3-small",
    description="DeepSeek-V3-shaped small MoE (4 layers, 64 experts top-8, node-limited 8/4 groups, 1 shared)",
    cluster=dict(nodes=2, gpus_per_node=2),
    published=dict(),
    args={
        **DEEPSEEK_ARGS,
        "num_layers": 4,
        "hidden_size": 128,
        "ffn_hidden_size": 512,              # the dense layer
        "num_attention_heads": 4,
        "kv_channels": 32,
        "init_method_std": 0.02,
        **NO_FUSED_KERNEL_ARGS,
        "num_experts": 64,
        "moe_ffn_hidden_size": 32,
        "moe_shared_expert_intermediate_size": 32,   # 1 shared expert
        "moe_layer_freq": "([0]*1+[1]*3)",
        "moe_router_topk": 8,
        **V3_ROUTER_ARGS,
        "moe_grouped_gemm": False,
        "vocab_size": 1024,
        "seq_length": 64,
        "max_position_embeddings": 64,
        "micro_batch_size": 2,
        "global_batch_size": 8,
        "train_iters": 50,
        "lr": 1e-3,
        "min_lr": 1e-4,
        "lr_warmup_iters": 2,
        "weight_decay": 0.01,
        "bf16": False,
        "pipeline_model_parallel_size": 1,
        "expert_model_parallel_size": 4,
    },
    env=dict(),
)
