"""Transport selection and failure modes: clear errors when a transport cannot run here, and the
runtime hook (`initialize_uccl` -> `start_proxies`) starting and stopping proxies."""
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("FI_PROVIDER", "tcp")
os.environ.setdefault("FI_TCP_IFACE", "lo")

from uccl_ep_train import proxy as P  # noqa: E402

pytestmark = pytest.mark.skipif(not P.available(), reason="native module not built")


def test_unknown_transport_is_a_value_error():
    with pytest.raises(ValueError, match="transport must be"):
        P.ProxyGroup(0, 1, {0: np.zeros(64, np.uint8)}, transport="carrier-pigeon")


def test_verbs_without_nic_says_so():
    from uccl_ep_train import _native
    if "verbs" not in P.compiled_transports():
        with pytest.raises(RuntimeError, match="not compiled in"):
            P.ProxyGroup(0, 1, {0: np.zeros(64, np.uint8)}, transport="verbs")
        return
    if _native.verbs_devices():
        pytest.skip("this machine has RDMA devices")
    with pytest.raises(RuntimeError, match="no RDMA devices"):
        P.ProxyGroup(0, 1, {0: np.zeros(64, np.uint8)}, transport="verbs")


def test_ipc_needs_a_gpu():
    with pytest.raises(RuntimeError, match="needs a GPU|not compiled in|needs CUDA"):
        P.ProxyGroup(0, 1, {0: np.zeros(64, np.uint8)}, transport="ipc", gpu=-1)


def test_bad_options_are_rejected_before_anything_starts():
    buf = np.zeros(64, np.uint8)
    with pytest.raises(RuntimeError, match="UCCL_EP_PROXY_THREADS"):
        P.ProxyGroup(0, 1, {0: buf}, transport="fabric", num_threads=0)
    with pytest.raises(RuntimeError, match="power of two"):
        P.ProxyGroup(0, 1, {0: buf}, transport="fabric", ring_capacity=1000)
    with pytest.raises(ValueError, match="rank 2 out of range"):
        P.ProxyGroup(2, 2, {0: buf})
    with pytest.raises(TypeError, match="regions"):
        P.ProxyGroup(0, 1, {0: "not a buffer"}, transport="fabric")


def test_proxies_can_be_rebuilt_in_one_process_and_close_is_idempotent():
    if "fabric" not in P.compiled_transports():
        pytest.skip("fabric transport not built")
    buf = np.zeros(1 << 12, np.uint8)
    for _ in range(3):
        g = P.ProxyGroup(0, 1, {0: buf}, transport="fabric", num_threads=2, pin_threads=False)
        g.push(1, P.make_commands([(P.OP_WRITE_IMM, 0, 1, 0, 8, 0, 64)]))
        g.wait_seq(0, 1, 1, timeout_s=20)
        g.close()
        g.close()


def test_config_says_what_each_endpoint_opened(monkeypatch):
    """`config()["opened"]`: the provider and domain the fabric transport's fi_info names, per thread (the
    setting "tcp" is an alias; with none, libfabric picks), the same selection `fabric_probe` runs."""
    if "fabric" not in P.compiled_transports():
        pytest.skip("fabric transport not built")
    from uccl_ep_train import _native
    for provider in ("tcp", ""):
        monkeypatch.setenv("FI_PROVIDER", provider)
        probe = _native.fabric_probe(provider, "", False)
        assert probe["provider"] and probe["domain"]
        with P.ProxyGroup(0, 1, {0: np.zeros(64, np.uint8)}, transport="fabric", num_threads=2, pin_threads=False) as g:
            assert g.config()["provider"] == provider
            assert g.config()["opened"] == [{"provider": probe["provider"], "device": probe["domain"]}] * 2
            assert g.config()["calls_gpu_runtime"] is False  # host memory: no GPU runtime in the progress


def test_runtime_hook_starts_and_stops_proxies(monkeypatch):
    if "fabric" not in P.compiled_transports():
        pytest.skip("fabric transport not built")
    from uccl_ep_train.runtime import destroy_uccl, initialize_uccl
    scratch = torch.zeros(4096, dtype=torch.uint8)
    proxies, workers = initialize_uccl(scratch, 2048, 0, 1)
    assert proxies == [] and workers == []  # CPU scratch: nothing to start unless asked
    destroy_uccl(proxies, workers)
    monkeypatch.setenv("UCCL_EP_START_PROXIES", "1")
    monkeypatch.setenv("UCCL_EP_TRANSPORT", "fabric")
    proxies, workers = initialize_uccl(scratch, 2048, 0, 1, num_threads=1, pin_threads=False)
    try:
        assert len(proxies) == 1 and proxies[0].num_threads == 1
        g = proxies[0]
        g.push(0, P.make_commands([(P.OP_WRITE_IMM, 0, 0, 0, 16, 0, 1024)]))
        g.wait_seq(0, 0, 1, timeout_s=20)
        with pytest.raises(RuntimeError, match="exceeds region size"):
            g.push(0, P.make_commands([(P.OP_WRITE, 0, 0, 0, 16, 0, 2040)]))  # region is num_rdma_bytes long
            import time
            for _ in range(300):
                if g.stats()["rejected"]:
                    break
                time.sleep(0.01)
            g.check()
    finally:
        destroy_uccl(proxies, workers)
