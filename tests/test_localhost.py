"""Loopback rendezvous ports: free, on 127.0.0.1, and outside the OS's ephemeral range when possible."""
from __future__ import annotations

import socket

from uccl_ep_train import localhost


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    low = localhost._ephemeral_low()
    for _ in range(5):
        port = localhost.free_loopback_port()
        if low > localhost._LOWEST_PORT:
            assert localhost._LOWEST_PORT <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_busy_candidates_are_skipped(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        monkeypatch.setattr(localhost, "_LOWEST_PORT", busy)
        monkeypatch.setattr(localhost, "_ephemeral_low", lambda: busy + 1)  # the only candidate is busy
        assert localhost.free_loopback_port() != busy  # so the OS picks one
