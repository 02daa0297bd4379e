"""Primus integration: the experiment YAML selects uccl; our patches, run in the order Primus runs its phases
(build_args, setup, before_train) by a registry that behaves like Primus's, put Megatron's arguments on uccl,
and a refused configuration stops the launch; Primus-Turbo's DeepEP path runs on our Buffer (as UCCL_EP, or
as DEEP_EP through our deep_ep). Primus and Primus-Turbo are stood in for by tests/primus_stub; with
PRIMUS_PATH pointing at an AMD-AGI/Primus checkout, Primus's own runtime runs our patches too."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import megatron_patch
from megatron_patch import primus as hook
from uccl_ep_train.compat import primus_turbo as turbo_backend
from uccl_ep_train.apps.launch import free_loopback_port
from uccl_ep_train.apps.recipes import load_recipe

from dist_utils import run_ranks

ROOT = Path(__file__).resolve().parent.parent
YAML = ROOT / "recipes" / "primus" / "deepseek_v3.yaml"
STUB = Path(__file__).resolve().parent / "primus_stub"


@pytest.fixture
def overrides():
    return hook.module_overrides(hook.load_yaml(str(YAML), environ={}))


def test_yaml_selects_uccl_and_not_turbo_deepep(overrides):
    assert hook.uccl_selected(overrides)
    assert overrides["moe_token_dispatcher_type"] == "uccl" and overrides["use_uccl_ep"] is True
    assert overrides["use_turbo_deepep"] is False and overrides["moe_enable_deepep"] is False
    hook.check_params(overrides)  # no conflict
    cfg = hook.load_yaml(str(YAML), environ={})
    assert cfg["modules"]["pre_trainer"]["framework"] == "megatron"
    assert cfg["modules"]["pre_trainer"]["model"] == "deepseek_v3.yaml"


@pytest.mark.parametrize("recipe, yaml_name", [("deepseek-v3", "deepseek_v3.yaml"),
                                               ("deepseek-v2-lite", "deepseek_v2_lite.yaml")])
def test_yaml_matches_its_recipe_and_selects_uccl(recipe, yaml_name):
    cfg = hook.load_yaml(str(YAML.parent / yaml_name), environ={})
    overrides = hook.module_overrides(cfg)
    assert cfg["modules"]["pre_trainer"]["model"] == yaml_name   # Primus's preset of the same model
    assert hook.uccl_selected(overrides) and overrides["use_turbo_deepep"] is False
    args = load_recipe(recipe).args
    shared = [k for k in overrides if k in args]
    assert len(shared) >= 20
    for k in shared:
        assert overrides[k] == args[k], k
    for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
              "global_batch_size", "moe_token_dispatcher_type"):
        assert k in shared, k
    if recipe == "deepseek-v3":
        assert overrides["decoder_first_pipeline_num_layers"] == 7 and overrides["mtp_num_layers"] is None


@pytest.mark.parametrize("yaml_name", ["deepseek_v3.yaml", "deepseek_v2_lite.yaml"])
def test_every_override_key_is_known(yaml_name):
    """Primus's arg builder silently drops keys Megatron-LM does not know: a misspelt key would vanish."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments
    megatron = {a.dest for a in add_megatron_arguments(argparse.ArgumentParser())._actions}
    ours = {"use_uccl_ep", "uccl_ep_env", *hook.SETTING_KEYS}
    primus_own = {"use_turbo_deepep"}
    overrides = hook.module_overrides(hook.load_yaml(str(YAML.parent / yaml_name), environ={}))
    unknown = sorted(set(overrides) - megatron - ours - primus_own)
    assert unknown == []


def test_primus_env_references_resolve(monkeypatch):
    cfg = hook.load_yaml(str(YAML), environ={"UCCL_EP_NUM_SMS": "16", "PRIMUS_EXP_NAME": "x"})
    ov = hook.module_overrides(cfg)
    assert ov["uccl_ep_num_sms"] == 16 and cfg["exp_name"] == "x"
    assert hook.module_overrides(hook.load_yaml(str(YAML), environ={}))["uccl_ep_num_sms"] == 24
    assert ov["train_data_path"] is None


