"""Primus integration: the experiment YAML selects uccl, and our patches, run the way Primus runs them,
put Megatron's arguments on the uccl dispatcher (Primus itself is stood in for by its patch-registry API)."""
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

import megatron_patch
from megatron_patch import primus as hook
from uccl_ep_train.recipes import load_recipe

ROOT = Path(__file__).resolve().parent.parent
YAML = ROOT / "recipes" / "primus" / "deepseek_v3.yaml"


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


class FakePrimus:
    """Primus's patch registry and runner, reduced to what the hook touches."""

    def __init__(self):
        self.patches = []

    def register_patch(self, patch_id, *, backend=None, phase=None, condition=None, description="", **kw):
        def deco(fn):
            self.patches.append(SimpleNamespace(id=patch_id, backend=backend, phase=phase, condition=condition, fn=fn))
            return fn
        return deco

    def run(self, phase, params, backend_args=None):
        ctx = SimpleNamespace(backend="megatron", phase=phase,
                              extra={"module_config": SimpleNamespace(params=params), "backend_args": backend_args})
        ran = []
        for p in self.patches:
            if p.backend == "megatron" and p.phase == phase and (p.condition is None or p.condition(ctx)):
                p.fn(ctx)
                ran.append(p.id)
        return ran


@pytest.fixture
def fake_primus(monkeypatch):
    fp = FakePrimus()
    applied = []
    monkeypatch.setattr(megatron_patch, "apply", lambda: applied.append(True))
    saved = dict(os.environ)        # the setup patch exports variables: keep them out of other tests
    for k in [k for k in os.environ if k.startswith("UCCL_") or k == "NCCL_MAX_NCHANNELS"]:
        del os.environ[k]
    fp.applied = applied
    yield fp
    os.environ.clear()
    os.environ.update(saved)


def test_patches_select_uccl_through_primus_phases(fake_primus, overrides, monkeypatch):
    from megatron_patch import settings
    monkeypatch.setattr(settings, "num_sms", None)
    assert hook.register(fake_primus.register_patch) == list(hook.PATCH_IDS)
    params = SimpleNamespace(**overrides)
    # Primus's arg builder keeps only Megatron's keys; a stale flex selection must not survive
    backend_args = SimpleNamespace(moe_token_dispatcher_type="flex", moe_enable_deepep=True)
    assert fake_primus.run("setup", params, backend_args) == ["uccl_ep.setup"]
    assert fake_primus.applied == [True]                       # megatron_patch.apply() registered uccl
    assert os.environ["UCCL_IB_MAX_INFLIGHT_NORMAL"] == "8"
    assert settings.num_sms == 24
    assert os.environ["UCCL_EP_BACKEND"] == "auto" and os.environ["UCCL_EP_TIMEOUT_S"] == "300"
    assert backend_args.moe_token_dispatcher_type == "uccl" and backend_args.moe_enable_deepep is False
    backend_args.moe_token_dispatcher_type = "flex"            # e.g. another patch switched it
    assert fake_primus.run("build_args", params, backend_args) == ["uccl_ep.build_args"]
    assert backend_args.moe_token_dispatcher_type == "uccl"
    assert fake_primus.run("before_train", params, backend_args) == ["uccl_ep.before_train"]


def test_patches_are_inert_without_uccl(fake_primus):
    hook.register(fake_primus.register_patch)
    params = SimpleNamespace(moe_token_dispatcher_type="alltoall", use_turbo_deepep=True)
    backend_args = SimpleNamespace(moe_token_dispatcher_type="flex")
    for phase in ("setup", "build_args", "before_train"):
        assert fake_primus.run(phase, params, backend_args) == []
    assert backend_args.moe_token_dispatcher_type == "flex" and fake_primus.applied == []


