"""Recipes: every recipe selects uccl, survives Megatron-LM's own argument parser and config translation,
and builds with megatron-core on the meta device with the published DeepSeek shapes and parameter counts."""
import json
import warnings

import pytest

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|absl|TE).*")

from uccl_ep_train.apps.recipes import (  # noqa: E402
    Recipe, list_recipes, load_recipe, megatron_cli_args, nic_env, parse_moe_layer_freq)
from uccl_ep_train.apps.plan import count_params  # noqa: E402

RECIPES = ["deepseek-v3", "deepseek-v2-lite", "tiny", "deepseek-v3-small"]


def test_builtin_recipes_are_listed_and_select_uccl():
    assert list_recipes() == RECIPES
    for name in RECIPES:
        r = load_recipe(name)
        args = r.megatron_args()
        i = args.index("--moe-token-dispatcher-type")
        assert args[i + 1] == "uccl", name
        assert all(isinstance(v, str) for v in r.env.values())
    assert load_recipe("deepseek_v3").name == "deepseek-v3"


def test_unknown_recipe_names_the_choices():
    with pytest.raises(ValueError, match="deepseek-v3"):
        load_recipe("deepseek-v9")


def test_deepseek_v3_recipe_has_the_published_shape():
    a = load_recipe("deepseek-v3").args
    assert (a["num_layers"], a["hidden_size"], a["num_experts"], a["moe_router_topk"]) == (61, 7168, 256, 8)
    assert a["multi_latent_attention"] and (a["q_lora_rank"], a["kv_lora_rank"]) == (1536, 512)
    assert a["moe_shared_expert_intermediate_size"] == a["moe_ffn_hidden_size"] == 2048
    assert load_recipe("deepseek-v3").moe_layers() == [0] * 3 + [1] * 58
    assert a.get("mtp_num_layers") is None  # MTP off by default


def test_megatron_cli_args_conversion():
    out = megatron_cli_args({"num_layers": 2, "swiglu": True, "bf16": False, "add_bias_linear": False,
                             "layernorm_epsilon": 1e-6, "q_lora_rank": None, "moe_aux_loss_coeff": [0.1, 0.2]})
    assert out == ["--num-layers", "2", "--swiglu", "--disable-bias-linear", "--norm-epsilon", "1e-06",
                   "--moe-aux-loss-coeff", "0.1", "0.2"]
    with pytest.raises(TypeError, match="add_bias_linear"):
        megatron_cli_args({"add_bias_linear": "no"})


def test_moe_layer_freq_forms():
    assert parse_moe_layer_freq("([0]*3+[1]*2)", 5) == [0, 0, 0, 1, 1]
    assert parse_moe_layer_freq(2, 4) == [1, 0, 1, 0]
    assert parse_moe_layer_freq([0, 1], 2) == [0, 1]
    with pytest.raises(ValueError, match="describes 4 layers"):
        parse_moe_layer_freq("[1]*4", 5)
    with pytest.raises(ValueError, match="only list literals"):
        parse_moe_layer_freq("__import__('os').getcwd()", 1)


@pytest.mark.parametrize("name", RECIPES)
def test_megatron_parser_reads_back_every_recipe_arg(name):
    """The generated CLI, parsed by Megatron-LM's own parser, gives back every value of the recipe."""
    r = load_recipe(name)
    ns = r.parse_megatron_args()
    for dest, want in r.args.items():
        got = getattr(ns, dest)
        if dest == "moe_layer_freq":
            assert list(got) == r.moe_layers(), dest
        elif isinstance(got, list) and not isinstance(want, list):
            assert got == [want], dest      # nargs='+' arguments
        else:
            assert got == want, (dest, got, want)


@pytest.mark.parametrize("name", RECIPES)
def test_transformer_config_matches_model_config(name):
    r = load_recipe(name)
    cfg = r.transformer_config()
    mc = r.model_config()
    assert cfg.moe_token_dispatcher_type == "uccl"
    assert type(cfg).__name__ == ("MLATransformerConfig" if r.args.get("multi_latent_attention") else "TransformerConfig")
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_moe_experts",
                "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_topk",
                "gated_linear_unit", "add_bias_linear", "layernorm_epsilon", "expert_model_parallel_size",
                "pipeline_model_parallel_size", "tensor_model_parallel_size", "moe_router_score_function",
                "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        if key in mc:
            assert getattr(cfg, key) == mc[key], key
    assert list(cfg.moe_layer_freq) == mc["moe_layer_freq"]
    assert mc["share_embeddings_and_output_weights"] is False
    assert mc["activation"] == "silu"
    for key in ("vocab_size", "seq_length", "micro_batch_size", "global_batch_size"):
        assert isinstance(mc[key], int), key


@pytest.mark.parametrize("name", RECIPES)
def test_megatron_validate_args_accepts_every_recipe_on_its_reference_cluster(name):
    r = load_recipe(name)
    ns = r.validate_megatron()
    world = r.cluster["nodes"] * r.cluster["gpus_per_node"]
    assert ns.data_parallel_size == world // (r.tp * r.pp * r.cp)
    assert ns.moe_token_dispatcher_type == "uccl"


def test_megatron_validate_args_refuses_a_broken_recipe():
    r = load_recipe("deepseek-v3")
    with pytest.raises(AssertionError, match="multiple of expert model parallel"):
        r.with_args(num_experts=250).validate_megatron()
    with pytest.raises(AssertionError, match="divisible"):
        r.validate_megatron(world_size=24)