def test_mini_yaml_parser():
    data = hook._mini_yaml("a: 1\nb:\n  c: 'x # y'  # comment\n  d: 2.5e-4\n  e: null\nf: true\n")
    assert data == {"a": 1, "b": {"c": "x # y", "d": 2.5e-4, "e": None}, "f": True}
    with pytest.raises(ValueError, match="line 2"):
        hook._mini_yaml("a:\n  - 1\n")



# ---------------------------------------------------------------------------------------------------------
# our patches under a Primus-like registry and runtime (tests/primus_stub), in this process
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def stub_primus(monkeypatch):
    """The stand-in of Primus importable as `primus`, our patches registered with it (through the hook's
    own import of primus.core.patches), megatron_patch.apply() recorded instead of run, env restored."""
    monkeypatch.syspath_prepend(str(STUB))
    before = {n for n in sys.modules if n == "primus" or n.startswith("primus.")}
    assert not before, f"a real Primus is imported in this process: {sorted(before)}"
    import primus.cli.main as cli
    import primus.core.patches as registry
    monkeypatch.setattr(hook, "_registered", False)
    assert hook.register() == list(hook.PATCH_IDS)
    applied = []
    monkeypatch.setattr(megatron_patch, "apply", lambda: applied.append(True))
    saved = dict(os.environ)        # the build_args patch exports variables: keep them out of other tests
    for k in [k for k in os.environ if k.startswith("UCCL_") or k == "NCCL_MAX_NCHANNELS"]:
        del os.environ[k]
    yield SimpleNamespace(registry=registry, train=cli.train, applied=applied)
    os.environ.clear()
    os.environ.update(saved)
    for name in [n for n in sys.modules if n == "primus" or n.startswith("primus.")]:
        del sys.modules[name]


def test_patches_run_in_primus_phase_order_and_select_uccl(stub_primus, overrides, monkeypatch):
    from megatron_patch import settings
    monkeypatch.setattr(settings, "num_sms", None)
    # a stale DeepEP switch in the experiment must not survive into Megatron's arguments
    got = stub_primus.train(dict(overrides, moe_enable_deepep=True))
    assert got["applied"] == [["build_args", "uccl_ep.build_args"], ["before_train", "uccl_ep.before_train"]]
    assert (got["dispatcher"], got["deepep"]) == ("uccl", False)
    assert stub_primus.applied == [True]                         # megatron_patch.apply() registered uccl
    assert os.environ["UCCL_IB_MAX_INFLIGHT_NORMAL"] == "8"
    assert settings.num_sms == 24
    assert os.environ["UCCL_EP_BACKEND"] == "auto" and os.environ["UCCL_EP_TIMEOUT_S"] == "300"


def test_no_patch_between_the_phases_leaves_training_on_another_dispatcher(stub_primus, overrides):
    """Patches of later phases (setup; before_train at 95, the highest number Primus's own use) switch the
    dispatcher to alltoall: ours, which runs last in before_train, restores uccl."""
    def to_alltoall(ctx):
        ctx.extra["backend_args"].moe_token_dispatcher_type = "alltoall"
    for phase, priority in (("setup", 50), ("before_train", 95)):
        stub_primus.registry.register_patch(f"other.{phase}", backend="megatron", phase=phase,
                                            priority=priority)(to_alltoall)
    got = stub_primus.train(overrides)
    assert got["dispatcher"] == "uccl"
    assert got["applied"][-2:] == [["before_train", "other.before_train"], ["before_train", "uccl_ep.before_train"]]


def test_patches_are_inert_without_uccl(stub_primus):
    got = stub_primus.train({"moe_token_dispatcher_type": "flex", "moe_enable_deepep": True,
                             "use_turbo_deepep": True, "turbo_sync_free_moe_stage": 2})
    assert (got["dispatcher"], got["deepep"], got["applied"]) == ("flex", True, [])
    assert stub_primus.applied == []


