"""`uccl-ep-train plan`: layout validation, parameter counts, memory estimate, launch command."""
import json
import shlex

import pytest

from uccl_ep_train.apps import plan
from uccl_ep_train.apps.plan import GiB, check_layout, count_params, estimate_memory, stage_layer_counts
from uccl_ep_train.apps.recipes import load_recipe


def run(capsys, *argv):
    rc = plan.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_deepseek_v3_reference_layout_report(capsys):
    rc, out, err = run(capsys, "--recipe", "deepseek-v3", "--nodes", "32", "--gpus-per-node", "8")
    assert rc == 0, err
    for line in ("layout    TP 1 x PP 8 x CP 1 x DP 32; experts: EP 32 x ETP 1 x expert-DP 1; dispatcher uccl",
                 "layers per pipeline stage [7, 8, 8, 8, 8, 8, 8, 6]",
                 "params    total 671.03 B, active 36.63 B per token (3 dense + 58 MoE layers)",
                 "each EP group spans 4 nodes"):
        assert line in out, line
    for term in ("weights", "gradients", "optimizer", "activations", "EP buffers", "total"):
        assert f"  {term}" in out, term
    assert "fits in 80 GiB" in out
    assert "sbatch --nodes=32 --gpus-per-node=8 slurm/train.sbatch deepseek-v3" in out
    assert "--moe-token-dispatcher-type uccl" in out


def test_json_report(capsys, tmp_path):
    rc, out, _ = run(capsys, "--recipe", "deepseek-v3", "--nodes", "32", "--gpus-per-node", "8", "--json")
    assert rc == 0
    rep = json.loads(out)
    # --json PATH writes the same report there, as every command's --json does
    path = tmp_path / "plan.json"
    rc, out2, _ = run(capsys, "--recipe", "deepseek-v3", "--nodes", "32", "--gpus-per-node", "8", "--json", str(path))
    assert rc == 0 and not out2.strip() and json.loads(path.read_text()) == rep
    assert rep["layout"]["dp"] == 32 and rep["layout"]["expert_dp"] == 1 and rep["layout"]["num_microbatches"] == 32
    assert rep["params"]["total"] == count_params(load_recipe("deepseek-v3")).total
    mem = rep["memory"]
    assert mem["total"] == sum(mem[k] for k in ("weights", "gradients", "optimizer", "activations", "ep_buffers"))
    assert rep["fits"] is True
    cmd = rep["torchrun"]
    assert cmd[:13] == ["torchrun", "--nnodes", "32", "--nproc-per-node", "8", "--node-rank", "$NODE_RANK",
                        "--master-addr", "$MASTER_ADDR", "--master-port", "$MASTER_PORT", "-m", "uccl_ep_train.apps.cli"]
    assert cmd[13] == "pretrain-gpt"
    assert "--mock-data" in cmd and "--moe-token-dispatcher-type" in cmd


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "32", "--ep", "24"], "num_experts 256 is not divisible by EP 24"),
    (["--nodes", "3", "--pp", "16"], "world size 24 is not divisible by TP*PP*CP = 1*16*1"),
    (["--nodes", "4"], "not divisible by ETP*EP*PP = 1*32*8"),
    (["--nodes", "32", "--pp", "7", "--keep-stage-layers"], "num_layers - first - last = 48 is not divisible by the 5"),
    (["--nodes", "32", "--gbs", "1000"], "global_batch_size 1000 is not divisible by micro_batch_size*DP = 1*32"),
    (["--nodes", "32", "--tp", "3", "--ep", "8"], "num_attention_heads 128 is not divisible by TP 3"),
])
def test_bad_layouts_are_refused_with_a_reason(capsys, argv, message):
    rc, out, err = run(capsys, "--recipe", "deepseek-v3", "--gpus-per-node", "8", *argv)
    assert rc == 2
    assert message in err, err
    assert out == ""


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite", "tiny"])
def test_every_recipe_fits_its_reference_cluster(name):
    r = load_recipe(name)
    lay = check_layout(r, r.cluster["nodes"], r.cluster["gpus_per_node"])
    assert lay.errors == []
    assert sum(lay.stage_layers) == r.args["num_layers"] and len(lay.stage_layers) == r.pp
    assert estimate_memory(r, lay).total < 80 * GiB


