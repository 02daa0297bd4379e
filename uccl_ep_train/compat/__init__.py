"""Drop-in for `deep_ep`: code written for DeepEP (Megatron's flex dispatcher, Primus, NeMo, DeepEP's own
tests) runs on uccl_ep_train unchanged.

Three ways to opt in (a real DeepEP installation is never touched otherwise):
- `export PYTHONPATH=$(uccl-ep-train deep-ep-path):$PYTHONPATH` puts our `deep_ep` package first;
- `uccl-ep-train install-deep-ep` installs a distribution named `deep_ep` whose module hands over to ours
  (compat.deep_ep_dist), for launchers that check `pip show deep_ep` or put site-packages first (primus-cli);
- `uccl_ep_train.compat.install_deep_ep()` registers it in `sys.modules` in-process and, if megatron-core's
  fused_a2a was already imported without DeepEP, re-binds it so the flex dispatcher's `deepep` backend runs
  on ours.

`compat.primus_turbo` is the other shape of the same offer: an EP backend that Primus-Turbo's dispatch/combine
selects by name (UCCL_EP), registered with its `register_ep_backend`.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Optional


# Set in the `deep_ep/__init__.py` that `uccl-ep-train install-deep-ep` installs: that module is ours too.
SHIM_MARK = "__uccl_ep_train_shim__"


def deep_ep_path() -> str:
    """The directory to put on PYTHONPATH so that `import deep_ep` resolves to uccl_ep_train."""
    return os.path.dirname(os.path.abspath(__file__))


def install_deep_ep(patch_megatron: bool = True) -> None:
    """Make `import deep_ep` (and `deep_ep.utils`, `deep_ep.buffer`) resolve to uccl_ep_train in this process."""
    from . import deep_ep as ours
    from .deep_ep import buffer as ours_buffer
    from .deep_ep import utils as ours_utils
    current = sys.modules.get("deep_ep")
    # ours already, loaded another way: through deep_ep_path() on PYTHONPATH (the same file under the name
    # `deep_ep`, a second module object: Megatron's flex imports it so), or install-deep-ep's shim
    if current is not None and current is not ours and not getattr(current, SHIM_MARK, False) \
            and not serves_deep_ep(getattr(current, "__file__", None)):
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


def deep_ep_origin() -> Optional[str]:
    """The file `import deep_ep` gives (or gave) in this process, without importing it; None when none is
    importable."""
    current = sys.modules.get("deep_ep")
    if current is not None:
        return getattr(current, "__file__", None) or repr(current)
    try:
        spec = importlib.util.find_spec("deep_ep")
    except (ImportError, ValueError):
        return None
    return None if spec is None else (spec.origin or repr(spec))


def serves_deep_ep(origin: Optional[str]) -> bool:
    """True when `origin` (deep_ep_origin()) is our deep_ep: this package's, or the one install-deep-ep put in."""
    if not origin or not os.path.isfile(origin):
        return False
    if os.path.abspath(origin) == os.path.join(deep_ep_path(), "deep_ep", "__init__.py"):
        return True
    with open(origin, errors="replace") as f:
        return SHIM_MARK in f.read(4096)


def main(argv: Optional[list[str]] = None) -> int:
    """`uccl-ep-train deep-ep-path`: print the directory holding our `deep_ep` package."""
    print(deep_ep_path())
    return 0