@pytest.mark.parametrize("setting, named", [
    ({"use_turbo_deepep": True}, "use_turbo_deepep: true"),
    ({"turbo_sync_free_moe_stage": 2}, "turbo_sync_free_moe_stage: 2 turns use_turbo_deepep on"),
    ({"turbo_sync_free_moe_stage": 3}, "turbo_sync_free_moe_stage: 3 turns use_turbo_deepep on"),
    ({"moe_token_dispatcher_type": "flex"}, "moe_token_dispatcher_type: flex"),
])
def test_a_refused_configuration_stops_a_launch_whose_runner_goes_on_after_errors(stub_primus, overrides,
                                                                                  setting, named):
    """The stand-in's run_patches, like Primus's, logs an Exception from a patch and goes on: the refusal
    must still stop the launch, before anything else of ours ran, saying what to set instead."""
    with pytest.raises(SystemExit, match=named) as stop:
        stub_primus.train(dict(overrides, **setting))
    assert stub_primus.applied == []
    if "turbo" in named:
        assert f"PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND={turbo_backend.BACKEND_NAME}" in str(stop.value)


def test_sync_free_stage_one_keeps_uccl(stub_primus, overrides):
    """Stage 1 fuses the router and permutation only; DeepEP comes with stage 2."""
    assert stub_primus.train(dict(overrides, turbo_sync_free_moe_stage=1))["dispatcher"] == "uccl"


def test_a_failed_import_stops_the_launch_too(stub_primus, overrides, monkeypatch):
    def no_megatron():
        raise ImportError("No module named 'megatron'")
    monkeypatch.setattr(megatron_patch, "apply", no_megatron)
    with pytest.raises(SystemExit, match="patch_build_args stopped the launch: No module named 'megatron'"):
        stub_primus.train(overrides)


def test_register_uses_primus_registry_once(stub_primus):
    """With Primus importable, `register()` uses primus.core.patches.register_patch, once, in phase order."""
    registry = stub_primus.registry.PATCHES
    assert [(p[0], p[2]) for p in registry] == [("uccl_ep.build_args", "build_args"),
                                                 ("uccl_ep.before_train", "before_train")]
    assert hook.register() == list(hook.PATCH_IDS)
    assert len(registry) == 2
    assert registry[1][4] == hook.LAST > 95     # after Primus's own before_train patches


def test_pure_checks_name_the_conflicting_key():
    hook.check_params(SimpleNamespace(use_uccl_ep=True, moe_token_dispatcher_type="alltoall"))
    with pytest.raises(ValueError, match="moe_token_dispatcher_type: flex"):
        hook.check_params(SimpleNamespace(use_uccl_ep=True, moe_token_dispatcher_type="flex"))
    with pytest.raises(TypeError, match="uccl_ep_env must be a mapping"):
        hook.check_params({"use_uccl_ep": True, "uccl_ep_env": ["UCCL_IB_GID_INDEX=3"]})
    with pytest.raises(ValueError, match="environment variable name"):
        hook.export_env(SimpleNamespace(uccl_ep_env={"BAD NAME": 1}), environ={})


def test_cli_without_primus_says_how_to_get_it():
    res = subprocess.run([sys.executable, "-m", "megatron_patch.primus", "train", "pretrain", "--config", str(YAML)],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "Primus is not importable" in res.stderr


def test_real_apply_lets_megatron_take_uccl_from_the_primus_config():
    """The build_args patch's megatron_patch.apply() makes Megatron-LM's parser (which Primus builds its
    arguments from) accept the YAML's dispatcher; run in a fresh process (apply() patches megatron)."""
    code = f"""
import argparse, sys
from types import SimpleNamespace
sys.path.insert(0, {str(ROOT)!r})
from megatron_patch import primus as hook
ov = hook.module_overrides(hook.load_yaml({str(YAML)!r}, environ={{}}))
ctx = SimpleNamespace(extra={{"module_config": SimpleNamespace(params=SimpleNamespace(**ov)), "backend_args": None}})
hook.patch_build_args(ctx)
from megatron.training.arguments import add_megatron_arguments
p = add_megatron_arguments(argparse.ArgumentParser())
ns = p.parse_args(["--moe-token-dispatcher-type", ov["moe_token_dispatcher_type"]])
print("DISPATCHER", ns.moe_token_dispatcher_type)
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "DISPATCHER uccl" in res.stdout


# ---------------------------------------------------------------------------------------------------------
# launch: torchrun starts one process per rank, through the module or through the file (primus-cli --script)
# ---------------------------------------------------------------------------------------------------------
def _torchrun(target: list[str], config: Path, cwd: Path, pythonpath: str,
              monitor_s: float = 0.1) -> subprocess.CompletedProcess:
    """2 ranks on this machine, rendezvous on 127.0.0.1, the stand-in of Primus importable. monitor_s: how
    often torchrun looks at its ranks (it stops the others at the first failure it sees)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--monitor-interval", str(monitor_s), "--master-addr", "127.0.0.1",
           "--master-port", str(free_loopback_port()),
           *target, "train", "pretrain", "--config", str(config)]
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def _results(stdout: str) -> list[dict]:
    rows = [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("PRIMUS_STUB ")]
    return sorted(rows, key=lambda r: r["rank"])


