"""Co-residency: the native intranode dispatch and combine complete while another stream's kernel holds the
SMs their side blocks (expansion / fold blocks beside the communication SMs) would use.

One rank on the whole GPU starts a kernel on another stream that holds every SM but the call's num_sms and
releases them only once the call has completed. A launch that needs its side blocks resident (the
communication blocks waiting for them) can therefore not finish: it would stall until its timeout (measured:
the kernels before SideWork did). The results must equal the reference backend's.

(Several ranks on one GPU under MPS, each limited to its share with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, do not
make a sharp test: there a plain dispatch, which needs only its num_sms SMs, did not complete with exactly
num_sms SMs left to each rank, so the SMs a rank really gets at the edge are not known.)"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks

NUM_SMS = 16
HELD_SECONDS = 15.0  # a call that has not completed by then waits for the held SMs: the test fails


def _run_held(holder, blocks, group, fn):
    """fn() while `blocks` SMs are held on another stream (on every rank at once) -> (result, completed)."""
    holder.start(blocks)
    holder.wait_running(blocks)
    dist.barrier(group)
    out = fn()
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + HELD_SECONDS
    while not done.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    completed = done.query()
    holder.stop()
    torch.cuda.synchronize()
    return out, completed


def _held_calls(rank, world, device):
    from sm_holder import SmHolder
    from test_native_intranode import _make_buffers, _same
    from uccl_ep_train import Config

    group = dist.new_group(list(range(world)))
    ref, nat = _make_buffers(group)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    holder = SmHolder(total)
    capacity = holder.resident_capacity(total)
    assert capacity == total, f"a holder block per SM: {capacity} of {total} became resident"
    held = total - NUM_SMS
    # the expansion and fold on side blocks (every free SM by default), not inside the kernels
    cfg = Config(NUM_SMS, fuse_max_width=0)
    # what the calls below occupy: their num_sms and, by default, every other SM as side blocks
    assert nat.occupied_sms(cfg, expert_major=True) == {"communication": NUM_SMS, "side": held, "total": total}
    assert nat.occupied_sms(cfg) == {"communication": NUM_SMS, "side": 0, "total": NUM_SMS}
    assert ref.occupied_sms(cfg, expert_major=True) is None
    experts, topk, hidden, n = 16 * world, 8, 2048, 1024 + 37 * rank
    g = torch.Generator().manual_seed(7 + rank)
    idx = torch.topk(torch.rand((n, experts), generator=g), topk, dim=1).indices.cuda()
    w = torch.rand((n, topk), generator=g).cuda()
    x = torch.randn((n, hidden), generator=g).to(torch.bfloat16).cuda()
    x2 = torch.randn((n, hidden), generator=g).to(torch.bfloat16).cuda()

    want = ref.dispatch_expert_major(x, idx, w, experts, config=cfg)
    rows = sum(want[3])
    want_cached, _ = ref.dispatch_expert_major_cached(x2, want[5], want[4], rows, config=cfg)
    y_em = torch.randn((rows, hidden), generator=g).to(torch.bfloat16).cuda()
    want_y, _, _ = ref.combine_expert_major(y_em, want[5], want[4], config=cfg)

    got, ok = _run_held(holder, held, group, lambda: nat.dispatch_expert_major(x, idx, w, experts, config=cfg))
    nat.backend.check_errors()
    assert ok, f"rank {rank}: the dispatch did not complete while {held} SMs were held"
    assert got[3] == want[3], f"rank {rank}: tokens per expert {got[3]} != {want[3]}"
    for i, what in ((0, "x_em"), (1, "recv_topk_idx"), (2, "recv_topk_weights"), (4, "em_map")):
        _same(got[i].cpu(), want[i].cpu(), f"rank {rank}: dispatch {what}")

    (cached, _), ok = _run_held(holder, held, group,
                                lambda: nat.dispatch_expert_major_cached(x2, got[5], got[4], rows, config=cfg))
    nat.backend.check_errors()
    assert ok, f"rank {rank}: the cached dispatch did not complete while {held} SMs were held"
    _same(cached.cpu(), want_cached.cpu(), f"rank {rank}: cached x_em")

    (y, _, _), ok = _run_held(holder, held, group, lambda: nat.combine_expert_major(y_em, got[5], got[4], config=cfg))
    nat.backend.check_errors()
    assert ok, f"rank {rank}: the combine did not complete while {held} SMs were held"
    torch.testing.assert_close(y.float(), want_y.float(), rtol=1e-2, atol=1e-2, msg=f"rank {rank}: combine")
    ref.destroy()
    nat.destroy()
    return held


@pytest.mark.gpu
def test_side_blocks_need_not_be_resident():
    from uccl_ep_train.backends.native import native_available

    if not native_available():
        pytest.skip("native module built without intranode kernels")
    held = run_ranks(_held_calls, 1, device="cuda", backend="gloo", ranks_per_gpu=1,
                     env={"UCCL_EP_TIMEOUT_S": "30"}, timeout=300)
    assert held[0] > 0


def _occupied(rank, world, device):
    from uccl_ep_train import Buffer, Config

    buf = Buffer(dist.new_group(list(range(world))), 1 << 20)
    out = buf.occupied_sms(Config(8), expert_major=True), buf.occupied_sms()
    buf.destroy()
    return out


def test_reference_backend_runs_no_kernels_of_its_own():
    assert run_ranks(_occupied, 2) == [(None, None)] * 2
