"""Host-side helpers of the native backend that need no GPU."""
import dataclasses
import types

import pytest
import torch

from uccl_ep_train import Config
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
    """Stands in for a NativeBackend in the policy methods (only the SM counts are asked for)."""

    def __init__(self, sms, device_sms=132):
        self.sms = sms
        self._device_sms = device_sms

    def _num_sms(self, config):
        return self.sms


def test_fuse_decision():
    from uccl_ep_train.backends.native import NativeBackend

    fuse, auto = NativeBackend._fuse, Config()
    assert fuse(_Sms(20), 1.5, 8, dispatch=False, config=auto)  # narrow rows: fold inside combine
    assert not fuse(_Sms(20), 4.0, 8, dispatch=False, config=auto)  # wide: separate reduce (measured faster)
    assert not fuse(_Sms(20), 4.0, 8, dispatch=True, config=auto)
    assert fuse(_Sms(32), 4.0, 8, dispatch=True, config=auto)  # dispatches fuse from 32 SMs on
    assert not fuse(_Sms(32), 4.0, 8, dispatch=False, config=auto)
    assert fuse(_Sms(64), 4.0, 8, dispatch=False, config=auto)  # the fold fuses from 64 SMs on
    assert not fuse(_Sms(32), 1.0, 33, dispatch=True, config=auto)  # > 32 slots: one lane per slot
    # Config.fuse_max_width replaces the rule, SM counts included
    assert not fuse(_Sms(64), 1.0, 8, dispatch=True, config=Config(fuse_max_width=0))
    assert fuse(_Sms(8), 8.0, 8, dispatch=False, config=Config(fuse_max_width=1e9))
    assert not fuse(_Sms(8), 1.0, 33, dispatch=False, config=Config(fuse_max_width=1e9))  # but not the lanes


def test_combine_push_warps_follow_the_sm_count():
    """Fewer combine push warps per block as blocks grow (bench intranode push-warp sweep); bounds inclusive."""
    from uccl_ep_train.backends import native

    assert [native._by_sms(native._COMBINE_PUSH_WARPS, n) for n in (8, 16, 17, 24, 25, 32, 132)] == \
        [8, 8, 6, 6, 4, 4, 4]


def test_push_warps_take_the_config_over_the_default():
    from uccl_ep_train.backends.native import NativeBackend

    for warps_per_block, default in ((16, 12), (8, 6)):  # CUDA's blocks, HIP's (defaults are for 16 warps)
        b = _Sms(24)
        b._native = types.SimpleNamespace(INTRANODE_WARPS_PER_BLOCK=warps_per_block)
        assert NativeBackend._push_warps(b, None, 12) == default
        assert NativeBackend._push_warps(b, 3, 12) == 3
        assert NativeBackend._push_warps(b, 40, 12) == warps_per_block  # at most the block's warps


def test_side_blocks_decision():
    from uccl_ep_train.backends.native import NativeBackend

    sms = _Sms(32)
    side = NativeBackend._side_blocks
    assert side(sms, None, Config(32)) == 100  # the SMs the kernel leaves free work beside it
    sms.sms = 128
    assert side(sms, None, Config(128)) == 0  # too few free SMs: none
    assert side(sms, 6, Config(128)) == 4  # capped at what is free
    assert side(sms, 0, Config(128)) == 0


def _planner(sms):
    from uccl_ep_train.backends.native import NativeBackend

    b = _Sms(sms)
    b._side_blocks = lambda chosen, config: NativeBackend._side_blocks(b, chosen, config)
    b._fuse = lambda *a, **k: NativeBackend._fuse(b, *a, **k)
    return lambda width, topk, config: NativeBackend._expand_plan(b, width, topk, config)


def test_expand_plan():
    plan = _planner(32)
    assert plan(4.0, 8, Config(32)) == (False, 100)  # wide rows: expand blocks, whatever the SM count
    assert plan(1.5, 8, Config(32)) == (True, 0)  # narrow rows: inside the copy-out
    assert plan(1.0, 33, Config(32)) == (False, 0)  # > 32 slots: separate kernels
    assert plan(4.0, 8, Config(32, expand_blocks=0)) == (True, 0)  # no expand blocks: fused from 32 SMs
    assert plan(4.0, 8, Config(32, expand_blocks=5)) == (False, 5)
    assert plan(4.0, 8, Config(32, fuse_max_width=1e9)) == (True, 0)  # fused wins over expand blocks
    assert plan(4.0, 8, Config(32, fuse_max_width=0, expand_blocks=0)) == (False, 0)  # separate kernels
    assert _planner(24)(4.0, 8, Config(24, expand_blocks=0)) == (False, 0)


def test_fold_blocks_take_wide_rows_before_the_sm_rule():
    from uccl_ep_train.backends.native import NativeBackend

    fuse, auto = NativeBackend._fuse, Config()
    assert fuse(_Sms(64), 4.0, 8, dispatch=False, config=auto)  # no fold blocks: the fold fuses from 64 SMs
    assert not fuse(_Sms(64), 4.0, 8, dispatch=False, config=auto, by_sms=False)  # fold blocks instead
    assert fuse(_Sms(64), 1.5, 8, dispatch=False, config=auto, by_sms=False)  # narrow rows still fuse