@pytest.mark.parametrize("form", ["module", "file"])
def test_torchrun_starts_every_rank_through_the_hook(form, tmp_path):
    """`torchrun -m megatron_patch.primus ...`, and the file run as a script the way `primus-cli direct
    --script <file>` runs it (from another folder, megatron_patch not on PYTHONPATH: absolute imports and
    the path fix let the file find its package, and keep it from standing in for `primus`)."""
    if form == "module":
        res = _torchrun(["-m", "megatron_patch.primus"], YAML, ROOT, os.pathsep.join((str(STUB), str(ROOT))))
    else:
        res = _torchrun([str(ROOT / "megatron_patch" / "primus.py")], YAML, tmp_path, str(STUB))
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    got = _results(res.stdout)
    assert [r["rank"] for r in got] == [0, 1]
    for r in got:
        assert (r["dispatcher"], r["deepep"]) == ("uccl", False)
        assert r["applied"] == [["build_args", "uccl_ep.build_args"], ["before_train", "uccl_ep.before_train"]]


def test_torchrun_launch_of_a_refused_configuration_fails_on_every_rank(tmp_path):
    """Each rank refuses on its own. torchrun looks at its ranks every 5 s here, not every 0.1 s: it stops
    the others once it sees one fail, and on a loaded 2-core host the second rank's refusal came after that
    (one CI run saw one message, the other rank stopped by torchrun's SIGTERM)."""
    config = tmp_path / "turbo.yaml"
    config.write_text(YAML.read_text().replace("use_turbo_deepep: false", "use_turbo_deepep: true"))
    res = _torchrun(["-m", "megatron_patch.primus"], config, ROOT, os.pathsep.join((str(STUB), str(ROOT))),
                    monitor_s=5.0)
    assert res.returncode != 0
    assert _results(res.stdout) == []
    assert res.stderr.count("Training execution failed: megatron_patch.primus: patch_build_args stopped the "
                            "launch: Primus config: use_turbo_deepep: true") == 2, res.stderr[-4000:]


