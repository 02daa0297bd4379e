"""The message text of a rank's abort (docs/api.md "Errors", "aborted").

A rank that raises inside a collective call after its peers may have started it (a refusal in the native
binding, a check of received sizes, a failed allocation) aborts: its native buffer writes an "aborted" record
into every node peer's error board and raises their claim words (csrc/kernels/abort.h), so their kernels stop
within milliseconds. The record names the rank and the call; the sentence the rank raised travels here, through
the store of the default process group (the one the ranks met at, which needs no collective): one key per
(group, Buffer creation number, rank). A peer that stopped on the record reads it for a short while and
falls back to "see rank R's log" when it does not come (a store that is gone, a rank that died first).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

import torch.distributed as dist

log = logging.getLogger("uccl_ep_train")

# How long a peer waits for the aborting rank's message: it writes it before its record leaves, so it is
# normally there at once; longer only when the store is slow or gone.
READ_BOUND_S = 0.5
# How long the aborting rank waits for its own write: the abort record follows it, and a store that is up but
# stalled must not hold that back (the peers then read "see rank R's log").
WRITE_BOUND_S = 1.0


def _store() -> Optional[Any]:
    """The default group's store, None without one (a process group made without init_process_group)."""
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def message_key(group: Any, sequence: int, rank: int) -> str:
    """The store key of `rank`'s abort message on the Buffer made `sequence`-th on `group` (the same on every
    rank: agreement.py checks the creation numbers)."""
    name = getattr(group, "group_name", "") or "default"
    return f"uccl_ep_train/abort/{name}/{sequence}/{rank}"


def publish_message(group: Any, sequence: int, rank: int, message: str, bound_s: float = WRITE_BOUND_S) -> None:
    """Leaves this rank's abort message for its peers, waiting at most `bound_s` seconds for the store (the
    write goes on in a daemon thread past that); a store that fails or stalls only costs them the text."""
    store = _store()
    if store is None:
        return

    def write() -> None:
        try:
            store.set(message_key(group, sequence, rank), message.encode("utf-8", "replace"))
        except RuntimeError as exc:  # the store's server left (rank 0 died): the peers fall back to the log
            log.warning("uccl_ep_train: rank %d could not leave its abort message in the store: %s", rank, exc)

    writer = threading.Thread(target=write, name="uccl_ep_train-abort-message", daemon=True)
    writer.start()
    writer.join(bound_s)
    if writer.is_alive():
        log.warning("uccl_ep_train: rank %d's abort message was not written to the store within %.1f s; its abort "
                    "goes on without waiting for it", rank, bound_s)


def read_message(group: Any, sequence: int, rank: int, bound_s: float = READ_BOUND_S) -> Optional[str]:
    """`rank`'s abort message, or None when it is not in the store within `bound_s` seconds."""
    store = _store()
    if store is None:
        return None
    key = message_key(group, sequence, rank)
    deadline = time.monotonic() + bound_s
    try:
        while not store.check([key]):
            if time.monotonic() >= deadline:
                log.warning("uccl_ep_train: rank %d's abort message was not in the store within %.1f s (key %s)",
                            rank, bound_s, key)
                return None
            time.sleep(0.005)
        return store.get(key).decode("utf-8", "replace")
    except RuntimeError as exc:
        log.warning("uccl_ep_train: reading rank %d's abort message from the store failed: %s", rank, exc)
        return None
