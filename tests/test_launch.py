"""Loopback rendezvous ports: free, on 127.0.0.1, and outside the OS's ephemeral range when possible."""
from __future__ import annotations

import socket

import pytest

from uccl_ep_train.apps import launch


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    low = launch._ephemeral_low()
    for _ in range(5):
        port = launch.free_loopback_port()
        if low > launch._LOWEST_PORT:
            assert launch._LOWEST_PORT <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_busy_candidates_are_skipped(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        monkeypatch.setattr(launch, "_LOWEST_PORT", busy)
        monkeypatch.setattr(launch, "_ephemeral_low", lambda: busy + 1)  # the only candidate is busy
        assert launch.free_loopback_port() != busy  # so the OS picks one


def test_a_listener_on_another_loopback_address_blocks_the_port(monkeypatch):
    """A port held on [::1] only (127.0.0.1 is free) is still busy for a store listening on the wildcard."""
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with s:
        s.listen()
        busy = s.getsockname()[1]
        assert not launch._unbound(busy)
        monkeypatch.setattr(launch, "_LOWEST_PORT", busy)
        monkeypatch.setattr(launch, "_ephemeral_low", lambda: busy + 1)
        assert launch.free_loopback_port() != busy
