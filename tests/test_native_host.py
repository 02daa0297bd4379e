"""Host-side helpers of the native backend that need no GPU."""
import pytest
import torch

from uccl_ep_train.backends.native import _aligned


def test_views_that_start_mid_allocation_are_copied_to_aligned_memory():
    base = torch.arange(64, dtype=torch.uint8)
    view = base[1:33]  # a contiguous view 1 byte into its storage: 16-byte vector loads would fault
    out = _aligned(view)
    assert out.data_ptr() % 16 == 0 and torch.equal(out, view)
    assert _aligned(base) is base  # aligned and contiguous: no copy
    t = torch.arange(12.0).view(3, 4).t()  # non-contiguous
    assert torch.equal(_aligned(t), t) and _aligned(t).is_contiguous()


def test_expected_width_is_the_uniform_routing_fold_width():
    from math import comb

    from uccl_ep_train.backends.native import _expected_width

    for k, e, r in [(8, 256, 2), (8, 256, 8), (4, 16, 4), (1, 4, 2), (6, 6, 3)]:
        epr = e // r
        p_any = 1 - comb(e - epr, k) / comb(e, k)
        assert abs(_expected_width(k, e, r) - (k / r) / p_any) < 1e-9
    assert round(_expected_width(8, 256, 2), 2) == 4.01 and round(_expected_width(8, 256, 8), 2) == 1.51


class _Sms:
    """Stands in for a NativeBackend in _fuse (only the SM count is asked for)."""

    def __init__(self, sms):
        self.sms = sms

    def _num_sms(self, config):
        return self.sms


def test_fuse_decision(monkeypatch):
    from uccl_ep_train.backends.native import NativeBackend

    fuse = NativeBackend._fuse
    monkeypatch.delenv("UCCL_EP_FUSE_MAX_WIDTH", raising=False)
    assert fuse(_Sms(20), 1.5, 8, dispatch=False, config=None)  # narrow rows: fold inside combine
    assert not fuse(_Sms(20), 4.0, 8, dispatch=False, config=None)  # wide: separate reduce (measured faster)
    assert not fuse(_Sms(20), 4.0, 8, dispatch=True, config=None)
    assert fuse(_Sms(32), 4.0, 8, dispatch=True, config=None)  # dispatches fuse from 32 SMs on
    assert not fuse(_Sms(32), 4.0, 8, dispatch=False, config=None)
    assert fuse(_Sms(64), 4.0, 8, dispatch=False, config=None)  # the fold fuses from 64 SMs on
    assert not fuse(_Sms(32), 1.0, 33, dispatch=True, config=None)  # > 32 slots: one lane per slot
    monkeypatch.setenv("UCCL_EP_FUSE_MAX_WIDTH", "0")
    assert not fuse(_Sms(64), 1.0, 8, dispatch=True, config=None)
    monkeypatch.setenv("UCCL_EP_FUSE_MAX_WIDTH", "1e9")
    assert fuse(_Sms(8), 8.0, 8, dispatch=False, config=None)
    monkeypatch.setenv("UCCL_EP_FUSE_MAX_WIDTH", "wide")
    with pytest.raises(ValueError, match="UCCL_EP_FUSE_MAX_WIDTH"):
        fuse(_Sms(8), 8.0, 8, dispatch=False, config=None)


def test_combine_push_warps_follow_the_sm_count():
    """Fewer combine push warps per block as blocks grow (bench intranode push-warp sweep); bounds inclusive."""
    from uccl_ep_train.backends import native

    assert [native._by_sms(native._COMBINE_PUSH_WARPS, n) for n in (8, 16, 17, 24, 25, 32, 132)] == \
        [8, 8, 6, 6, 4, 4, 4]


def test_side_blocks_decision(monkeypatch):
    from uccl_ep_train.backends.native import NativeBackend

    sms = _Sms(32)
    sms._device_sms = 132
    side = NativeBackend._side_blocks
    for var in ("UCCL_EP_FOLD_BLOCKS", "UCCL_EP_EXPAND_BLOCKS"):
        monkeypatch.delenv(var, raising=False)
        sms.sms = 32
        assert side(sms, var, None) == 100  # the SMs the kernel leaves free work beside it
        sms.sms = 128
        assert side(sms, var, None) == 0  # too few free SMs: none
        monkeypatch.setenv(var, "6")
        assert side(sms, var, None) == 4  # capped at what is free
        monkeypatch.setenv(var, "0")
        assert side(sms, var, None) == 0
        monkeypatch.setenv(var, "-1")
        with pytest.raises(ValueError, match=var):
            side(sms, var, None)


