"""DeepSeek-V3 (671B total, 37B active): 61 layers, hidden 7168, MLA, 3 dense layers then 58 MoE layers of
256 routed experts (top-8, sigmoid scores, expert bias, 8 groups / top-4 groups) + 1 shared expert.
Published shapes: arXiv 2412.19437 and the deepseek-ai/DeepSeek-V3 model card. MTP is off by default
(`mtp_num_layers=1` adds the published 14B MTP module).

Reference layout: 32 nodes x 8 GPUs = 256 GPUs, TP1 x PP8 x EP32 (each EP group spans 4 nodes, so dispatch
and combine cross the network through the CPU proxies), 61 layers split 7 | 8 x 6 | 6 over the stages.
"""

from uccl_ep_train.apps.recipes.common import CLUSTER_ENV, DEEPSEEK_ARGS, GPU_TRAINING_ARGS, MLA_ARGS, V3_ROUTER_ARGS

RECIPE = dict(
    name="deepseek-v3",
    description="DeepSeek-V3 671B (MLA, 256 experts top-8, 1 shared), EP across nodes",
    cluster=dict(nodes=32, gpus_per_node=8),
    published=dict(total_params=671e9, active_params=37e9),
    args={
        **DEEPSEEK_ARGS, **MLA_ARGS, **GPU_TRAINING_ARGS,
        # transformer
        "num_layers": 61,
        "hidden_size": 7168,
        "ffn_hidden_size": 18432,            # the 3 dense layers
        "num_attention_heads": 128,
        "kv_channels": 128,
        # multi-latent attention
        "q_lora_rank": 1536,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        # MoE
        "num_experts": 256,
        "moe_ffn_hidden_size": 2048,
        "moe_shared_expert_intermediate_size": 2048,   # 1 shared expert
        "moe_layer_freq": "([0]*3+[1]*58)",            # first 3 layers dense
        "moe_router_topk": 8,
        **V3_ROUTER_ARGS,
        "mtp_num_layers": None,
        "vocab_size": 129280,
        # batch and optimizer
        "global_batch_size": 1024,
        "lr": 2.2e-4,
        "min_lr": 2.2e-5,
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
        # parallelism
        "pipeline_model_parallel_size": 8,
        "decoder_first_pipeline_num_layers": 7,
        "decoder_last_pipeline_num_layers": 6,
        "expert_model_parallel_size": 32,
    },
    env=dict(CLUSTER_ENV),
)
