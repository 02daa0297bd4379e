"""Primus's patch registry and runner (primus/core/patches), reduced: the same signatures, lower priority
numbers first (registration order on ties), a condition gates each patch, and an Exception raised by a patch
(an ImportError too) is logged and the run goes on unless stop_on_error."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

PATCHES: list[tuple] = []   # (id, backend, phase, condition, priority, handler), in registration order
APPLIED: list[tuple[str, str]] = []   # (phase, id) of every patch applied, in order


@dataclass
class PatchContext:
    backend: str
    phase: str
    extra: dict[str, Any] = field(default_factory=dict)


def register_patch(patch_id: str, *, description: str = "", backend: Optional[str] = None,
                   phase: Optional[str] = None, condition: Optional[Callable] = None, priority: int = 50,
                   backend_versions: Optional[Sequence[str]] = None, primus_versions: Optional[Sequence[str]] = None,
                   tags: Optional[Sequence[str]] = None) -> Callable:
    def decorator(func: Callable) -> Callable:
        PATCHES[:] = [p for p in PATCHES if p[0] != patch_id]   # the same id again: replaced
        PATCHES.append((patch_id, backend, phase, condition, priority, func))
        return func
    return decorator


def run_patches(*, backend: str, phase: str, extra: Optional[dict] = None, stop_on_error: bool = False,
                **context: Any) -> int:
    ctx = PatchContext(backend, phase, dict(extra or {}))
    chosen = [p for p in PATCHES if p[1] in (None, backend) and p[2] in (None, phase)
              and (p[3] is None or p[3](ctx))]
    applied = 0
    for patch_id, *_, handler in sorted(chosen, key=lambda p: p[4]):
        try:
            handler(ctx)
        except Exception as e:   # Primus: logged, and the launch goes on
            print(f"[Patch] ✗ Patch '{patch_id}' failed: {e}", file=sys.stderr)
            if stop_on_error:
                raise
            continue
        applied += 1
        APPLIED.append((phase, patch_id))
    return applied
