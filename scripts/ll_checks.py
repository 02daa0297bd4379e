"""The low-latency checks of tests/test_buffer_ll.py (every LL mode against the oracle) on 2 spawned ranks.

    python scripts/ll_checks.py RANKS_PER_NODE RUNS [DEVICE]   the checks, RUNS times; DEVICE cuda (default):
                                                               one rank per GPU, no MPS; cpu: the reference path
    python scripts/ll_checks.py canary                         each rank makes one failing CUDA call on purpose

The canary's error (cuDeviceGet of an ordinal no host has) is what scripts/sanitize_ll.sh makes the sanitizer
report once per rank before it trusts a clean report: one proves nothing about a process it does not watch."""
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from dist_utils import run_ranks  # noqa: E402
from test_buffer_ll import _check_ll  # noqa: E402


def _canary(rank: int, world: int, device: str) -> int:
    """A CUDA driver call that fails on purpose, harmlessly (nothing is allocated or launched); this rank's
    process id."""
    torch.cuda.init()
    rc = ctypes.CDLL("libcuda.so.1").cuDeviceGet(ctypes.byref(ctypes.c_int()), 1 << 20)
    if rc == 0:
        raise RuntimeError("ll_checks canary: cuDeviceGet accepted ordinal 2**20")
    return os.getpid()


if __name__ == "__main__":  # (the spawned ranks import this module again)
    if sys.argv[1] == "canary":
        got = run_ranks(_canary, 2, device="cuda", backend="gloo", timeout=120)
        print(f"canary: ranks' process ids {got}", flush=True)
        sys.exit(0)
    per_node, runs = sys.argv[1], int(sys.argv[2])
    device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
    for i in range(runs):  # (gloo: CUDA tensors in the ranks, as the MPS tests run them)
        got = run_ranks(_check_ll, 2, 9, 512, 8, 3, device=device, backend="gloo", timeout=900,
                        env={"UCCL_EP_RANKS_PER_NODE": per_node, "UCCL_EP_TIMEOUT_S": "120"})
        print(f"run {i}: {got}", flush=True)
