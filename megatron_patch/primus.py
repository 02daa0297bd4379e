"""Primus hook: select the uccl MoE dispatcher from a Primus experiment YAML, and offer UCCL-EP to
Primus-Turbo's DeepEP dispatcher.

Primus (AMD-AGI/Primus) builds Megatron's arguments from the YAML and runs registered patches at fixed
phases, in this order (primus/core/runtime/train_runtime.py):
  1. `build_args`: right after it converted the YAML's keys into Megatron's arguments (keys Megatron does not
     know are dropped there, and merged back into those arguments after this phase);
  2. `setup`: before the trainer's setup;
  3. `before_train`: after the trainer's init, right before training. Megatron's validate_args, which
     Primus extends with its ROCm checks (among them `turbo_sync_free_moe_stage`'s switches), runs after
     every phase, inside training: no patch sees its effects, so ours check the keys that cause them.

Two routes to UCCL-EP:
- the uccl dispatcher (ours), selected by these keys under `modules.pre_trainer.overrides`:

    moe_token_dispatcher_type: uccl     # or
    use_uccl_ep: true                   # Primus-style switch (sets moe_token_dispatcher_type: uccl)
    uccl_ep_num_sms: 24                 # optional: SMs for dispatch/combine (even)
    uccl_ep_backend: auto               # optional: auto | native | reference
    uccl_ep_timeout_s: 300              # optional: deadline for any wait on peers
    uccl_ep_env:                        # optional: UCCL_* / NCCL_* settings, exported if not already set
      UCCL_IB_GID_INDEX: 3

- Primus-Turbo's DeepEP dispatcher (`enable_primus_turbo: true`, `use_turbo_deepep: true`) on our Buffer:
  importing this module registers our EP backend with Primus-Turbo as UCCL_EP when Primus-Turbo is
  importable (uccl_ep_train.compat.primus_turbo); PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND=UCCL_EP selects it.
  DEEP_EP (what primus-cli's USING_UEP=1 exports) runs on ours when `import deep_ep` gives ours
  (`uccl-ep-train install-deep-ep`); when it does not, importing this module says so on stderr, and what to do.

Patches of the first route (conditioned on uccl being selected, so they are inert otherwise):
- `uccl_ep.build_args` (phase build_args, the first): refuses settings that contradict uccl, then
  `megatron_patch.apply()` (registers `uccl` with megatron-core and Megatron-LM's parser), exports
  `uccl_ep_env`, applies the `uccl_ep_*` settings and sets `moe_token_dispatcher_type = 'uccl'` on the
  arguments Primus built.
- `uccl_ep.before_train` (phase before_train, after Primus's own patches of that phase): the same checks and
  selection again, so no patch in between leaves training on another dispatcher.
A refused configuration, or any failure of these patches, stops the launch: Primus's run_patches logs an
Exception raised by a patch and carries on, so ours leave as SystemExit, which it does not catch.

Primus has no plugin entry point, so the patches and the backend must be registered in the training
processes before Primus runs: start Primus through this module, as a module or as a file (the arguments
are Primus's CLI's):

    python -m megatron_patch.primus train pretrain --config recipes/primus/deepseek_v3.yaml      # one process
    torchrun --nproc-per-node 8 -m megatron_patch.primus train pretrain --config ...              # one per GPU
    primus-cli direct --script <path of this file> -- train pretrain --config ...                 # torchrun too

or `import megatron_patch.primus` early in your own entry script.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import sys
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Optional

if __name__ == "__main__" and not __package__:
    # Run as a file (primus-cli's --script): Python put this file's folder first on sys.path, where this
    # file would stand in for Primus's `primus` package. Import packages from the folder holding
    # megatron_patch instead (added only when missing, so that PYTHONPATH keeps its order).
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    if os.path.dirname(_here) not in map(os.path.abspath, sys.path):
        sys.path.insert(0, os.path.dirname(_here))

from uccl_ep_train.compat import primus_turbo  # noqa: E402  (after the path fix above)

DISPATCHER = "uccl"
SETTING_KEYS = ("uccl_ep_num_sms", "uccl_ep_backend", "uccl_ep_timeout_s")
LAST = 100  # a priority number above those of Primus's own patches: Primus runs lower numbers first
_registered = False
log = logging.getLogger(__name__)

_TURBO_INSTEAD = ("to run Primus-Turbo's DeepEP dispatcher on UCCL-EP instead, drop use_uccl_ep and "
                  "moe_token_dispatcher_type: uccl and set PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND="
                  f"{primus_turbo.BACKEND_NAME} (primus-cli: --env PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND="
                  f"{primus_turbo.BACKEND_NAME}), starting Primus through megatron_patch.primus")


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
    """Refuse settings that contradict the uccl dispatcher, naming the YAML key and what to set instead."""
    if _get(params, "use_turbo_deepep", False):
        raise ValueError("Primus config: use_turbo_deepep: true and the uccl dispatcher both replace the MoE "
                         "token dispatcher; to keep uccl, set use_turbo_deepep: false; " + _TURBO_INSTEAD)
    stage = _get(params, "turbo_sync_free_moe_stage") or 0
    if stage >= 2:
        raise ValueError(f"Primus config: turbo_sync_free_moe_stage: {stage} turns use_turbo_deepep on (Primus's "
                         "argument validation, stages 2 and 3), which replaces the uccl dispatcher; to keep "
                         "uccl, set turbo_sync_free_moe_stage: 1 or 0; " + _TURBO_INSTEAD)
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
    from megatron_patch import settings
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


def _stops_launch(patch: Callable[[Any], None]) -> Callable[[Any], None]:
    """Primus's run_patches logs an Exception raised by a patch (an ImportError too) and goes on with the
    launch, which would then train on a dispatcher the user did not choose: re-raise it as SystemExit, which
    run_patches does not catch, so the launch stops with the message (Primus's runtime reports it as the
    cause of its failure)."""
    @functools.wraps(patch)
    def run(ctx: Any) -> None:
        try:
            patch(ctx)
        except Exception as e:
            message = f"megatron_patch.primus: {patch.__name__} stopped the launch: {e}"
            log.error(message)
            raise SystemExit(message) from e
    return run


def patch_build_args(ctx: Any) -> None:
    """Refuse contradicting settings, register uccl with Megatron, take the uccl_ep_* settings into effect
    and put Megatron's args on uccl (Primus's builder drops the keys Megatron does not know)."""
    params = _params(ctx)
    check_params(params)
    import megatron_patch
    megatron_patch.apply()
    export_env(params)
    apply_settings(params)
    select_uccl(params, ctx.extra.get("backend_args"))


def patch_before_train(ctx: Any) -> None:
    """Check and select uccl again after every other patch had its turn (none may switch the dispatcher)."""
    select_uccl(_params(ctx), ctx.extra.get("backend_args"))


PATCHES = (("uccl_ep.build_args", "build_args", 50, patch_build_args),        # 50: Primus's default
           ("uccl_ep.before_train", "before_train", LAST, patch_before_train))
PATCH_IDS = tuple(pid for pid, *_ in PATCHES)


def register(register_patch: Optional[Callable] = None) -> list[str]:
    """Register the patches with Primus (or with the given `register_patch` decorator factory, which takes
    Primus's arguments).

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
    for pid, phase, priority, fn in PATCHES:
        register_patch(pid, backend="megatron", phase=phase, condition=_condition, priority=priority,
                       description=" ".join((fn.__doc__ or "").split()))(_stops_launch(fn))
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
    """`python -m megatron_patch.primus <primus CLI args>` (or this file run as a script, one process per rank
    under torchrun): register our patches, then run Primus's CLI."""
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


if __name__ == "__main__":
    # Run from the importable module, so the patches Primus holds are that module's (one registration,
    # whichever way this file was started).
    from megatron_patch.primus import main as _main
    sys.exit(_main())
else:
    register()
    primus_turbo.register()
    primus_turbo.warn_deep_ep_route()  # DEEP_EP (USING_UEP=1) on a deep_ep that is not ours: what to do
