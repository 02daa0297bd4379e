"""DeepSeek-V2-Lite (15.7B total, 2.4B active): 27 layers, hidden 2048, MLA without query compression,
1 dense layer then 26 MoE layers of 64 routed experts (top-6, softmax) + 2 shared experts.
Published shapes: arXiv 2405.04434 and the deepseek-ai/DeepSeek-V2-Lite model card.

Reference layout: 2 nodes x 8 GPUs, TP1 x PP1 x EP16 (4 experts per GPU, EP spans both nodes).
"""

from uccl_ep_train.apps.recipes.common import CLUSTER_ENV, DEEPSEEK_ARGS, GPU_TRAINING_ARGS, MLA_ARGS

RECIPE = dict(
    name="deepseek-v2-lite",
    description="DeepSeek-V2-Lite 16B (MLA, 64 experts top-6, 2 shared), EP across 2 nodes",
    cluster=dict(nodes=2, gpus_per_node=8),
    published=dict(total_params=15.7e9, active_params=2.4e9),
    args={
        **DEEPSEEK_ARGS, **MLA_ARGS, **GPU_TRAINING_ARGS,
        "num_layers": 27,
        "hidden_size": 2048,
        "ffn_hidden_size": 10944,
        "num_attention_heads": 16,
        "kv_channels": 128,
        "q_lora_rank": None,                 # V2-Lite projects queries directly
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "num_experts": 64,
        "moe_ffn_hidden_size": 1408,
        "moe_shared_expert_intermediate_size": 2816,   # 2 shared experts x 1408
        "moe_layer_freq": "([0]*1+[1]*26)",
        "moe_router_topk": 6,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 1e-3,
        "moe_router_topk_scaling_factor": 1.0,
        "vocab_size": 102400,
        "global_batch_size": 256,
        "lr": 4.2e-4,
        "min_lr": 4.2e-5,
        "pipeline_model_parallel_size": 1,
        "expert_model_parallel_size": 16,
    },
    env=dict(CLUSTER_ENV),
)
