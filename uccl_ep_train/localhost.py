"""Loopback rendezvous for the ranks our commands spawn themselves (train, bench): never another host."""
from __future__ import annotations

import socket


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_init_method() -> str:
    """A torch.distributed init_method on 127.0.0.1 with a free port."""
    return f"tcp://127.0.0.1:{free_loopback_port()}"
