"""`deep_ep`, served by uccl-ep-train: DeepEP v1.2.1's Python API on uccl_ep_train's Buffer."""
import sys as _sys

from uccl_ep_train import Buffer, Config, EventHandle, EventOverlap, __version__ as _uccl_version

from . import buffer, utils  # noqa: F401  (submodules callers import from)

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap"]

print(f"deep_ep: provided by uccl-ep-train {_uccl_version} (not DeepEP)", file=_sys.stderr, flush=True)