def test_tp_with_ep_needs_sequence_parallel():
    r = load_recipe("deepseek-v3").with_args(tensor_model_parallel_size=2)
    assert "TP > 1 with EP > 1 needs sequence_parallel" in " ".join(check_layout(r, 32, 8).errors)
    assert check_layout(r.with_args(sequence_parallel=True), 32, 8).errors == []


def test_pp_override_resplits_the_layers(capsys):
    assert plan.balanced_stage_split(61, 8) == (7, 6)
    assert plan.balanced_stage_split(61, 4) == (16, 15)
    assert plan.balanced_stage_split(64, 8) == (None, None)
    assert plan.balanced_stage_split(61, 1) == (None, None)
    rc, out, err = run(capsys, "--recipe", "deepseek-v3", "--nodes", "32", "--gpus-per-node", "8", "--pp", "4",
                       "--ep", "64", "--json")
    assert rc == 0, err
    assert json.loads(out)["layout"]["stage_layers"] == [16, 15, 15, 15]


def test_suggest_lists_layouts_that_fit(capsys):
    rc, out, err = run(capsys, "--recipe", "deepseek-v3", "--nodes", "16", "--gpus-per-node", "8",
                       "--gpu-mem-gib", "141", "--suggest", "3")
    assert rc == 0, err
    lines = [l for l in out.splitlines() if l.startswith("  TP ")]
    assert 1 <= len(lines) <= 3
    # every suggestion, fed back to plan, passes its checks and fits
    for line in lines:
        argv = line.split("uccl-ep-train plan ")[1].split()
        rc, out2, err2 = run(capsys, *argv, "--gpu-mem-gib", "141", "--json")
        assert rc == 0, err2
        assert json.loads(out2)["fits"] is True
    rc, out, err = run(capsys, "--recipe", "deepseek-v3", "--nodes", "2", "--gpus-per-node", "8", "--suggest")
    assert rc == 2 and "no TP x PP x EP layout" in err


def test_stage_split_rules():
    r = load_recipe("deepseek-v3")
    assert stage_layer_counts(r) == [7] + [8] * 6 + [6]
    assert stage_layer_counts(r.with_args(pipeline_model_parallel_size=1, decoder_first_pipeline_num_layers=None,
                                          decoder_last_pipeline_num_layers=None)) == [61]
    errs: list = []
    assert stage_layer_counts(r.with_args(decoder_first_pipeline_num_layers=8), errs) == []
    assert "num_layers - first - last = 47" in errs[0]
    errs = []
    stage_layer_counts(r.with_args(pipeline_model_parallel_size=1), errs)
    assert "need pipeline_model_parallel_size > 1" in errs[0]


def test_memory_estimate_follows_the_layout():
    r = load_recipe("deepseek-v3")
    base = estimate_memory(r, check_layout(r, 32, 8))
    pb = count_params(r)
    # stage 1 (8 MoE layers) is the heaviest; its expert weights are split 32 ways
    assert base.stage == 1
    assert base.params_expert == 8 * 256 * pb.routed_expert // 32
    assert base.weights == 2 * (base.params_dense + base.params_expert)       # bf16
    assert base.gradients == 4 * (base.params_dense + base.params_expert)     # fp32 main grads
    assert base.ep_buffers > 0
    # half the EP size -> twice the expert weights per GPU, and no longer fits in 80 GiB
    r16 = r.with_args(expert_model_parallel_size=16)
    m16 = estimate_memory(r16, check_layout(r16, 32, 8))
    assert m16.params_expert == 2 * base.params_expert
    assert m16.total > base.total
    # no recompute -> more activation memory
    r_nore = r.with_args(recompute_granularity=None)
    assert estimate_memory(r_nore, check_layout(r_nore, 32, 8)).activations > 4 * base.activations
    # one GPU, no parallelism: every parameter lives there
    t = load_recipe("tiny").with_args(expert_model_parallel_size=1)
    mt = estimate_memory(t, check_layout(t, 1, 1))
    assert mt.params_dense + mt.params_expert == count_params(t).total
    assert mt.ep_buffers == 0


