"""Host-side helpers of the native backend that need no GPU."""
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
