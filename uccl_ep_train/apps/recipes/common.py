"""What the recipes here share, so that each recipe file lists only what makes it itself (shapes, router,
batch, layout). Merge in order and override after: `args={**DEEPSEEK_ARGS, **MLA_ARGS, ..., key: value}`.
"""

# The DeepSeek family's conventions, kept by every recipe (the tiny CPU one included).
DEEPSEEK_ARGS = dict(
    normalization="RMSNorm",
    layernorm_epsilon=1e-6,
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    position_embedding_type="rope",
    rotary_base=10000,
    moe_token_dispatcher_type="uccl",
    # data / tokenizer: mock data by default; point --data-path and a HF tokenizer at real data
    tokenizer_type="NullTokenizer",
    mock_data=True,
    lr_decay_style="cosine",
    adam_beta1=0.9,
    adam_beta2=0.95,
    clip_grad=1.0,
    tensor_model_parallel_size=1,
    expert_tensor_parallel_size=1,
    context_parallel_size=1,
)

# Multi-latent attention as DeepSeek-V2/V3 publish it (query compression, q_lora_rank, differs).
MLA_ARGS = dict(
    multi_latent_attention=True,
    kv_lora_rank=512,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
    qk_layernorm=True,
    rope_type="yarn",
    rotary_scaling_factor=40.0,
)

# DeepSeek-V3's router (arXiv 2412.19437): sigmoid scores with an expert bias updated from the load instead
# of a large auxiliary loss, node-limited routing (each token's experts from 4 of 8 groups), top-k weights
# scaled by 2.5, a small sequence-wise auxiliary loss, the router in float32.
V3_ROUTER_ARGS = dict(
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=1e-3,
    moe_router_num_groups=8,
    moe_router_group_topk=4,
    moe_router_topk_scaling_factor=2.5,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-4,
    moe_router_dtype="fp32",
)

# Without TransformerEngine / Apex (CPU ranks, or GPUs without them) the fused kernels are off:
# megatron-core's fused masked softmax imports Apex's scaled_masked_softmax_cuda on GPUs.
NO_FUSED_KERNEL_ARGS = dict(
    apply_rope_fusion=False,
    masked_softmax_fusion=False,
    gradient_accumulation_fusion=False,
    no_persist_layer_norm=True,
)

# Full-size training on GPU clusters: bf16, grouped GEMM, distributed optimizer, 4K sequences.
GPU_TRAINING_ARGS = dict(
    init_method_std=0.006,
    moe_grouped_gemm=True,
    seq_length=4096,
    max_position_embeddings=4096,
    micro_batch_size=1,
    train_iters=1000,
    lr_warmup_iters=100,
    weight_decay=0.1,
    bf16=True,
    use_distributed_optimizer=True,
)

# Proxy in-flight limits of the UCCL-EP README, and NCCL kept from crowding the NIC beside the proxies.
CLUSTER_ENV = dict(
    UCCL_IB_MAX_INFLIGHT_NORMAL="8",
    UCCL_IB_MAX_INFLIGHT_LOW_LATENCY="32",
    NCCL_MAX_NCHANNELS="16",
    CUDA_DEVICE_MAX_CONNECTIONS="1",
)