def test_too_small_cluster_does_not_fit(capsys):
    rc, out, _ = run(capsys, "--recipe", "deepseek-v3", "--nodes", "8", "--gpus-per-node", "8", "--ep", "8")
    assert rc == 0
    assert "DOES NOT FIT in 80 GiB" in out
    # nothing fits 8 x 8 GPUs of 80 GiB: the report says so, and where it would
    assert "no TP x PP x EP layout of deepseek-v3 fits 8 node(s) x 8 GPU(s) of 80 GiB" in out
    assert "it fits from 24 nodes of 8 GPU(s)" in out


def _suggested_commands(text: str) -> list[list[str]]:
    return [line.split("uccl-ep-train plan ")[1].split() for line in text.splitlines() if line.startswith("  TP ")]


def test_refused_layout_proposes_layouts_that_fit(capsys):
    """The recipe's own layout (EP 32 x PP 8 = 256 ranks) cannot be laid on 16 x 8 GPUs: plan says why and
    lists layouts that fit, each of which plan then accepts, fitting, at the memory it listed."""
    rc, out, err = run(capsys, "--recipe", "deepseek-v3", "--nodes", "16", "--gpus-per-node", "8",
                       "--gpu-mem-gib", "141")
    assert rc == 2 and out == ""
    assert "not divisible by ETP*EP*PP = 1*32*8" in err
    assert "layouts of deepseek-v3 that fit 16 node(s) x 8 GPU(s), 141 GiB each (best first):" in err
    commands = _suggested_commands(err)
    assert 1 <= len(commands) <= 5
    for line, argv in zip([l for l in err.splitlines() if l.startswith("  TP ")], commands):
        rc, out2, err2 = run(capsys, *argv, "--gpu-mem-gib", "141", "--json")
        assert rc == 0, err2
        rep = json.loads(out2)
        assert rep["fits"] is True and rep["suggestions"] == []
        assert f"{rep['memory']['total'] / GiB:.2f} GiB per GPU" in line


def test_no_layout_fits_8_nodes_of_8_gpus(capsys):
    """DeepSeek-V3 on 8 x 8 GPUs of 80 GiB: no layout fits; plan lists the valid ones needing the least
    memory (as the plan estimates them) and the fewest nodes that hold it (24: none from 10 to 22)."""
    rc, out, err = run(capsys, "--recipe", "deepseek-v3", "--nodes", "8", "--gpus-per-node", "8")
    assert rc == 2
    assert "no TP x PP x EP layout of deepseek-v3 fits 8 node(s) x 8 GPU(s) of 80 GiB" in err
    lines = [l for l in err.splitlines() if l.startswith("  TP ")]
    assert len(lines) == 5 and lines[0].startswith("  TP 8 PP 4 EP 16 ")
    totals = []
    for line, argv in zip(lines, _suggested_commands(err)):
        rc, out2, _ = run(capsys, *argv, "--json")
        rep = json.loads(out2)
        assert rc == 0 and rep["fits"] is False and rep["layout"]["errors"] == []
        assert f"{rep['memory']['total'] / GiB:.2f} GiB per GPU" in line
        totals.append(rep["memory"]["total"])
    assert totals == sorted(totals) and totals[0] > 80 * GiB
    assert "it fits from 24 nodes of 8 GPU(s): uccl-ep-train plan --recipe deepseek-v3 --nodes 24" in err
    r = load_recipe("deepseek-v3")
    assert plan.suggest_layouts(r, 22, 8, 80.0, 1) == [] and plan.suggest_layouts(r, 24, 8, 80.0, 1)


def test_json_report_suggests_layouts_when_memory_does_not_fit(capsys):
    rc, out, _ = run(capsys, "--recipe", "deepseek-v3", "--nodes", "32", "--gpus-per-node", "8", "--ep", "8",
                     "--json")
    rep = json.loads(out)
    assert rc == 0 and rep["fits"] is False and rep["suggestions"]
    for sug in rep["suggestions"]:
        r = plan.with_layout(load_recipe("deepseek-v3"), sug["tp"], sug["pp"], sug["ep"])
        lay = check_layout(r, 32, 8)
        assert lay.errors == [] and (lay.dp, lay.expert_dp, lay.stage_layers) == \
            (sug["dp"], sug["expert_dp"], sug["stage_layers"])
        assert sug["memory_total"] == estimate_memory(r, lay).total <= 0.9 * 80 * GiB