# ---------------------------------------------------------------------------------------------------------
# with a real Primus checkout: Primus's own runtime drives the phases
# ---------------------------------------------------------------------------------------------------------
REAL_PRIMUS = """
import json, sys
from types import SimpleNamespace
try:
    from primus.backends.megatron.argument_builder import MegatronArgBuilder
    import primus.core.runtime.train_runtime as runtime_module
    from primus.core.runtime.train_runtime import PrimusRuntime, TrainContext
    from primus.core.utils.yaml_utils import dict_to_nested_namespace
except ImportError:
    sys.exit(3)
import megatron_patch.primus as hook      # importing registers the patches with Primus

phases = []
run_patches = runtime_module.run_patches
def counting(**kw):
    phases.append([kw["phase"], run_patches(**kw)])
    return phases[-1][1]
runtime_module.run_patches = counting

class Adapter:          # Primus's Megatron adapter, less the backend checkout: its argument builder
    def prepare_backend(self, module_config): pass
    def convert_config(self, params): return MegatronArgBuilder().update(params).finalize()
    def load_trainer_class(self, stage="pretrain", **kw): return Trainer
    def detect_backend_version(self): return None

class Trainer:          # records what training gets
    seen = None
    def __init__(self, backend_args, **kw): self.args = backend_args
    def setup(self): pass
    def init(self): pass
    def train(self): Trainer.seen = [self.args.moe_token_dispatcher_type, self.args.moe_enable_deepep]
    def cleanup(self, on_error=False): pass

def launch(overrides):
    phases.clear()
    runtime = PrimusRuntime(SimpleNamespace())
    module_config = SimpleNamespace(params=dict_to_nested_namespace(overrides), model=None, framework="megatron")
    runtime.ctx = TrainContext(config_path=None, data_path=None, module_name="pre_trainer", primus_config=None,
                               module_config=module_config, framework="megatron", adapter=Adapter())
    try:
        runtime._initialize_trainer()         # convert, build_args, merge, the trainer
        runtime._run_trainer_lifecycle()      # setup, trainer setup/init, before_train, train, after_train
    except SystemExit as e:
        return {"stopped": str(e), "phases": list(phases)}
    return {"train": Trainer.seen, "phases": list(phases)}

ov = hook.module_overrides(hook.load_yaml(sys.argv[1], environ={}))
print("RESULT", json.dumps({"uccl": launch(dict(ov, moe_enable_deepep=True)),
                            "turbo": launch(dict(ov, use_turbo_deepep=True)),
                            "sync_free": launch(dict(ov, turbo_sync_free_moe_stage=2)),
                            "off": launch({"moe_token_dispatcher_type": "alltoall"})}))
"""


def test_with_primus_own_runtime():
    """With PRIMUS_PATH pointing at an AMD-AGI/Primus checkout (or Primus installed), Primus's PrimusRuntime
    runs its phases over our patches (its own patches are left out with PRIMUS_PATCHES: they need a GPU
    Megatron setup): uccl reaches training, and a refused configuration stops it at the first phase although
    Primus's run_patches carries on after a patch's Exception."""
    path = os.pathsep.join(p for p in (os.environ.get("PRIMUS_PATH"), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore", "PRIMUS_PATCHES": ",".join(hook.PATCH_IDS)}
    res = subprocess.run([sys.executable, "-c", REAL_PRIMUS, str(YAML)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env)
    if res.returncode == 3:
        pytest.skip("Primus is not importable (set PRIMUS_PATH to an AMD-AGI/Primus checkout)")
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.split("RESULT ", 1)[1])
    order = [["build_args", 1], ["setup", 0], ["before_train", 1], ["after_train", 0]]
    assert got["uccl"] == {"train": ["uccl", False], "phases": order}
    for case, key in (("turbo", "use_turbo_deepep: true"), ("sync_free", "turbo_sync_free_moe_stage: 2")):
        assert key in got[case]["stopped"] and got[case]["phases"] == [], got[case]
    assert got["off"] == {"train": ["alltoall", False], "phases": [[p, 0] for p, _ in order]}


# ---------------------------------------------------------------------------------------------------------
# Primus-Turbo's DeepEP dispatcher on our Buffer: as UCCL_EP (registered), or as DEEP_EP (our deep_ep)
# ---------------------------------------------------------------------------------------------------------
def test_importing_the_hook_registers_the_backend_where_primus_turbo_is():
    assert turbo_backend.register() is False                     # no Primus-Turbo in this environment
    code = ("import megatron_patch.primus\n"
            "from primus_turbo.pytorch.kernels.moe.moe_dispatch_combine_impl import _REGISTRY\n"
            "print(sorted((k, v.__module__ + '.' + v.__name__) for k, v in _REGISTRY.items()))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join((str(STUB), str(ROOT)))})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == str([("DEEP_EP", "primus_turbo.pytorch.kernels.moe.moe_dispatch_combine_impl."
                                                  "DeepEPRoute"),
                                      ("UCCL_EP", "uccl_ep_train.compat.primus_turbo.UcclEPBackend")])