def test_use_uccl_ep_alone_selects_uccl_and_conflicts_are_named(fake_primus):
    hook.register(fake_primus.register_patch)
    params = SimpleNamespace(use_uccl_ep=True)
    args = SimpleNamespace(moe_token_dispatcher_type="alltoall")
    fake_primus.run("setup", params, args)
    assert args.moe_token_dispatcher_type == "uccl" and params.moe_token_dispatcher_type == "uccl"
    with pytest.raises(ValueError, match="use_turbo_deepep"):
        fake_primus.run("setup", SimpleNamespace(use_uccl_ep=True, use_turbo_deepep=True), args)
    with pytest.raises(ValueError, match="moe_token_dispatcher_type: flex"):
        hook.check_params(SimpleNamespace(use_uccl_ep=True, moe_token_dispatcher_type="flex"))
    with pytest.raises(ValueError, match="environment variable name"):
        hook.export_env(SimpleNamespace(uccl_ep_env={"BAD NAME": 1}), environ={})


def test_register_with_primus_module_on_import_path(monkeypatch):
    """With Primus importable, `register()` uses primus.core.patches.register_patch (once)."""
    fp = FakePrimus()
    pkgs = {name: types.ModuleType(name) for name in ("primus", "primus.core", "primus.core.patches")}
    pkgs["primus.core.patches"].register_patch = fp.register_patch
    for name, mod in pkgs.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(hook, "_registered", False)
    assert hook.register() == list(hook.PATCH_IDS)
    assert hook.register() == list(hook.PATCH_IDS)
    assert [p.id for p in fp.patches] == list(hook.PATCH_IDS)
    assert [p.phase for p in fp.patches] == ["setup", "build_args", "before_train"]


def test_cli_without_primus_says_how_to_get_it():
    res = subprocess.run([sys.executable, "-m", "megatron_patch.primus", "train", "pretrain", "--config", str(YAML)],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "Primus is not importable" in res.stderr


def test_real_apply_lets_megatron_take_uccl_from_the_primus_config():
    """The setup patch's megatron_patch.apply() makes Megatron-LM's parser (which Primus builds its
    arguments from) accept the YAML's dispatcher; run in a fresh process (apply() patches megatron)."""
    code = f"""
import argparse, sys
from types import SimpleNamespace
sys.path.insert(0, {str(ROOT)!r})
from megatron_patch import primus as hook
ov = hook.module_overrides(hook.load_yaml({str(YAML)!r}, environ={{}}))
ctx = SimpleNamespace(extra={{"module_config": SimpleNamespace(params=SimpleNamespace(**ov)), "backend_args": None}})
hook.patch_setup(ctx)
from megatron.training.arguments import add_megatron_arguments
p = add_megatron_arguments(argparse.ArgumentParser())
ns = p.parse_args(["--moe-token-dispatcher-type", ov["moe_token_dispatcher_type"]])
print("DISPATCHER", ns.moe_token_dispatcher_type)
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "DISPATCHER uccl" in res.stdout


REAL_PRIMUS = """
import sys
from types import SimpleNamespace
try:
    from primus.core.patches import run_patches
except ImportError:
    sys.exit(3)
import megatron_patch.primus as hook      # importing registers the patches with Primus
ov = hook.module_overrides(hook.load_yaml(sys.argv[1], environ={}))
args = SimpleNamespace(moe_token_dispatcher_type="flex", moe_enable_deepep=True)
extra = {"module_config": SimpleNamespace(params=SimpleNamespace(**ov)), "backend_args": args}
applied = [run_patches(backend="megatron", phase=ph, extra=extra, stop_on_error=True)
           for ph in ("setup", "build_args", "before_train")]
off = {"module_config": SimpleNamespace(params=SimpleNamespace(moe_token_dispatcher_type="alltoall")),
       "backend_args": SimpleNamespace(moe_token_dispatcher_type="flex")}
print("RESULT", applied, args.moe_token_dispatcher_type, args.moe_enable_deepep,
      run_patches(backend="megatron", phase="build_args", extra=off), off["backend_args"].moe_token_dispatcher_type)
"""


def test_with_primus_own_patch_runner():
    """With a Primus checkout on PRIMUS_PATH (or Primus installed), Primus's own run_patches applies ours."""
    path = os.pathsep.join(p for p in (os.environ.get("PRIMUS_PATH"), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    res = subprocess.run([sys.executable, "-c", REAL_PRIMUS, str(YAML)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"})
    if res.returncode == 3:
        pytest.skip("Primus is not importable (set PRIMUS_PATH to an AMD-AGI/Primus checkout)")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "RESULT [1, 1, 1] uccl False 0 flex" in res.stdout