def test_internode_note_counts_the_expert_group_and_names_the_proxies():
    """Megatron's EP group is EP x ETP consecutive ranks (TP is not in the expert grid): TP 8 x EP 16 on nodes
    of 8 spans 2 nodes; between nodes the tokens go through the CPU proxies (docs/internode.md)."""
    r = plan.with_layout(load_recipe("deepseek-v3"), 8, 4, 16)
    lay = check_layout(r, 8, 8)
    assert lay.errors == [] and lay.ep_nodes == 2
    note = next(n for n in lay.notes if "EP group" in n)
    assert note.startswith("each EP group spans 2 nodes: ")
    assert "between nodes through the CPU proxies" in note and "UCCL_EP_TRANSPORT" in note
    inside = plan.with_layout(load_recipe("deepseek-v3"), 8, 4, 8)
    assert not any("EP group" in n for n in check_layout(inside, 8, 8).notes)


def test_emit_torchrun_and_env(capsys):
    rc, out, _ = run(capsys, "--recipe", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--emit", "torchrun",
                     "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "29511",
                     "--torchrun", "python -m torch.distributed.run", "--", "--train-iters", "3")
    assert rc == 0
    cmd = shlex.split(out)
    assert cmd[:4] == ["python", "-m", "torch.distributed.run", "--nnodes"]
    assert cmd[cmd.index("--master-port") + 1] == "29511"
    assert cmd[-2:] == ["--train-iters", "3"]
    assert cmd[cmd.index("--expert-model-parallel-size") + 1] == "2"
    rc, out, _ = run(capsys, "--recipe", "deepseek-v3", "--nic", "thor2", "--emit", "env")
    assert rc == 0
    assert 'export UCCL_IB_MAX_INFLIGHT_NORMAL="${UCCL_IB_MAX_INFLIGHT_NORMAL:-1}"' in out.splitlines()
    assert 'export UCCL_IB_MAX_INFLIGHT_BYTES="${UCCL_IB_MAX_INFLIGHT_BYTES:-1572864}"' in out.splitlines()


def test_cli_dispatches_plan(capsys):
    from uccl_ep_train.apps.cli import main
    assert main(["plan", "--recipe", "deepseek-v2-lite", "--emit", "megatron-args"]) == 0
    out = capsys.readouterr().out
    assert "--num-experts 64" in out and "--moe-token-dispatcher-type uccl" in out
    assert main(["plan", "--recipe", "nope"]) == 2
    assert "unknown recipe" in capsys.readouterr().err


def test_check_megatron_runs_megatron_validate_args(capsys, tmp_path):
    rc, out, err = run(capsys, "--recipe", "deepseek-v2-lite", "--check-megatron", "--emit", "megatron-args")
    assert rc == 0, err
    # a recipe plan's own checks let through (fp16 and bf16 together) but Megatron-LM refuses
    bad = tmp_path / "both.json"
    r = load_recipe("tiny")
    bad.write_text(json.dumps({"name": "both", "args": dict(r.args, fp16=True, bf16=True)}))
    rc, out, err = run(capsys, "--recipe", str(bad), "--nodes", "1", "--gpus-per-node", "2")
    assert rc == 0
    rc, out, err = run(capsys, "--recipe", str(bad), "--nodes", "1", "--gpus-per-node", "2", "--check-megatron")
    assert rc == 2 and "validate_args refuses it" in err


@pytest.mark.parametrize("name, nodes, tp, ep", [("deepseek-v3", 32, 1, 256), ("deepseek-v3", 32, 2, 128),
                                                 ("deepseek-v2-lite", 2, 1, 16), ("deepseek-v2-lite", 2, 2, 8)])
