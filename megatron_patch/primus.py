"""Primus hook: select the uccl MoE dispatcher from a Primus experiment YAML.

Primus (AMD-AGI/Primus) builds Megatron's arguments from YAML and runs registered patches at fixed phases
(`setup`, `build_args`, `before_train`). Its own EP backends are selected the same way: the Primus-Turbo
DeepEP patch fires on `use_turbo_deepep: true` and swaps Megatron's flex dispatcher. This module registers
our patches with Primus's registry (`primus.core.patches.register_patch`) so that these YAML keys, under
`modules.pre_trainer.overrides`, select uccl:

    moe_token_dispatcher_type: uccl     # or
    use_uccl_ep: true                   # Primus-style switch (sets moe_token_dispatcher_type: uccl)
    uccl_ep_num_sms: 24                 # optional: SMs for dispatch/combine (even)
    uccl_ep_backend: auto               # optional: auto | native | reference
    uccl_ep_timeout_s: 300              # optional: deadline for any wait on peers
    uccl_ep_env:                        # optional: UCCL_* / NCCL_* settings, exported if not already set
      UCCL_IB_GID_INDEX: 3

Patches (all conditioned on uccl being selected, so they are inert otherwise):
- `uccl_ep.setup` (phase setup): `megatron_patch.apply()` (registers `uccl` with megatron-core and
  Megatron-LM's parser), exports `uccl_ep_env`, applies the `uccl_ep_*` settings; refuses
  `use_turbo_deepep: true` alongside uccl (both would replace the MoE dispatcher).
- `uccl_ep.build_args` and `uccl_ep.before_train`: set `moe_token_dispatcher_type = 'uccl'` on the Megatron
  arguments Primus built (its builder drops keys Megatron does not know, and a later patch must not
  switch the dispatcher back to flex).

Primus has no plugin entry point, so the patches must be registered in the training processes before
Primus runs them: start Primus through this module,

    python -m megatron_patch.primus train pretrain --config recipes/primus/deepseek_v3.yaml

(the arguments are Primus's CLI's), or `import megatron_patch.primus` early in your own entry script;
importing it registers the patches whenever Primus is importable.
"""
from __future__ import annotations

import os
import re
import sys
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Optional

DISPATCHER = "uccl"
PATCH_IDS = ("uccl_ep.setup", "uccl_ep.build_args", "uccl_ep.before_train")
SETTING_KEYS = ("uccl_ep_num_sms", "uccl_ep_backend", "uccl_ep_timeout_s")
_registered = False


# ---------------------------------------------------------------------------------------------------------
# selection logic (pure: works on any namespace / mapping of Primus module params)
# ---------------------------------------------------------------------------------------------------------
def _get(params: Any, key: str, default: Any = None) -> Any:
    if isinstance(params, Mapping):
        return params.get(key, default)
    return getattr(params, key, default)


def _set(params: Any, key: str, value: Any) -> None:
    if isinstance(params, dict):
        params[key] = value
    else:
        setattr(params, key, value)


def uccl_selected(params: Any) -> bool:
    """True when the module params select uccl (`moe_token_dispatcher_type: uccl` or `use_uccl_ep: true`)."""
    if params is None:
        return False
    return _get(params, "moe_token_dispatcher_type") == DISPATCHER or bool(_get(params, "use_uccl_ep", False))


def check_params(params: Any) -> None:
    """Refuse settings that contradict the uccl dispatcher, naming the YAML key."""
    if _get(params, "use_turbo_deepep", False):
        raise ValueError("Primus config: use_turbo_deepep: true and the uccl dispatcher both replace the MoE "
                         "token dispatcher; set use_turbo_deepep: false (or drop use_uccl_ep / "
                         "moe_token_dispatcher_type: uccl)")
    other = _get(params, "moe_token_dispatcher_type")
    if _get(params, "use_uccl_ep", False) and other not in (None, DISPATCHER, "alltoall", "allgather"):
        raise ValueError(f"Primus config: use_uccl_ep: true but moe_token_dispatcher_type: {other}; "
                         "remove one of them")
    env = _get(params, "uccl_ep_env")
    if env is not None and not isinstance(env, (Mapping, SimpleNamespace)):
        raise TypeError(f"Primus config: uccl_ep_env must be a mapping of NAME: value, got {type(env).__name__}")


def select_uccl(params: Any, backend_args: Any = None) -> None:
    """Point the module params (and Primus's Megatron args, if given) at the uccl dispatcher."""
    check_params(params)
    _set(params, "moe_token_dispatcher_type", DISPATCHER)
    for target in (params, backend_args):
        if target is None:
            continue
        _set(target, "moe_token_dispatcher_type", DISPATCHER)
        if _get(target, "moe_enable_deepep", None):
            _set(target, "moe_enable_deepep", False)


def export_env(params: Any, environ: Optional[dict] = None) -> dict[str, str]:
    """Export `uccl_ep_env` entries that are not already set; returns what was exported."""
    environ = os.environ if environ is None else environ
    env = _get(params, "uccl_ep_env") or {}
    if isinstance(env, SimpleNamespace):
        env = vars(env)
    done = {}
    for k, v in dict(env).items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k)):
            raise ValueError(f"Primus config: uccl_ep_env key {k!r} is not an environment variable name")
        if k not in environ:
            environ[k] = done[k] = str(v)
    return done


