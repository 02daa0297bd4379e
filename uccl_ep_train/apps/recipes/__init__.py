"""Training recipes: model shape, parallelism layout and environment for Megatron runs with the uccl dispatcher.

A recipe is data: `args` holds Megatron-LM argument values keyed by their argparse destination names
(`num_layers`, `num_experts`, `swiglu`, `add_bias_linear`, `expert_model_parallel_size`, ...), so one dict
drives the Megatron-LM command line, megatron-core's TransformerConfig, `uccl-ep-train plan` and the Slurm
launcher. Every recipe sets `moe_token_dispatcher_type="uccl"`. `env` holds UCCL_* / NCCL_* settings,
`cluster` the reference cluster shape (nodes, gpus_per_node) and `published` reference numbers checked by
the tests (total / active parameters).

    from uccl_ep_train.apps.recipes import load_recipe
    r = load_recipe("deepseek-v3")                   # or "deepseek-v2-lite", "tiny", or a .py/.json/.toml path
    r = r.with_args(expert_model_parallel_size=64)   # a new Recipe; the original is unchanged
    r.megatron_args()   # ['--num-layers', '61', ..., '--moe-token-dispatcher-type', 'uccl', ...]
    r.model_config()    # {'num_layers': 61, 'num_moe_experts': 256, 'moe_layer_freq': [0, 0, 0, 1, ...], ...}
    r.transformer_config()  # megatron-core (MLA)TransformerConfig, built by Megatron's own arg translation
"""
from __future__ import annotations

import ast
import copy
import importlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from uccl_ep_train.config import NIC_FLOW_CONTROL

__all__ = ["Recipe", "list_recipes", "load_recipe", "megatron_cli_args", "parse_moe_layer_freq", "nic_env",
           "NIC_PROFILES", "STORE_FALSE_FLAGS"]

_BUILTIN = {"deepseek-v3": "deepseek_v3", "deepseek-v2-lite": "deepseek_v2_lite", "tiny": "tiny"}

# Megatron-LM arguments whose flag stores False (dest -> flag), and dests whose flag is not --<dest>.
STORE_FALSE_FLAGS = {
    "add_bias_linear": "--disable-bias-linear",
    "apply_rope_fusion": "--no-rope-fusion",
    "masked_softmax_fusion": "--no-masked-softmax-fusion",
    "bias_dropout_fusion": "--no-bias-dropout-fusion",
    "gradient_accumulation_fusion": "--no-gradient-accumulation-fusion",
}
_RENAMED_FLAGS = {"layernorm_epsilon": "--norm-epsilon"}

# Megatron-LM argument name -> megatron-core TransformerConfig field name, where they differ.
_ARG_TO_CONFIG = {
    "num_experts": "num_moe_experts",
    "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
    "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
    "swiglu": "gated_linear_unit",
}

# NIC-specific settings: Broadcom Thor-2 and AMD Pollara want strict flow control (the proxy also applies
# it by itself when it sees their devices: config.NIC_FLOW_CONTROL, the one table of those limits); EFA and
# ConnectX run with the defaults. The transport is not a profile's business: each rank picks it from its
# NICs' kind (uccl_ep_train/proxy.py choose_transport: verbs on cx7 / thor2 / pollara, fabric on efa); the
# efa profile names the efa provider that choice asks libfabric for, so that every libfabric user of the job
# (NCCL's aws-ofi-nccl too) takes the same one.
NIC_PROFILES: dict[str, dict[str, str]] = {
    "cx7": {},
    "efa": {"NCCL_MAX_NCHANNELS": "8", "FI_PROVIDER": "efa"},
    "thor2": NIC_FLOW_CONTROL["bnxt_re"].env(),
    "pollara": NIC_FLOW_CONTROL["ionic"].env(),
}


def nic_env(profile: Optional[str]) -> dict[str, str]:
    """UCCL_* / NCCL_* settings for a NIC family (`cx7`, `efa`, `thor2`, `pollara`; None or '' -> {})."""
    if not profile:
        return {}
    key = profile.lower()
    if key not in NIC_PROFILES:
        raise ValueError(f"nic profile {profile!r} unknown; choose one of {sorted(NIC_PROFILES)}")
    return dict(NIC_PROFILES[key])


