"""DeepSeek-V3 (671B total, 37B active): 61 layers, hidden 7168, MLA, 3 dense layers then 58 MoE layers of
256 routed experts (top-8, sigmoid scores, expert bias, 8 groups / top-4 groups) + 1 shared expert.
Published shapes: arXiv 2412.19437 and the deepseek-ai/DeepSeek-V3 model card. MTP is off by default
(`mtp_num_layers=1` adds the published 14B MTP module).

Reference layout: 32 nodes x 8 GPUs = 256 GPUs, TP1 x PP8 x EP32 (each EP group spans 4 nodes, so dispatch
and combine cross the network through the CPU proxies), 61 layers split 7 | 8 x 6 | 6 over the stages.
"""

RECIPE = dict(
    name="deepseek-v3",
    description="DeepSeek-V3 671B (MLA, 256 experts top-8, 1 shared), EP across nodes",
    cluster=dict(nodes=32, gpus_per_node=8),
    published=dict(total_params=671e9, active_params=37e9),
    args=dict(
        # transformer
        num_layers=61,
        hidden_size=7168,
        ffn_hidden_size=18432,            # the 3 dense layers
        num_attention_heads=128,
        kv_channels=128,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=0.006,
        # multi-latent attention
        multi_latent_attention=True,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
        qk_layernorm=True,
        position_embedding_type="rope",
        rope_type="yarn",
        rotary_base=10000,
        rotary_scaling_factor=40.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        # MoE
        num_experts=256,
        moe_ffn_hidden_size=2048,
        moe_shared_expert_intermediate_size=2048,   # 1 shared expert
        moe_layer_freq="([0]*3+[1]*58)",            # first 3 layers dense
        moe_router_topk=8,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3,
        moe_router_num_groups=8,
        moe_router_group_topk=4,
        moe_router_topk_scaling_factor=2.5,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-4,
        moe_router_dtype="fp32",
        moe_grouped_gemm=True,
        moe_token_dispatcher_type="uccl",
        mtp_num_layers=None,
        # data / tokenizer (mock data by default; point --data-path and a HF tokenizer at real data)
        vocab_size=129280,
        tokenizer_type="NullTokenizer",
        mock_data=True,
        seq_length=4096,
        max_position_embeddings=4096,
        # batch and optimizer
        micro_batch_size=1,
        global_batch_size=1024,
        train_iters=1000,
        lr=2.2e-4,
        min_lr=2.2e-5,
        lr_decay_style="cosine",
        lr_warmup_iters=100,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        clip_grad=1.0,
        bf16=True,
        use_distributed_optimizer=True,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        # parallelism
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=8,
        decoder_first_pipeline_num_layers=7,
        decoder_last_pipeline_num_layers=6,
        expert_model_parallel_size=32,
        expert_tensor_parallel_size=1,
        context_parallel_size=1,
    ),
    env=dict(
        UCCL_IB_MAX_INFLIGHT_NORMAL="8",
        UCCL_IB_MAX_INFLIGHT_LOW_LATENCY="32",
        NCCL_MAX_NCHANNELS="16",   # keep NCCL's own channels from crowding the NIC beside the proxies
        CUDA_DEVICE_MAX_CONNECTIONS="1",
    ),
)