def apply_settings(params: Any) -> None:
    """`uccl_ep_num_sms` / `uccl_ep_backend` / `uccl_ep_timeout_s` -> megatron_patch.settings."""
    from . import settings
    ns = SimpleNamespace(**{k: _get(params, k) for k in SETTING_KEYS})
    settings.apply_arguments(ns)


# ---------------------------------------------------------------------------------------------------------
# Primus patches
# ---------------------------------------------------------------------------------------------------------
def _params(ctx: Any) -> Any:
    mc = getattr(ctx, "extra", {}).get("module_config")
    return getattr(mc, "params", None) if mc is not None else None


def _condition(ctx: Any) -> bool:
    return uccl_selected(_params(ctx))


def patch_setup(ctx: Any) -> None:
    """Register uccl with Megatron and take the uccl_ep_* settings into effect."""
    params = _params(ctx)
    check_params(params)
    from . import apply
    apply()
    export_env(params)
    apply_settings(params)
    select_uccl(params, ctx.extra.get("backend_args"))


def patch_args(ctx: Any) -> None:
    """Keep Megatron's args on the uccl dispatcher (Primus's builder drops unknown keys)."""
    select_uccl(_params(ctx), ctx.extra.get("backend_args"))


def register(register_patch: Optional[Callable] = None) -> list[str]:
    """Register the patches with Primus (or with the given `register_patch` decorator factory).

    Returns the patch ids registered; [] when Primus is not importable. Idempotent for Primus's registry.
    """
    global _registered
    if register_patch is None:
        if _registered:
            return list(PATCH_IDS)
        try:
            from primus.core.patches import register_patch  # type: ignore[no-redef]
        except ImportError:
            return []
        _registered = True
    for pid, phase, fn in zip(PATCH_IDS, ("setup", "build_args", "before_train"),
                              (patch_setup, patch_args, patch_args)):
        register_patch(pid, backend="megatron", phase=phase, condition=_condition,
                       description=fn.__doc__ or "")(fn)
    return list(PATCH_IDS)


# ---------------------------------------------------------------------------------------------------------
# Primus YAML (PyYAML when installed, which Primus requires; a small subset parser otherwise)
# ---------------------------------------------------------------------------------------------------------
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([^}]*))?\}")


def _substitute(value: Any, environ: Mapping[str, str]) -> Any:
    """Primus's `${NAME:default}` references, resolved from the environment."""
    if isinstance(value, dict):
        return {k: _substitute(v, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, environ) for v in value]
    if isinstance(value, str) and _ENV_REF.search(value):
        m = _ENV_REF.fullmatch(value)
        if m:  # a whole-value reference takes the scalar's type
            return _scalar(environ.get(m.group(1), m.group(2) if m.group(2) is not None else ""))
        return _ENV_REF.sub(lambda mm: environ.get(mm.group(1), mm.group(2) or ""), value)
    return value


def _scalar(text: str) -> Any:
    t = text.strip()
    if t in ("", "~", "null", "Null", "NULL"):
        return None
    if t in ("true", "True", "TRUE"):
        return True
    if t in ("false", "False", "FALSE"):
        return False
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "\"'":
        return t[1:-1]
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if ch in "\"'" and quote in (None, ch):
            quote = None if quote == ch else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def _mini_yaml(text: str) -> dict:
    """Block mappings with scalar values (what Primus experiment files use); no lists or flow style."""
    root: dict = {}
    stack: list[tuple[int, dict]] = [(-1, root)]
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = _strip_comment(raw).rstrip()
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        body = line.strip()
        if body.startswith("- ") or ":" not in body:
            raise ValueError(f"line {lineno}: only 'key: value' mappings are supported without PyYAML: {raw!r}")
        key, _, rest = body.partition(":")
        while stack and indent <= stack[-1][0]:
            stack.pop()
        parent = stack[-1][1]
        if rest.strip():
            parent[key.strip()] = _scalar(rest)
        else:
            child: dict = {}
            parent[key.strip()] = child
            stack.append((indent, child))
    return root


def load_yaml(path: str, environ: Optional[Mapping[str, str]] = None) -> dict:
    """A Primus experiment YAML as a dict, `${NAME:default}` references resolved."""
    with open(path) as f:
        text = f.read()
    try:
        import yaml  # type: ignore[import-untyped]
        data = yaml.safe_load(text) or {}
    except ImportError:
        data = _mini_yaml(text)
    return _substitute(data, os.environ if environ is None else environ)


def module_overrides(config: Mapping[str, Any], module: str = "pre_trainer") -> dict:
    """`modules.<module>.overrides` of a Primus experiment config."""
    try:
        return dict(config["modules"][module].get("overrides") or {})
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"Primus config has no modules.{module} section") from None


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m megatron_patch.primus <primus CLI args>`: register our patches, then run Primus's CLI."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from primus.cli.main import main as primus_main  # type: ignore[import-not-found]
    except ImportError:
        print("megatron_patch.primus: Primus is not importable; install AMD-AGI/Primus or put its checkout "
              "on PYTHONPATH", file=sys.stderr)
        return 2
    register()
    sys.argv = ["primus"] + argv
    result = primus_main()
    return int(result or 0)


register()

if __name__ == "__main__":
    sys.exit(main())
