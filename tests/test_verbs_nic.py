"""The verbs transport on a real RDMA NIC (skipped where there is none): one rank whose QP to itself loops
through the NIC writes host or GPU memory and applies atomics. Checks the bytes and counters that land, that
the log names the GID choice and the GPU registration method, and that the settings reach the QPs (a bad
one fails before anything connects). Run on a machine with a NIC (and a GPU for the GPU case)."""
import numpy as np
import pytest

from uccl_ep_train import proxy as P

native = pytest.importorskip("uccl_ep_train._native")
pytestmark = pytest.mark.skipif(not P.available() or "verbs" not in P.compiled_transports()
                                or not native.verbs_devices(), reason="no RDMA NIC (or verbs not compiled in)")

N = 1 << 16


def _loopback(region, counters, capfd):
    with P.ProxyGroup(0, 1, {0: region, 1: counters}, transport="verbs", num_threads=1, pin_threads=False,
                      timeout_s=60) as g:
        g.push(0, P.make_commands([(P.OP_WRITE_IMM, 0, 0, 0, N // 2, 0, N // 2),
                                   (P.OP_ATOMIC_ADD, 0, 0, 1, 5, 0, 8),
                                   (P.OP_BARRIER, 0, 0, 0, 0, 0, 0)]))
        g.wait_seq(0, 0, 3, timeout_s=60, phase="verbs loopback")
        g.check()
        assert g.imm_count(0, 0) == 1
    return capfd.readouterr().err


def test_host_memory_loopback_through_the_nic(capfd):
    buf = np.zeros(N, np.uint8)
    buf[: N // 2] = (np.arange(N // 2) % 251 + 1).astype(np.uint8)
    counters = np.zeros(4, np.int64)
    err = _loopback(buf, counters, capfd)
    assert np.array_equal(buf[N // 2:], buf[: N // 2]) and counters[1] == 5
    assert "GID" in err and "timeout 20" in err  # the chosen GID and the QP settings are logged


@pytest.mark.gpu
def test_gpu_memory_registers_and_receives_through_the_nic(capfd):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    buf = torch.zeros(N, dtype=torch.uint8, device="cuda")
    buf[: N // 2] = (torch.arange(N // 2, device="cuda") % 251 + 1).to(torch.uint8)
    torch.cuda.synchronize()
    counters = np.zeros(4, np.int64)
    err = _loopback(buf, counters, capfd)
    torch.cuda.synchronize()
    assert torch.equal(buf[N // 2:], buf[: N // 2]) and counters[1] == 5
    assert "registered on" in err and ("peer memory" in err or "DMA-BUF" in err)  # the method used is named


def test_a_bad_qp_setting_fails_before_connecting(monkeypatch):
    monkeypatch.setenv("UCCL_IB_TIMEOUT", "40")
    with pytest.raises(Exception, match=r"UCCL_IB_TIMEOUT=40 must be an integer in \[1, 31\]"):
        P.ProxyGroup(0, 1, {0: np.zeros(64, np.uint8)}, transport="verbs", num_threads=1, pin_threads=False)
