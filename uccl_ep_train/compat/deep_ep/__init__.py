"""`deep_ep`, served by uccl-ep-train: DeepEP v1.2.1's Python API on uccl_ep_train's Buffer, and DeepEP V2's
`ElasticBuffer` / `EPHandle` / `topk_idx_t` for its training path (uccl_ep_train.elastic)."""
import sys as _sys

from uccl_ep_train import Buffer, Config, EventHandle, EventOverlap, __version__ as _uccl_version
from uccl_ep_train.elastic import ElasticBuffer, EPHandle, topk_idx_t

from . import buffer, utils  # noqa: F401  (submodules callers import from)

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "ElasticBuffer", "EPHandle", "topk_idx_t"]

print(f"deep_ep: provided by uccl-ep-train {_uccl_version} (not DeepEP)", file=_sys.stderr, flush=True)
