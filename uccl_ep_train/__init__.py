"""uccl-ep-train: portable expert-parallel dispatch/combine for MoE training (UCCL-EP, DeepEP-compatible).

Public API (DeepEP v1.2.1 call surface): `Buffer`, `Config`, `EventOverlap`, `EventHandle`,
`initialize_uccl` / `destroy_uccl`; autograd pairing in `uccl_ep_train.autograd`; DeepEP V2's
`ElasticBuffer` call shapes for the training path in `uccl_ep_train.elastic`.
"""
__version__ = "0.1.0"

from .config import Config  # noqa: E402
from .events import EventHandle, EventOverlap  # noqa: E402
from .buffer import Buffer  # noqa: E402
from .runtime import initialize_uccl, destroy_uccl  # noqa: E402

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "initialize_uccl", "destroy_uccl", "__version__"]
