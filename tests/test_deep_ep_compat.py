"""`import deep_ep` resolves to uccl_ep_train through the PYTHONPATH directory or install_deep_ep()."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from uccl_ep_train.compat import deep_ep_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: uccl_ep_train importable

PROBE = textwrap.dedent('''
    import deep_ep, deep_ep.utils, deep_ep.buffer
    from deep_ep import Buffer, Config, EventOverlap
    from deep_ep.utils import EventHandle, EventOverlap as EO2
    import uccl_ep_train
    assert Buffer is uccl_ep_train.Buffer and EO2 is EventOverlap and Config is uccl_ep_train.Config
    c = Config(24, 8, 256)   # DeepEP's positional arguments
    assert c.get_nvl_buffer_size_hint(7168 * 2, 2) > 0 and c.get_rdma_buffer_size_hint(7168 * 2, 2) == 0
    try:  # is_sm90_compiled says what the native module's kernels were built for
        from uccl_ep_train import _native as N
        sm90 = bool(N.WITH_CUDA) and any(a.isdigit() and int(a) >= 90 for a in N.GPU_ARCHS.split(","))
    except ImportError:
        sm90 = False
    assert Buffer.is_sm90_compiled() is sm90
    Buffer.set_num_sms(24)
    assert Buffer.get_dispatch_config(2).num_sms == 24
    ev = Buffer.capture()
    ev.current_stream_wait()
    for name in ("get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch", "low_latency_combine",
                 "get_next_low_latency_combine_buffer", "clean_low_latency_buffer", "get_low_latency_rdma_size_hint",
                 "get_local_buffer_tensor", "get_comm_stream", "destroy"):
        assert callable(getattr(Buffer, name)), name
    print("deep_ep at", deep_ep.__file__)
''')


def test_pythonpath_directory_serves_deep_ep(tmp_path):
    env = dict(os.environ, PYTHONPATH=deep_ep_path() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "deep_ep: provided by uccl-ep-train" in r.stderr
    assert r.stderr.count("provided by uccl-ep-train") == 1, "announced once"
    assert os.path.join("uccl_ep_train", "compat", "deep_ep") in r.stdout


def test_cli_prints_the_directory():
    r = subprocess.run([sys.executable, "-m", "uccl_ep_train.apps.cli", "deep-ep-path"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == deep_ep_path()
    assert os.path.isfile(os.path.join(r.stdout.strip(), "deep_ep", "__init__.py"))


def test_install_refuses_to_shadow_an_imported_deep_ep(monkeypatch):
    import types

    from uccl_ep_train.compat import install_deep_ep
    fake = types.ModuleType("deep_ep")
    fake.__file__ = "/elsewhere/deep_ep/__init__.py"
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    with pytest.raises(RuntimeError, match="another deep_ep is already imported"):
        install_deep_ep(patch_megatron=False)


def test_install_accepts_ours_imported_through_the_path():
    """`import deep_ep` through deep_ep_path() on PYTHONPATH (how Megatron's flex dispatcher finds us), then
    install_deep_ep() (our flex backend calls it): the same file, not another DeepEP (it refused this on a GPU
    run of Megatron-LM main's pretrain_gpt.py)."""
    code = ("import deep_ep, sys; from uccl_ep_train.compat import install_deep_ep; "
            "install_deep_ep(patch_megatron=False); print(sys.modules['deep_ep'].Buffer is deep_ep.Buffer)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([deep_ep_path(), ROOT]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]


def test_one_channel_handle_derives_deepeps_channel_matrices():
    from uccl_ep_train.handles import IntranodeHandle

    prefix = torch.tensor([[2, 1, 0], [5, 1, 4], [6, 3, 4]], dtype=torch.int32)  # cumsum over source ranks
    sent = torch.tensor([2, 1, 0], dtype=torch.int32)  # this rank (1) sends 2 / 1 / 0 rows to ranks 0 / 1 / 2
    h = IntranodeHandle.with_one_channel(prefix, sent, 1, torch.zeros(3, dtype=torch.int32),
                                         torch.ones(3, 3, dtype=torch.bool), torch.zeros(3, 3, dtype=torch.int32),
                                         num_recv_tokens=3, num_tokens=3, owner=7)
    assert h.channel_prefix_matrix.tolist() == [[2], [1], [0]]
    assert h.recv_channel_prefix_matrix.tolist() == [[0], [1], [1]]  # where sources 0, 1, 2 start on rank 1
    assert h.rank_prefix_matrix is prefix and h.owner == 7 and h.private is None