def test_expand_plan(monkeypatch):
    from uccl_ep_train.backends.native import NativeBackend

    monkeypatch.delenv("UCCL_EP_FUSE_MAX_WIDTH", raising=False)
    monkeypatch.delenv("UCCL_EP_EXPAND_BLOCKS", raising=False)
    b = _Sms(32)
    b._device_sms = 132
    b._side_blocks = lambda var, config: NativeBackend._side_blocks(b, var, config)
    b._fuse = lambda *a, **k: NativeBackend._fuse(b, *a, **k)
    plan = NativeBackend._expand_plan
    assert plan(b, 4.0, 8, None) == (False, 100)  # wide rows: expand blocks, whatever the SM count
    assert plan(b, 1.5, 8, None) == (True, 0)  # narrow rows: inside the copy-out
    assert plan(b, 1.0, 33, None) == (False, 0)  # > 32 slots: separate kernels
    monkeypatch.setenv("UCCL_EP_EXPAND_BLOCKS", "0")
    assert plan(b, 4.0, 8, None) == (True, 0)  # no expand blocks: the SM rule fuses from 32 SMs
    b.sms = 24
    assert plan(b, 4.0, 8, None) == (False, 0)


def test_fold_blocks_take_wide_rows_before_the_sm_rule(monkeypatch):
    from uccl_ep_train.backends.native import NativeBackend

    monkeypatch.delenv("UCCL_EP_FUSE_MAX_WIDTH", raising=False)
    fuse = NativeBackend._fuse
    assert fuse(_Sms(64), 4.0, 8, dispatch=False, config=None)  # no fold blocks: the fold fuses from 64 SMs
    assert not fuse(_Sms(64), 4.0, 8, dispatch=False, config=None, by_sms=False)  # fold blocks instead
    assert fuse(_Sms(64), 1.5, 8, dispatch=False, config=None, by_sms=False)  # narrow rows still fuse




def test_gpu_targets_follow_the_setting_or_the_gpus_present(monkeypatch):
    import native_build

    native_build.gpu_archs.cache_clear()
    monkeypatch.setenv("UCCL_EP_CUDA_ARCHS", "90,100")
    monkeypatch.setenv("UCCL_EP_HIP_ARCHS", "gfx950")
    assert native_build.gpu_archs("cuda") == ("90", "100") and native_build.gpu_archs("hip") == ("gfx950",)
    native_build.gpu_archs.cache_clear()
    monkeypatch.delenv("UCCL_EP_CUDA_ARCHS")
    monkeypatch.delenv("UCCL_EP_HIP_ARCHS")
    import torch
    if not torch.cuda.is_available():  # no GPU: Hopper, and AMD's MI300 / MI350
        assert native_build.gpu_archs("cuda") == ("90",) and native_build.gpu_archs("hip") == ("gfx942", "gfx950")
    native_build.gpu_archs.cache_clear()


def test_a_rocm_torch_picks_hipcc(monkeypatch):
    import types

    import native_build

    monkeypatch.delenv("UCCL_EP_GPU", raising=False)
    monkeypatch.setattr(native_build, "_torch", lambda: types.SimpleNamespace(version=types.SimpleNamespace(hip="6.4")))
    monkeypatch.setattr(native_build, "_hipcc", lambda: "/opt/rocm/bin/hipcc")
    monkeypatch.setattr(native_build, "_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    assert native_build.find_gpu_compiler() == ("hip", "/opt/rocm/bin/hipcc")
    monkeypatch.setattr(native_build, "_torch", lambda: None)
    assert native_build.find_gpu_compiler() == ("cuda", "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(native_build, "_nvcc", lambda: None)
    assert native_build.find_gpu_compiler() == ("hip", "/opt/rocm/bin/hipcc")  # hipcc found without a setting