def test_tuning_knobs_are_config_fields_not_environment_settings(monkeypatch):
    """The knobs left the environment: a leftover variable changes nothing (doctor names it as read by
    nothing: tests/test_doctor.py), and each field refuses a value the kernels cannot run, naming itself."""
    from uccl_ep_train.backends.native import NativeBackend

    for var, val in (("UCCL_EP_FUSE_MAX_WIDTH", "0"), ("UCCL_EP_EXPAND_BLOCKS", "0")):
        monkeypatch.setenv(var, val)
    assert _planner(32)(4.0, 8, Config(32)) == (False, 100)
    assert NativeBackend._fuse(_Sms(20), 1.5, 8, dispatch=False, config=Config())
    with pytest.raises(TypeError):
        Config(24, 6, 256, 6, 128, 12)  # DeepEP's five stay the only positional fields
    bad = {"dispatch_push_warps": 0, "combine_push_warps": -1, "flag_batch": 0, "combine_flag_batch": 1.5,
           "combine_kernel": 3, "expand_blocks": -1, "fold_blocks": True, "fuse_max_width": float("nan")}
    assert set(bad) == {f.name for f in dataclasses.fields(Config) if f.kw_only}  # every knob, checked
    for field, value in bad.items():
        with pytest.raises(ValueError, match=f"^Config.{field} must be"):
            Config(**{field: value})
    with pytest.raises(ValueError, match="^Config.combine_kernel must be 1 or 2, got 3$"):
        Config(combine_kernel=3)
    ok = Config(24, 6, 256, dispatch_push_warps=16, combine_push_warps=1, flag_batch=1, combine_flag_batch=10 ** 6,
                combine_kernel=2, expand_blocks=0, fold_blocks=3, fuse_max_width=float("inf"))
    assert ok.num_sms == 24 and ok.combine_kernel == 2 and Config().fuse_max_width is None


def test_the_header_carries_whether_ids_hold_expert_major_positions():
    """Whether a fresh expert-major dispatch expands inside the kernel decides the id words' format (senders
    pack positions into them): it travels in the shape header, so ranks whose Configs decide differently get
    the same error before any row moves, instead of misreading each other's ids."""
    from uccl_ep_train.backends.native import check_same_shape, shape_header

    x, idx, w = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2)
    plain, in_kernel = shape_header(x, None, idx, w, 8), shape_header(x, None, idx, w, 8, expert_major_ids=True)
    assert plain[4] == 1 and in_kernel[4] == 3 and shape_header(x, None, idx, None, 8, expert_major_ids=True)[4] == 2
    assert [v for i, v in enumerate(plain) if i != 4] == [v for i, v in enumerate(in_kernel) if i != 4]
    pytest.importorskip("uccl_ep_train._native")  # (check_same_shape names the fields from it)
    check_same_shape([in_kernel, in_kernel])
    with pytest.raises(ValueError, match="dispatch: ranks disagree on .*: rank 0=3, rank 1=1"):
        check_same_shape([in_kernel, plain])


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


@pytest.mark.parametrize("copies_through_cuda", [True, False])
def test_a_timeout_on_proxies_that_copy_through_cuda_names_pageable_host_copies(copies_through_cuda):
    """On fabric over shm or tcp the likeliest cause of a timeout is a pageable host copy issued while the
    call's kernels ran (it holds the proxies' CUDA copies back): the error says so, and only there. Every
    unexplained timeout quotes the proxies' state line (where the missing operation stopped)."""
    from uccl_ep_train.backends.native import PAGEABLE_COPY_HINT, recorded_errors

    class Proxy:
        calls_gpu_runtime = copies_through_cuda
        error = ""

        def check(self):
            if self.error:
                raise RuntimeError(self.error)

        def state_line(self):
            return "this rank's proxies: 1 held for an earlier one"

    timed_out = "rank 0 (node 0) timed out after 20 s in 'combine (reduce)' waiting for rank 1 (node 1)"
    recorded = types.SimpleNamespace(error=lambda: timed_out)
    silent = types.SimpleNamespace(error=lambda: "")
    assert (PAGEABLE_COPY_HINT in recorded_errors(recorded, Proxy())) == copies_through_cuda
    assert (PAGEABLE_COPY_HINT in recorded_errors(silent, Proxy(), raised=timed_out)) == copies_through_cuda
    assert "1 held for an earlier one" in recorded_errors(recorded, Proxy())
    assert recorded_errors(silent, Proxy()) == ""  # nothing recorded, nothing raised: no hint either
    assert recorded_errors(recorded, None) == timed_out  # no proxies (one node): the kernels' text alone
    dead = Proxy()
    dead.error = "rank 1 proxy thread 0: fi_writedata: Connection refused"
    assert recorded_errors(recorded, dead) == f"{timed_out}; proxy: {dead.error}"  # the recorded cause, no guess