def parse_moe_layer_freq(value: Any, num_layers: int) -> list[int]:
    """Megatron's --moe-layer-freq as a per-layer list (1 = MoE layer, 0 = dense).

    Accepts an int k (every k-th layer is MoE, starting with layer 0), a list, or Megatron's string form
    such as "([0]*3+[1]*58)", evaluated without eval(): only list literals, ints, + and * are allowed.
    """
    if isinstance(value, bool):
        raise TypeError(f"moe_layer_freq must be an int, list or string, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"moe_layer_freq must be >= 1, got {value}")
        pattern = [1 if i % value == 0 else 0 for i in range(num_layers)]
    elif isinstance(value, (list, tuple)):
        pattern = [int(v) for v in value]
    elif isinstance(value, str):
        pattern = _eval_list_expr(value)
        if isinstance(pattern, int):
            return parse_moe_layer_freq(pattern, num_layers)
    else:
        raise TypeError(f"moe_layer_freq must be an int, list or string, got {type(value).__name__}")
    if len(pattern) != num_layers:
        raise ValueError(f"moe_layer_freq {value!r} describes {len(pattern)} layers, num_layers is {num_layers}")
    if any(v not in (0, 1) for v in pattern):
        raise ValueError(f"moe_layer_freq {value!r} must contain only 0 and 1")
    return pattern


def _eval_list_expr(text: str) -> Any:
    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ValueError(f"moe_layer_freq {text!r}: only list literals, ints, + and * are allowed")
    return ev(ast.parse(text.strip(), mode="eval"))


def _flag(dest: str) -> str:
    return _RENAMED_FLAGS.get(dest, "--" + dest.replace("_", "-"))


def megatron_cli_args(args: Mapping[str, Any]) -> list[str]:
    """Megatron-LM command-line arguments for a dict keyed by argparse destination names.

    True -> `--flag`; False -> nothing (or the `--disable-*` / `--no-*` flag for dests that default True);
    None -> nothing (Megatron's default); lists -> `--flag a b`; everything else -> `--flag str(value)`.
    """
    out: list[str] = []
    for dest, value in args.items():
        if value is None:
            continue
        if dest in STORE_FALSE_FLAGS:
            if not isinstance(value, bool):
                raise TypeError(f"recipe arg {dest!r} must be a bool, got {value!r}")
            if not value:
                out.append(STORE_FALSE_FLAGS[dest])
            continue
        if isinstance(value, bool):
            if value:
                out.append(_flag(dest))
            continue
        if isinstance(value, (list, tuple)):
            out.append(_flag(dest))
            out.extend(str(v) for v in value)
            continue
        out += [_flag(dest), str(value)]
    return out


@dataclass(frozen=True)
class Recipe:
    """One training recipe. Treat as immutable: `with_args` returns a modified copy."""
    name: str
    description: str
    args: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    cluster: dict[str, int] = field(default_factory=lambda: {"nodes": 1, "gpus_per_node": 1})
    published: dict[str, float] = field(default_factory=dict)

    # ---- derived views -------------------------------------------------------------------------------
    @property
    def tp(self) -> int:
        return int(self.args.get("tensor_model_parallel_size") or 1)

    @property
    def pp(self) -> int:
        return int(self.args.get("pipeline_model_parallel_size") or 1)

    @property
    def ep(self) -> int:
        return int(self.args.get("expert_model_parallel_size") or 1)

    @property
    def etp(self) -> int:
        etp = self.args.get("expert_tensor_parallel_size")
        return int(self.tp if etp is None else etp)

    @property
    def cp(self) -> int:
        return int(self.args.get("context_parallel_size") or 1)

    def moe_layers(self) -> list[int]:
        """Per-layer pattern, 1 = MoE layer, 0 = dense layer."""
        n = int(self.args["num_layers"])
        if not self.args.get("num_experts"):
            return [0] * n
        return parse_moe_layer_freq(self.args.get("moe_layer_freq", 1), n)

    def with_args(self, **updates: Any) -> "Recipe":
        """A copy with some Megatron-LM args replaced (unknown names are allowed: Megatron checks them)."""
        args = copy.deepcopy(self.args)
        args.update(updates)
        return Recipe(self.name, self.description, args, dict(self.env), dict(self.cluster), dict(self.published))

    def megatron_args(self, **updates: Any) -> list[str]:
        """Megatron-LM CLI arguments (pretrain_gpt.py), `--moe-token-dispatcher-type uccl` included."""
        return megatron_cli_args(self.with_args(**updates).args if updates else self.args)

    def model_config(self) -> dict[str, Any]:
        """A flat dict of TransformerConfig-style fields.

        TransformerConfig names where one exists (`num_moe_experts`, `gated_linear_unit` + `activation`
        'silu', `add_bias_linear`, `layernorm_epsilon`, `moe_layer_freq` as a per-layer 0/1 list,
        `num_layers_in_first/last_pipeline_stage`, the parallel sizes, the MLA dims), and the Megatron-LM /
        GPTModel names for the rest (`vocab_size`, `seq_length`, `max_position_embeddings`,
        `share_embeddings_and_output_weights`, `micro_batch_size`, `global_batch_size`, `lr`, ...).
        """
        out: dict[str, Any] = {}
        for k, v in self.args.items():
            if k == "untie_embeddings_and_output_weights":
                out["share_embeddings_and_output_weights"] = not v
            elif k == "moe_layer_freq":
                out[k] = self.moe_layers()
            else:
                out[_ARG_TO_CONFIG.get(k, k)] = v
        if out.get("gated_linear_unit"):
            out["activation"] = "silu"
        out.setdefault("share_embeddings_and_output_weights", True)
        out.setdefault("expert_tensor_parallel_size", self.etp)
        return out

    def parse_megatron_args(self, extra: Optional[list[str]] = None):
        """Parse `megatron_args()` with Megatron-LM's own parser (megatron.training); returns its Namespace.

        Needs `uccl` registered as a dispatcher choice (megatron_patch.apply()); raises SystemExit on any
        argument Megatron does not know, which is what the tests rely on.
        """
        import argparse

        from megatron.training.arguments import add_megatron_arguments
        parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False))
        _allow_uccl_choice(parser)
        return parser.parse_args(self.megatron_args() + list(extra or []))

    def validate_megatron(self, world_size: Optional[int] = None, device_capability: tuple = (9, 0)):
        """Run Megatron-LM's own `validate_args` on this recipe at `world_size` ranks (default: the
        reference cluster) and return the validated Namespace; Megatron raises (AssertionError / ValueError)
        on what it refuses. Runs on CPU: the GPU's compute capability, which Megatron asks about (grouped
        GEMM, some TP features), is taken as `device_capability` (Hopper by default); the recipe's `env` is
        in effect, as the launcher exports it. Its argument table goes nowhere."""
        import contextlib
        import io
        from unittest import mock

        import torch
        from megatron.training.arguments import validate_args
        ns = self.parse_megatron_args()
        ns.world_size = int(world_size or self.cluster.get("nodes", 1) * self.cluster.get("gpus_per_node", 1))
        ns.rank = 0
        from types import SimpleNamespace
        cap = tuple(device_capability)
        props = SimpleNamespace(major=cap[0], minor=cap[1], name="planned GPU", total_memory=0,
                                multi_processor_count=132)
        with mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: cap), \
                mock.patch.object(torch.cuda, "get_device_properties", lambda *a, **k: props), \
                mock.patch.dict(os.environ, self.env), contextlib.redirect_stdout(io.StringIO()):
            validate_args(ns)
        return ns

    def transformer_config(self, **overrides: Any):
        """megatron-core TransformerConfig (MLATransformerConfig with MLA) via Megatron's own translation
        (`core_transformer_config_from_args` on the parsed `megatron_args()`).

        `overrides` are config fields to set (e.g. `moe_token_dispatcher_type="alltoall"`,
        `use_cpu_initialization=True`): they go in before validation where Megatron reads them from the
        arguments, and are set afterwards otherwise. With `uccl` registered (megatron_patch.apply()) the
        config is validated as uccl; before that it is validated as alltoall and then labelled uccl.
        """
        import dataclasses
        import typing

        import torch
        from megatron.core.transformer.transformer_config import TransformerConfig
        from megatron.training.argument_utils import core_transformer_config_from_args
        ns = self.parse_megatron_args()
        ns.params_dtype = torch.bfloat16 if ns.bf16 else (torch.float16 if ns.fp16 else torch.float32)
        if ns.expert_tensor_parallel_size is None:
            ns.expert_tensor_parallel_size = ns.tensor_model_parallel_size
        dispatcher = overrides.pop("moe_token_dispatcher_type", ns.moe_token_dispatcher_type)
        field = {f.name: f for f in dataclasses.fields(TransformerConfig)}["moe_token_dispatcher_type"]
        registered = dispatcher in typing.get_args(field.type)
        ns.moe_token_dispatcher_type = dispatcher if registered or dispatcher != "uccl" else "alltoall"
        for k, v in overrides.items():
            setattr(ns, k, v)
        cfg = core_transformer_config_from_args(ns)
        for k, v in overrides.items():
            if not hasattr(cfg, k):
                raise ValueError(f"transformer_config: {type(cfg).__name__} has no field {k!r}")
            if getattr(cfg, k) != v:
                setattr(cfg, k, v)
        cfg.moe_token_dispatcher_type = dispatcher
        return cfg


