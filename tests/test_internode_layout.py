"""The internode buffer layout (`_native.internode_layout`, computed once in C++ and used by senders for their
peers' offsets): segment sizes agree between every sender and its RDMA peer, areas are disjoint and in order,
and the notify area is the same for every op (peers send count rows before any READY). CPU only; needs the
native module built with a GPU compiler (the layout lives with the kernels)."""
import random

import pytest

try:
    from uccl_ep_train import _native
except ImportError:  # pure-Python install
    _native = None

pytestmark = pytest.mark.skipif(_native is None or not hasattr(_native, "internode_layout"),
                                reason="native module without the internode path")


def _layout(rd, R, L, rank, x_bytes=0, scale_bytes=0, topk=0, y_bytes=0, recv_rows=0):
    return _native.internode_layout(rd, R, L, rank, x_bytes, scale_bytes, topk, y_bytes, recv_rows)


@pytest.mark.parametrize("R,L", [(2, 1), (4, 2), (6, 2), (8, 4), (6, 1)])
def test_senders_and_receivers_agree(R, L):
    rng = random.Random(R * 10 + L)
    N = R // L
    rd = [rng.randrange(0, 300) for _ in range(R * N)]  # rd[s * N + n]: tokens rank s sends to node n
    for op in ({"x_bytes": 14336, "scale_bytes": 224, "topk": 8}, {"y_bytes": 14336, "topk": 8}):
        for s in range(R):
            mine = _layout(rd, R, L, s, **op)
            # this rank's segment for node n holds exactly its tokens for n
            assert [b - a for a, b in zip(mine["send_row0"], mine["send_row0"][1:])] == rd[s * N:(s + 1) * N]
            for n in range(N):
                peer = _layout(rd, R, L, n * L + s % L, **op)
                # ... and the RDMA peer's receive segment for this rank's node has room for exactly them
                seg = peer["recv_row0"][s // L + 1] - peer["recv_row0"][s // L]
                assert seg == rd[s * N + n], (op, s, n)
            areas = mine["areas"]
            assert areas == sorted(areas) and areas[0] == 0, areas
            row, crow = mine["row_bytes"], mine["crow_bytes"]
            assert areas[2] - areas[1] >= mine["send_row0"][-1] * row
            assert areas[3] - areas[2] >= mine["recv_row0"][-1] * row
            assert areas[4] - areas[3] >= mine["recv_row0"][-1] * crow
            assert areas[5] - areas[4] >= mine["send_row0"][-1] * crow


def test_notify_area_is_the_same_for_every_op():
    rd = [5, 7, 9, 11]
    dispatch = _layout(rd, 2, 1, 0, x_bytes=1024, topk=4)
    combine = _layout(rd, 2, 1, 0, y_bytes=1024, topk=4)
    assert dispatch["areas"][1] == combine["areas"][1] > 0  # count rows end where the ops' areas begin
    assert dispatch["row_bytes"] % 16 == 0 and combine["crow_bytes"] % 16 == 0


@pytest.mark.parametrize("R,L", [(2, 1), (6, 2), (16, 8)])
def test_notify_area_holds_two_outgoing_rows_and_two_parities_of_incoming_ones(R, L):
    """A notify's outgoing row alternates by parity as its incoming slots do (notify_rows says why: the row of
    the notify before may still be on its way): 2 + 2R count rows before the ops' areas."""
    stride = 4 * _native.internode_count_row_ints(R, int(_native.INTERNODE_MAX_EXPERTS), L)
    rd = [1] * (R * (R // L))
    assert _layout(rd, R, L, 0, x_bytes=1024, topk=4)["areas"][1] >= stride * (2 + 2 * R)


def test_bad_topology_is_an_error_naming_it():
    with pytest.raises(Exception, match="ranks per node 3 must divide 4"):
        _layout([0] * 8, 4, 3, 0, x_bytes=16)


@pytest.mark.parametrize("R,L", [(4, 2), (6, 2), (16, 8)])
def test_rdma_size_hint_covers_every_routing(monkeypatch, R, L):
    """Config.get_rdma_buffer_size_hint with num_tokens is what the kernels' layout needs in the worst case
    (every token to every node), so no routing of that many tokens needs more: a Buffer made with it never
    grows. Nodes come from UCCL_EP_RANKS_PER_NODE, as at run time (emulated nodes included)."""
    from uccl_ep_train import Config

    monkeypatch.setenv("UCCL_EP_RANKS_PER_NODE", str(L))
    T, K, H = 300, 8, 7168 * 2
    c = Config(24, 8, 256)
    hint = c.get_rdma_buffer_size_hint(H, R, T, K)
    N = R // L
    full = [T] * (R * N)
    assert hint == max(_layout(full, R, L, 0, x_bytes=H, topk=K)["rdma_bytes"],
                       _layout(full, R, L, 0, y_bytes=H, topk=K)["rdma_bytes"])
    rng = random.Random(R)
    for _ in range(5):
        rd = [rng.randrange(0, T + 1) for _ in range(R * N)]
        for s in range(R):
            for op in ({"x_bytes": H, "topk": K}, {"x_bytes": H // 2, "scale_bytes": H // 256, "topk": K},
                       {"y_bytes": H, "topk": K}):
                assert _layout(rd, R, L, s, **op)["rdma_bytes"] <= hint
    assert c.get_rdma_buffer_size_hint(H, R) > 0  # DeepEP's two arguments: its channel-ring sizing
    assert c.get_rdma_buffer_size_hint(H, L, T, K) == 0  # one node: no RDMA traffic
    with pytest.raises(ValueError, match="num_tokens"):
        c.get_rdma_buffer_size_hint(H, R, -1)