def test_with_args_copies(tmp_path):
    r = load_recipe("tiny")
    r2 = r.with_args(expert_model_parallel_size=4, num_layers=6, moe_layer_freq="([0]+[1]*5)")
    assert r.ep == 2 and r2.ep == 4 and r2.moe_layers() == [0] + [1] * 5
    assert r.args["num_layers"] == 4


def test_recipe_files(tmp_path):
    base = load_recipe("tiny")
    data = {"name": "mine", "args": dict(base.args, num_layers=2, moe_layer_freq="[0,1]"), "env": {"UCCL_IB_SL": 3}}
    p = tmp_path / "mine.json"
    p.write_text(json.dumps(data))
    r = load_recipe(str(p))
    assert isinstance(r, Recipe) and r.name == "mine" and r.moe_layers() == [0, 1] and r.env == {"UCCL_IB_SL": "3"}
    t = tmp_path / "mine.toml"
    t.write_text('name = "t"\n[args]\nnum_layers = 1\nhidden_size = 8\nnum_attention_heads = 2\n'
                 'seq_length = 4\nmicro_batch_size = 1\nglobal_batch_size = 1\n')
    assert load_recipe(str(t)).args["hidden_size"] == 8
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "args": {"num_layers": 1}}))
    with pytest.raises(ValueError, match="hidden_size"):
        load_recipe(str(bad))


def test_nic_profiles_follow_the_seed_readme():
    assert nic_env("thor2") == {"UCCL_IB_MAX_INFLIGHT_BYTES": "1572864", "UCCL_IB_MAX_INFLIGHT_NORMAL": "1"}
    assert nic_env("pollara")["UCCL_IB_MAX_INFLIGHT_BYTES"] == "2097152"
    assert nic_env(None) == {}
    with pytest.raises(ValueError, match="cx7"):
        nic_env("myrinet")


# ---- meta-device builds with megatron-core -----------------------------------------------------------------
PUBLISHED_TOL = {"deepseek-v3": (0.005, 0.03), "deepseek-v2-lite": (0.01, 0.03)}


@pytest.fixture(scope="module")
def built():
    from uccl_ep_train.apps.recipes.model import build_meta_model, count_parameters
    out = {}
    for name in RECIPES:
        r = load_recipe(name)
        m = build_meta_model(r)
        out[name] = (r, m, count_parameters(m, r))
    return out


@pytest.mark.parametrize("name", RECIPES)
def test_meta_model_matches_published_and_analytic_counts(built, name):
    r, model, counts = built[name]
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert len(model.decoder.layers) == r.args["num_layers"]
    # the analytic count (used by `plan`) and megatron-core's model agree exactly
    pb = count_params(r)
    assert (pb.total, pb.active) == (counts.total, counts.active)
    if name in PUBLISHED_TOL:
        tol_total, tol_active = PUBLISHED_TOL[name]
        pub = r.published
        assert abs(counts.total - pub["total_params"]) / pub["total_params"] < tol_total, counts.total
        assert abs(counts.active - pub["active_params"]) / pub["active_params"] < tol_active, counts.active


def test_deepseek_v3_meta_shapes(built):
    r, model, counts = built["deepseek-v3"]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["embedding.word_embeddings.weight"] == (129280, 7168)
    assert shapes["output_layer.weight"] == (129280, 7168)
    attn = "decoder.layers.0.self_attention."
    assert shapes[attn + "linear_q_down_proj.weight"] == (1536, 7168)
    assert shapes[attn + "linear_q_up_proj.weight"] == (128 * (128 + 64), 1536)
    assert shapes[attn + "linear_kv_down_proj.weight"] == (512 + 64, 7168)
    assert shapes[attn + "linear_kv_up_proj.weight"] == (128 * (128 + 128), 512)
    assert shapes[attn + "linear_proj.weight"] == (7168, 128 * 128)
    assert shapes["decoder.layers.2.mlp.linear_fc1.weight"] == (2 * 18432, 7168)        # last dense layer
    assert "decoder.layers.2.mlp.router.weight" not in shapes
    assert shapes["decoder.layers.3.mlp.router.weight"] == (256, 7168)                  # first MoE layer
    assert shapes["decoder.layers.3.mlp.shared_experts.linear_fc1.weight"] == (2 * 2048, 7168)
    experts = [n for n in shapes if n.startswith("decoder.layers.60.mlp.experts.") and n.endswith("linear_fc1.weight")]
    assert len(experts) == 256 and shapes[experts[0]] == (2 * 2048, 7168)
    assert counts.per_layer[0] == counts.per_layer[2] and counts.per_layer[3] == counts.per_layer[60]


def test_mtp_layers_are_counted_like_megatron_builds_them():
    """DeepSeek-V3 with its published MTP module (off by default): the analytic count follows megatron-core's
    MultiTokenPredictionLayer (norms, eh_proj, one MoE layer) -- checked on a 4-layer cut of the model."""
    from uccl_ep_train.apps.recipes.model import build_meta_model, count_parameters
    r = load_recipe("deepseek-v3").with_args(mtp_num_layers=1, num_layers=4, moe_layer_freq="([0]*3+[1])",
                                             pipeline_model_parallel_size=1, decoder_first_pipeline_num_layers=None,
                                             decoder_last_pipeline_num_layers=None)
    counts = count_parameters(build_meta_model(r), r)
    pb = count_params(r)
    assert counts.mtp == pb.mtp > 11e9
    assert (counts.total, counts.active) == (pb.total, pb.active)
    full = count_params(load_recipe("deepseek-v3").with_args(mtp_num_layers=1))
    assert abs(full.total - 683e9) / 683e9 < 0.01     # 671 B + the MTP layer (embedding and head shared)