def _turbo_route(rank: int, world: int, device: str, name: str) -> dict:
    """Primus-Turbo's calls, in its order: dispatch (forward), combine (forward), the cached dispatch of the
    combine's backward, the weighted combine of the dispatch's backward, and a worst-case sized dispatch."""
    import torch
    import torch.distributed as dist
    sys.path.insert(0, str(STUB))
    os.environ["PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND"] = name.lower()   # Primus-Turbo upper-cases it
    from uccl_ep_train.compat import install_deep_ep
    install_deep_ep(patch_megatron=False)          # `import deep_ep` finds ours (docs/deep_ep.md)
    from primus_turbo.pytorch.kernels.moe import moe_dispatch_combine_impl as turbo
    assert turbo_backend.register()                # what importing megatron_patch.primus does

    turbo.set_buffer_global_config(num_use_cu=8)
    group = dist.group.WORLD
    tokens, hidden, experts, topk = 6, 16, 4, 2
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=gen)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    idx[0, 1] = -1
    w = torch.rand(tokens, topk, generator=gen).masked_fill(idx < 0, 0)
    dest_ranks = torch.stack([(idx // (experts // world) == r).any(1) for r in range(world)], 1).sum(1)

    recv_x, recv_idx, recv_w, per_expert, handle = turbo.moe_dispatch_impl(
        x, group, None, topk_idx=idx, token_weights=w, num_experts=experts, async_finish=True,
        allocate_on_comm_stream=True)
    assert sum(per_expert) == int((recv_idx >= 0).sum())
    back, _ = turbo.moe_combine_impl(recv_x, group, handle, async_finish=True, allocate_on_comm_stream=True)
    assert torch.allclose(back, x * dest_ranks[:, None], atol=1e-6)
    again = turbo.moe_dispatch_impl(x, group, handle, async_finish=True)[0]
    assert torch.equal(again, recv_x)
    _, grad_w = turbo.moe_combine_impl(recv_x, group, handle, topk_weights=recv_w)
    assert torch.allclose(grad_w, w)            # each expert lives on one rank: every weight comes back once
    worst = tokens * world
    padded_x, _, _, _, padded_handle = turbo.moe_dispatch_impl(x, group, None, topk_idx=idx, token_weights=w,
                                                               num_experts=experts, num_worst_tokens=worst)
    assert padded_x.size(0) == worst
    assert torch.allclose(turbo.moe_combine_impl(padded_x, group, padded_handle)[0], back, atol=1e-6)
    backend = turbo.backend()
    return {"backend": type(backend).__name__, "buffer": type(backend._buffer).__module__}


@pytest.mark.parametrize("name, backend", [("UCCL_EP", "UcclEPBackend"), ("DEEP_EP", "DeepEPRoute")])
def test_primus_turbo_dispatch_and_combine_on_our_buffer(name, backend):
    """2 CPU ranks (gloo): UCCL_EP is ours, registered by the hook; DEEP_EP is Primus-Turbo's own backend
    on `deep_ep`, which our deep_ep serves (what USING_UEP=1 selects)."""
    for got in run_ranks(_turbo_route, 2, name):
        assert got == {"backend": backend, "buffer": "uccl_ep_train.buffer"}


# ---------------------------------------------------------------------------------------------------------
# primus-cli's USING_UEP=1 route: its hook's checks, our deep_ep installed as the `deep_ep` distribution
# ---------------------------------------------------------------------------------------------------------
# What runner/helpers/hooks/05_using_uep.sh of AMD-AGI/Primus (at fd1eeab, v26.5.1) checks and exports under
# USING_UEP=1, verbatim; the test runs the real script instead when PRIMUS_PATH holds a Primus checkout.
HOOK_EXCERPT = r'''set -euo pipefail
if [[ "${USING_UEP:-0}" == "1" ]]; then
    if ! python3 -m pip show uccl &>/dev/null || ! python3 -m pip show deep_ep &>/dev/null; then
        LOG_ERROR "uccl is not installed! Please use pre-installed primus image or set REBUILD_UEP=1."
        exit 1
    fi
    LOG_INFO "uccl package is installed: $(python3 -m pip show uccl | grep Version)"
    LOG_INFO "deep_ep package is installed: $(python3 -m pip show deep_ep | grep Version)"

    echo "env.PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND=DEEP_EP"
fi
'''


def _real_using_uep_hook():
    real = Path(os.environ.get("PRIMUS_PATH") or os.devnull) / "runner/helpers/hooks/05_using_uep.sh"
    return real if real.is_file() else None


def _run_using_uep_hook(venv_bin: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """The hook as primus-cli's execute_hooks runs it (`bash <hook>`, python3 = the environment's), with
    its logging functions stood in for."""
    script = _real_using_uep_hook()
    if script is None:
        script = tmp_path / "05_using_uep.sh"
        script.write_text(HOOK_EXCERPT)
    logs = "".join(f'{f}() {{ echo "[{f}] $*"; }}; export -f {f}; ' for f in ("LOG_INFO", "LOG_ERROR", "LOG_WARN",
                                                                                "LOG_INFO_RANK0"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")}
    env.update(PATH=f"{venv_bin}{os.pathsep}{env.get('PATH', '')}", USING_UEP="1")
    return subprocess.run(["bash", "-c", logs + 'bash "$0"', str(script)], capture_output=True, text=True, env=env,
                          timeout=120)


def _venv_site(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_using_uep_hook_passes_with_our_deep_ep_installed_and_deep_ep_is_ours(tmp_path):
    """A fresh environment like Primus's image (UCCL's `deep_ep` wrapper installed; UCCL's `uccl` added later;
    both stood in for by small wheels): `uccl-ep-train install-deep-ep` replaces the wrapper with ours, says
    that the hook also needs UCCL's `uccl`; with `uccl` present the hook's checks pass and it exports
    DEEP_EP, and `import deep_ep` with site-packages ahead of PYTHONPATH (base_env.sh) gives our Buffer.
    --uninstall removes ours only. No network: every wheel is built here, pip runs with --no-index."""
    import sysconfig

    from uccl_ep_train.compat.deep_ep_dist import VERSION, write_wheel
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py, site = venv / "bin" / "python", None
    site = _venv_site(py)
    # uccl-ep-train and torch importable there, as if installed (an editable-style .pth)
    paths = dict.fromkeys([str(ROOT), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(site, "zz_uccl_ep_train_test.pth").write_text("".join(p + "\n" for p in paths))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    uccl_wrapper = write_wheel(str(wheels), "deep_ep", "0.1.0", {"deep_ep/__init__.py": "raise ImportError('UCCL')\n"},
                               "stand-in for UCCL's deep_ep wrapper", ("uccl",))
    uccl = write_wheel(str(wheels), "uccl", "0.0.1", {"uccl/__init__.py": ""}, "stand-in for UCCL's package", ())

    def pip(*args):
        subprocess.run([str(py), "-m", "pip", *args, "--no-index", "--no-deps", "--disable-pip-version-check", "-q"],
                       check=True, timeout=120)

    def ours(*args):
        return subprocess.run([sys.executable, "-m", "uccl_ep_train.apps.cli", "install-deep-ep", "--python",
                               str(py), *args], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})

    pip("install", uccl_wrapper)
    res = ours()
    assert res.returncode == 0, res.stdout + res.stderr
    assert "replaced deep_ep 0.1.0 (stand-in for UCCL's deep_ep wrapper)" in res.stdout
    assert f"installed deep_ep {VERSION} for {py}: `import deep_ep` is uccl-ep-train" in res.stdout
    assert "also requires UCCL's own `uccl` distribution" in res.stderr
    assert "--env PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND=UCCL_EP" in res.stderr
    hook_run = _run_using_uep_hook(venv / "bin", tmp_path)
    assert hook_run.returncode == 1 and "uccl is not installed!" in hook_run.stdout + hook_run.stderr

    pip("install", uccl)
    hook_run = _run_using_uep_hook(venv / "bin", tmp_path)
    assert hook_run.returncode == 0, hook_run.stdout + hook_run.stderr
    assert "env.PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND=DEEP_EP" in hook_run.stdout.splitlines()
    assert f"deep_ep package is installed: Version: {VERSION}" in hook_run.stdout
    if _real_using_uep_hook():  # the real script goes on with UCCL's network settings
        assert "env.UCCL_IB_GID_INDEX=" in hook_run.stdout.splitlines(), hook_run.stdout
    # Primus-Turbo's DEEP_EP backend imports deep_ep with site-packages first on PYTHONPATH (base_env.sh)
    code = ("import os\n"
            "from uccl_ep_train.compat.primus_turbo import deep_ep_route_advice\n"
            "assert deep_ep_route_advice() is None, deep_ep_route_advice()\n"
            "import deep_ep, uccl_ep_train\n"
            "from deep_ep.buffer import Buffer\n"
            "from deep_ep.utils import EventOverlap\n"
            "assert deep_ep.Buffer is Buffer is uccl_ep_train.Buffer\n"
            "print(os.path.dirname(deep_ep.__file__))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((site, str(ROOT))), "USING_UEP": "1",
           "PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND": "DEEP_EP"}
    got = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.strip().endswith(os.path.join("uccl_ep_train", "compat", "deep_ep"))
    assert "deep_ep: provided by uccl-ep-train" in got.stderr

    res = ours("--uninstall")
    assert res.returncode == 0 and subprocess.run([str(py), "-m", "pip", "show", "deep_ep"],
                                                  capture_output=True).returncode == 1
    pip("install", uccl_wrapper)
    res = ours("--uninstall")
    assert res.returncode == 1 and "the installed deep_ep 0.1.0 is not ours" in res.stderr


def test_deep_ep_route_advice_names_the_deep_ep_in_use_and_what_to_do(tmp_path, monkeypatch, capsys):
    """Under DEEP_EP (USING_UEP=1) with another deep_ep first, importing the hook says which deep_ep runs and
    how to get ours (install-deep-ep, or UCCL_EP by name); nothing with ours or another backend."""
    from uccl_ep_train.compat import deep_ep_path
    other = tmp_path / "other"
    (other / "deep_ep").mkdir(parents=True)
    (other / "deep_ep" / "__init__.py").write_text("")
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    monkeypatch.syspath_prepend(str(other))
    env = {"USING_UEP": "1", "PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND": "DEEP_EP"}
    advice = turbo_backend.deep_ep_route_advice(env)
    assert advice.startswith("PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND=DEEP_EP, set by USING_UEP=1")
    assert f"runs on the deep_ep at {other / 'deep_ep' / '__init__.py'}, not on uccl-ep-train" in advice
    assert "`uccl-ep-train install-deep-ep`" in advice and "UCCL's own `uccl` package" in advice
    assert "--env PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND=UCCL_EP" in advice
    assert turbo_backend.deep_ep_route_advice({**env, "PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND": "UCCL_EP"}) is None
    assert turbo_backend.warn_deep_ep_route({**env, "RANK": "1"}) == advice and capsys.readouterr().err == ""
    assert turbo_backend.warn_deep_ep_route(env) == advice
    assert capsys.readouterr().err == f"uccl-ep-train: warning: {advice}\n"
    monkeypatch.syspath_prepend(deep_ep_path())
    assert turbo_backend.deep_ep_route_advice(env) is None
    # the module install-deep-ep installs counts as ours
    from uccl_ep_train.compat.deep_ep_dist import SHIM
    (other / "deep_ep" / "__init__.py").write_text(SHIM)
    monkeypatch.syspath_prepend(str(other))
    assert turbo_backend.deep_ep_route_advice(env) is None
    # importing the hook prints it (every launch in this doc goes through it)
    (other / "deep_ep" / "__init__.py").write_text("")
    res = subprocess.run([sys.executable, "-c", "import megatron_patch.primus"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(
                             (str(other), str(ROOT)))})
    assert res.returncode == 0 and "uccl-ep-train: warning: PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND=DEEP_EP" \
        in res.stderr, res.stderr[-2000:]
