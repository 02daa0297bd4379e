"""Drop-in for `deep_ep`: code written for DeepEP (Megatron's flex dispatcher, Primus, NeMo, DeepEP's own
tests) runs on uccl_ep_train unchanged.

Two ways to opt in (a real DeepEP installation is never touched otherwise):
- `export PYTHONPATH=$(uccl-ep-train deep-ep-path):$PYTHONPATH` puts our `deep_ep` package first;
- `uccl_ep_train.compat.install_deep_ep()` registers it in `sys.modules` in-process and, if megatron-core's
  fused_a2a was already imported without DeepEP, re-binds it so the flex dispatcher's `deepep` backend runs
  on ours.

`compat.primus_turbo` is the other shape of the same offer: an EP backend that Primus-Turbo's dispatch/combine
selects by name (UCCL_EP), registered with its `register_ep_backend`.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Optional


def deep_ep_path() -> str:
    """The directory to put on PYTHONPATH so that `import deep_ep` resolves to uccl_ep_train."""
    return os.path.dirname(os.path.abspath(__file__))


def install_deep_ep(patch_megatron: bool = True) -> None:
    """Make `import deep_ep` (and `deep_ep.utils`, `deep_ep.buffer`) resolve to uccl_ep_train in this process."""
    from . import deep_ep as ours
    from .deep_ep import buffer as ours_buffer
    from .deep_ep import utils as ours_utils
    current = sys.modules.get("deep_ep")
    if current is not None and current is not ours:
        raise RuntimeError(f"install_deep_ep: another deep_ep is already imported ({current.__file__}); "
                           "call install_deep_ep() before anything imports DeepEP")
    sys.modules.update({"deep_ep": ours, "deep_ep.utils": ours_utils, "deep_ep.buffer": ours_buffer})
    if patch_megatron and "megatron.core.transformer.moe.fused_a2a" in sys.modules:
        fused = sys.modules["megatron.core.transformer.moe.fused_a2a"]
        if not fused.HAVE_DEEP_EP:
            fused = importlib.reload(fused)
            dispatcher = sys.modules.get("megatron.core.transformer.moe.token_dispatcher")
            if dispatcher is not None:
                for name in ("fused_dispatch", "fused_combine", "set_deepep_num_sms"):
                    setattr(dispatcher, name, getattr(fused, name))


def main(argv: Optional[list[str]] = None) -> int:
    """`uccl-ep-train deep-ep-path`: print the directory holding our `deep_ep` package."""
    print(deep_ep_path())
    return 0