def test_weight_and_optimizer_memory_agrees_with_megatron(name, nodes, tp, ep):
    """Megatron-LM's own estimator (megatron.training.theoretical_memory_usage) gives the same weights +
    gradients + optimizer bytes (its model of the most loaded shard is exact without pipelining)."""
    import contextlib
    import io

    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory
    r = plan.with_layout(load_recipe(name), tp, 1, ep)
    lay = check_layout(r, nodes, r.cluster["gpus_per_node"])
    assert lay.errors == []
    ns = r.validate_megatron(lay.world)
    ns.padded_vocab_size = plan.padded_vocab_size(r)
    with contextlib.redirect_stdout(io.StringIO()):
        megatron_bytes = compute_weight_and_optimizer_memory(ns)
    m = estimate_memory(r, lay)
    assert abs((m.weights + m.gradients + m.optimizer) - megatron_bytes) / megatron_bytes < 1e-3


def test_train_entry_takes_ep_over_all_ranks(capsys):
    rc, out, err = run(capsys, "--recipe", "tiny", "--nodes", "1", "--gpus-per-node", "8", "--entry", "train", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["layout"]["ep"] == 8 and rep["layout"]["dp"] == 8
    assert rep["torchrun"][-3:] == ["train", "--recipe", "tiny"]
    # the same shape for Megatron-LM's pretrain_gpt keeps the recipe's EP 2 and refuses its batch size
    rc, out, err = run(capsys, "--recipe", "tiny", "--nodes", "1", "--gpus-per-node", "8")
    assert rc == 2 and "global_batch_size 8 is not divisible by micro_batch_size*DP = 2*8" in err


ACTIVATIONS_MEASURED = '''
import sys, warnings
warnings.filterwarnings("ignore")
import torch
import megatron_patch
megatron_patch.apply()   # CPU stand-ins for megatron-core's CUDA streams
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from uccl_ep_train.apps.plan import check_layout, estimate_memory
from uccl_ep_train.apps.recipes import load_recipe
from uccl_ep_train.apps.recipes.model import _model_parallel_world
r = load_recipe("tiny").with_args(hidden_size=256, num_attention_heads=4, kv_channels=64, ffn_hidden_size=1024,
    moe_ffn_hidden_size=256, moe_shared_expert_intermediate_size=256, num_layers=2, moe_layer_freq="([0]+[1])",
    seq_length=128, max_position_embeddings=128, micro_batch_size=2, global_batch_size=2,
    expert_model_parallel_size=1)
s, b, vocab = 128, 2, r.args["vocab_size"]
with _model_parallel_world():
    model_parallel_cuda_manual_seed(0)
    cfg = r.transformer_config(moe_token_dispatcher_type="alltoall", use_cpu_initialization=True)
    model = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False), vocab_size=vocab,
                     max_sequence_length=s, position_embedding_type="rope", share_embeddings_and_output_weights=False)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, scores = {}, {}
    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in saved:
            saved[key] = t.untyped_storage().nbytes()
            if t.dim() >= 2 and t.shape[-1] == t.shape[-2] == s:   # [.., s, s]: what flash attention avoids
                scores[key] = saved[key]
        return t
    tokens = torch.randint(0, vocab, (b, s))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, torch.arange(s).expand(b, s), None, labels=torch.randint(0, vocab, (b, s)))
measured = sum(saved.values()) - sum(scores.values())
print("RATIO", estimate_memory(r, check_layout(r, 1, 1)).activations / measured)
'''


def test_activation_estimate_matches_what_megatron_saves_for_backward():
    """The activation term against the tensors megatron-core's GPTModel actually saves for backward (one
    rank, CPU, fp32, no recompute; the [s, s] attention matrices left out as flash attention keeps none)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    res = subprocess.run([sys.executable, "-c", ACTIVATIONS_MEASURED], cwd=root, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(root), "PYTHONWARNINGS": "ignore"})
    assert res.returncode == 0, res.stderr[-3000:]
    ratio = float(res.stdout.split("RATIO")[-1])
    assert 0.75 < ratio < 1.25, ratio


def test_ep_group_beyond_the_native_limits_is_refused_naming_the_limit(capsys, tmp_path):
    """The native kernels take at most MAX_NODES (32) nodes and MAX_RANKS_PER_NODE (8) ranks of one EP group
    per node (uccl_ep_train.topology): EP 512 over 64 nodes of 8 and EP 16 inside a node of 16 GPUs are
    refused, naming the limit; EP 256 over 32 nodes of 8 is the largest group on nodes of 8."""
    from uccl_ep_train.topology import MAX_NODES, MAX_RANKS_PER_NODE
    assert (MAX_NODES, MAX_RANKS_PER_NODE) == (32, 8)
    v3 = load_recipe("deepseek-v3").with_args(num_experts=512)
    wide = check_layout(plan.with_layout(v3, 1, 1, 512), 64, 8)
    assert wide.ep_nodes == 64
    assert [e for e in wide.errors if "nodes per EP group" in e] == [
        "each EP group spans 64 nodes (EP 512 x ETP 1 / 8 GPUs per node); UCCL-EP's internode kernels take at "
        "most 32 nodes per EP group (MAX_NODES): EP x ETP <= 256"]
    assert check_layout(plan.with_layout(v3, 1, 1, 256), 64, 8).errors == []
    assert check_layout(plan.with_layout(v3, 1, 2, 256), 64, 8).errors == []
    dense = check_layout(plan.with_layout(load_recipe("deepseek-v3"), 1, 8, 16), 16, 16)
    assert any("puts 16 of its ranks on one node" in e and "at most 8 ranks of a group per node" in e
               for e in dense.errors), dense.errors
    assert check_layout(plan.with_layout(load_recipe("deepseek-v3"), 1, 8, 8), 16, 16).errors == []
    # the command line says so too (a recipe file with 512 experts)
    recipe_file = tmp_path / "v3_512.json"
    recipe_file.write_text(json.dumps({"name": "v3-512", "args": dict(v3.args), "cluster": {"nodes": 64,
                                                                                             "gpus_per_node": 8}}))
    rc, out, err = run(capsys, "--recipe", str(recipe_file), "--nodes", "64", "--gpus-per-node", "8",
                       "--pp", "1", "--ep", "512", "--gpu-mem-gib", "141")
    assert rc == 2 and out == "" and "most 32 nodes per EP group (MAX_NODES)" in err


def test_ep_group_with_uneven_ranks_per_node_is_refused():
    """An EP group of 12 consecutive ranks on nodes of 8 holds 8 ranks on one node and 4 on the next: the
    native backends refuse such a group at Buffer creation (ranks per node must be equal), so plan does too;
    12 on nodes of 6, and 4 or 16 on nodes of 8, are fine."""
    v3 = load_recipe("deepseek-v3").with_args(num_experts=384)
    uneven = check_layout(plan.with_layout(v3, 1, 2, 12), 3, 8)
    assert [e for e in uneven.errors if "as many on every node" in e] == [
        "each EP group (EP 12 x ETP 1 = 12 consecutive ranks) holds different numbers of its ranks on the nodes "
        "it spans (8 GPUs per node); UCCL-EP needs as many on every node (ranks per node of a group): make EP x "
        "ETP a divisor or a multiple of 8"], uneven.errors
    assert not any("as many on every node" in e for e in check_layout(plan.with_layout(v3, 1, 2, 12), 4, 6).errors)
    for ep, nodes in ((4, 1), (16, 4)):
        assert not any("as many on every node" in e
                       for e in check_layout(plan.with_layout(v3, 1, 2, ep), nodes, 8).errors), ep
    layouts = [lay for _, lay, _ in plan.valid_layouts(v3, 3, 8)]
    assert layouts and all(lay.ep * lay.etp % 8 == 0 or 8 % (lay.ep * lay.etp) == 0 for lay in layouts)


def test_layouts_proposed_for_a_big_cluster_stay_inside_the_native_limits():
    """On 128 nodes of 8, no valid or suggested layout has an EP group over more than 32 nodes or more than
    8 of its ranks on a node, though the recipe's 512 experts would allow EP 512 and 1024 ranks EP 1024."""
    v3 = load_recipe("deepseek-v3").with_args(num_experts=512)
    found = plan.valid_layouts(v3, 128, 8)
    assert found and max(lay.ep for _, lay, _ in found) == 256
    for _, lay, _ in found:
        assert lay.ep * lay.etp <= 32 * 8
    assert all(lay.ep * lay.etp <= 256 for _, lay, _ in plan.suggest_layouts(v3, 128, 8, 1e6, 100))
    # nodes of 16 GPUs: an EP group never holds more than 8 ranks of one node
    for _, lay, _ in plan.valid_layouts(load_recipe("deepseek-v3"), 32, 16):
        assert min(lay.ep * lay.etp, 16) // lay.etp <= 8 and lay.ep * lay.etp <= 32 * 16


def test_backends_check_the_built_module_against_the_shared_limits():
    """The backends read a limit from the native module through topology.native_limit, which refuses a module
    whose limit differs from the constant plan checks with; the built module (when present) agrees."""
    from types import SimpleNamespace

    from uccl_ep_train.topology import MAX_NODES, MAX_RANKS_PER_NODE, native_limit
    assert native_limit(SimpleNamespace(INTERNODE_MAX_NODES=32), "INTERNODE_MAX_NODES", MAX_NODES) == 32
    with pytest.raises(RuntimeError, match="INTERNODE_MAX_NODES = 64 but uccl_ep_train.topology says 32"):
        native_limit(SimpleNamespace(INTERNODE_MAX_NODES=64), "INTERNODE_MAX_NODES", MAX_NODES)
    try:
        from uccl_ep_train import _native
    except ImportError:
        pytest.skip("native module not built")
    for name, shared in (("INTERNODE_MAX_NODES", MAX_NODES), ("INTERNODE_MAX_LOCAL", MAX_RANKS_PER_NODE),
                         ("INTRANODE_MAX_RANKS", MAX_RANKS_PER_NODE), ("LL_MAX_LOCAL", MAX_RANKS_PER_NODE)):
        if hasattr(_native, name):
            assert native_limit(_native, name, shared) == shared


needs_layouts = pytest.mark.skipif(not plan.sizing.layouts_available(), reason="native module not built")


@needs_layouts
def test_ep_buffer_modes_one_node(capsys):
    """One node (EP 8): each mode's bytes are what the backends' sizing gives for the shape: the dispatcher's
    Buffer (DeepEP's config hints), grown for a uniformly routed step, the receive budget's bound, the worst case
    and the LL hint; the memory estimate counts the eager step."""
    from uccl_ep_train import Buffer, sizing

    argv = ["--recipe", "deepseek-v3", "--nodes", "16", "--gpus-per-node", "8", "--ep", "8", "--pp", "16",
            "--gpu-mem-gib", "1000", "--capacity-factor", "0.5"]
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    rep = json.loads(out)
    shape = rep["ep_shape"]
    assert shape == {"hidden": 7168, "topk": 8, "experts": 256, "tokens": 4096, "ranks": 8, "ranks_per_node": 8,
                     "element_bytes": 2}
    modes = {m["mode"]: m for m in rep["ep_buffer_modes"]}
    assert list(modes) == ["eager start", "eager step", "static budget", "worst case", "low-latency"]
    hb, T, k = 7168 * 2, 4096, 8
    start = max(Buffer.get_dispatch_config(8).get_nvl_buffer_size_hint(hb, 8),
                Buffer.get_combine_config(8).get_nvl_buffer_size_hint(hb, 8), 32 << 20)
    assert modes["eager start"]["nvl_bytes"] == start and modes["eager start"]["rdma_bytes"] == 0
    step = modes["eager step"]
    assert step["nvl_bytes"] >= start and step["out_rows"] == T * k
    assert sizing.intranode_row_capacity(step["nvl_bytes"], hb, 0, k, True) >= sizing.typical_rows(T, k, 256, 8)
    # the budget: 0.5 x 4096 tokens x top-8 = 16384 rows per rank, 64 per (local expert, source rank) block;
    # a source sends a rank at most 32 experts x 64 = 2048 tokens: 8 x 2048 rows, not every token of every rank
    static, worst = modes["static budget"], modes["worst case"]
    assert static["out_rows"] == 32 * 8 * 64 and "capacity 64" in static["note"]
    assert sizing.intranode_row_capacity(static["nvl_bytes"], hb, 0, k, True) >= 8 * 2048
    assert static["nvl_bytes"] < worst["nvl_bytes"]
    assert sizing.intranode_row_capacity(worst["nvl_bytes"], hb, 0, k, True) >= 8 * T
    assert modes["low-latency"]["rdma_bytes"] == Buffer.get_low_latency_rdma_size_hint(T, 7168, 8, 256)
    assert rep["memory"]["ep_buffers"] == step["nvl_bytes"]
    rc, out, _ = run(capsys, *argv)
    assert rc == 0
    assert "EP buffers per rank by mode (4096 tokens x hidden 7168 x 2 bytes, top-8 of 256 experts, EP 8, 8 per node):" in out
    lines = out.splitlines()
    head = lines.index("  mode                NVLink        RDMA       total     outputs  rows out")
    assert [ln.split()[0] for ln in lines[head + 1:head + 6]] == ["eager", "eager", "static", "worst", "low-latency"]
    assert lines[head + 4].startswith("  worst case ") and "32768: num_worst_tokens=32768" in lines[head + 4]


@needs_layouts
def test_ep_buffer_modes_across_nodes(capsys, monkeypatch):
    """EP 32 over 4 nodes: the worst case is what get_rdma_buffer_size_hint(num_tokens=...) reserves, the eager
    step the internode layout of a uniformly routed step, grown from the 32 MiB the backend opens with."""
    from uccl_ep_train import sizing
    from uccl_ep_train.config import Config

    rc, out, err = run(capsys, "--recipe", "deepseek-v3", "--nodes", "32", "--gpus-per-node", "8", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    modes = {m["mode"]: m for m in rep["ep_buffer_modes"]}
    hb, T, k, R, L = 7168 * 2, 4096, 8, 32, 8
    monkeypatch.setenv("UCCL_EP_RANKS_PER_NODE", str(L))
    assert modes["worst case"]["rdma_bytes"] == Config().get_rdma_buffer_size_hint(hb, R, num_tokens=T, num_topk=k)
    assert modes["eager start"]["rdma_bytes"] == 32 << 20
    rd = [sizing.typical_node_tokens(T, k, 256, R // L)] * (R * R // L)
    need_rdma, need_nvl = sizing.internode_need(rd, R, L, hb, 0, k, hb, sizing.typical_rows(T, k, 256, R))
    step = modes["eager step"]
    assert need_rdma <= step["rdma_bytes"] < need_rdma + need_rdma // 8 + (64 << 20)
    assert need_nvl <= step["nvl_bytes"] < need_nvl + need_nvl // 8 + (64 << 20)
    # uniform routing sends nearly every token to every node (top-8 of 256 over 4 nodes: 97 %): the RDMA need
    # is close to the worst case's (growing's margin can even pass it); the NVL receive rows are far below
    assert need_rdma <= modes["worst case"]["rdma_bytes"]
    assert step["nvl_bytes"] < modes["worst case"]["nvl_bytes"]
    assert rep["memory"]["ep_buffers"] == step["nvl_bytes"] + step["rdma_bytes"]


def test_ep_buffer_table_without_the_native_module(capsys, monkeypatch):
    """Without the native module's layouts the table says what to build, and the estimate counts the Buffer
    the dispatcher opens (DeepEP's config hints, which need no native module)."""
    from uccl_ep_train.config import default_nvl_bytes

    monkeypatch.setattr(plan.sizing, "layouts_available", lambda: False)
    rc, out, _ = run(capsys, "--recipe", "tiny", "--nodes", "1", "--gpus-per-node", "2")
    assert rc == 0
    assert "(needs the native module uccl_ep_train._native, any build" in out
    lay = check_layout(load_recipe("tiny"), 1, 2)
    assert estimate_memory(load_recipe("tiny"), lay).ep_buffers == default_nvl_bytes(64 * 4, 2)


@pytest.mark.parametrize("flag", ["--tokens-per-rank", "--capacity-factor"])
def test_ep_buffer_table_options_must_be_positive(capsys, flag):
    rc, _, err = run(capsys, "--recipe", "tiny", "--nodes", "1", "--gpus-per-node", "2", flag, "0")
    assert rc == 2 and f"{flag} must be > 0, got 0" in err