def _allow_uccl_choice(parser) -> None:
    """Add 'uccl' to --moe-token-dispatcher-type's choices (what megatron_patch.apply() does for Megatron-LM)."""
    for action in parser._actions:
        if action.dest == "moe_token_dispatcher_type" and action.choices is not None \
                and "uccl" not in action.choices:
            action.choices = tuple(action.choices) + ("uccl",)


def list_recipes() -> list[str]:
    """Names of the built-in recipes."""
    return list(_BUILTIN)


def _recipe_from_mapping(data: Mapping[str, Any], source: str) -> Recipe:
    missing = [k for k in ("name", "args") if k not in data]
    if missing:
        raise ValueError(f"recipe {source}: missing key(s) {missing}")
    args = dict(data["args"])
    for required in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                     "global_batch_size"):
        if args.get(required) is None:
            raise ValueError(f"recipe {source}: args.{required} is required")
    env = {str(k): str(v) for k, v in dict(data.get("env") or {}).items()}
    cluster = dict(data.get("cluster") or {"nodes": 1, "gpus_per_node": 1})
    return Recipe(str(data["name"]), str(data.get("description", "")), args, env, cluster,
                  dict(data.get("published") or {}))


def load_recipe(name_or_path: str) -> Recipe:
    """A built-in recipe by name (`deepseek-v3`, `deepseek-v2-lite`, `tiny`; '_' and '-' both work) or a
    recipe file: `.py` defining RECIPE, `.json` or `.toml` with the same keys (name, description, args,
    env, cluster, published)."""
    key = name_or_path.strip().lower().replace("_", "-")
    if key in _BUILTIN:
        mod = importlib.import_module(f"{__name__}.{_BUILTIN[key]}")
        return _recipe_from_mapping(copy.deepcopy(mod.RECIPE), name_or_path)
    if os.path.isfile(name_or_path):
        path = name_or_path
        if path.endswith(".json"):
            with open(path) as f:
                data = json.load(f)
        elif path.endswith(".toml"):
            import tomllib
            with open(path, "rb") as f:
                data = tomllib.load(f)
        elif path.endswith(".py"):
            scope: dict[str, Any] = {"__file__": path}
            with open(path) as f:
                exec(compile(f.read(), path, "exec"), scope)  # noqa: S102 - a user's own recipe file
            if "RECIPE" not in scope:
                raise ValueError(f"recipe file {path} defines no RECIPE dict")
            data = scope["RECIPE"]
        else:
            raise ValueError(f"recipe file {path}: use .py, .json or .toml")
        return _recipe_from_mapping(data, path)
    raise ValueError(f"unknown recipe {name_or_path!r}: built-in recipes are {list_recipes()}, "
                     "or give a path to a .py/.json/.toml recipe file")
