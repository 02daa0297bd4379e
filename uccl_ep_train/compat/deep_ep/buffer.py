"""`deep_ep.buffer`: the Buffer class (uccl_ep_train's)."""
from uccl_ep_train.buffer import Buffer  # noqa: F401
from uccl_ep_train.config import Config  # noqa: F401
from uccl_ep_train.events import EventOverlap  # noqa: F401
