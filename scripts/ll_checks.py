"""The low-latency checks of tests/test_buffer_ll.py (every LL mode against the oracle) on 2 ranks.

    python scripts/ll_checks.py RANKS_PER_NODE RUNS [DEVICE]   the checks, RUNS times; DEVICE cuda (default):
                                                               one rank per GPU, no MPS; cpu: the reference path
    python scripts/ll_checks.py canary                         each rank makes one failing CUDA call on purpose

Spawned ranks by default (one spawn per run). With torchrun's variables set (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) this process is that one rank and runs the RUNS in one group: scripts/sanitize_ll.sh starts
each rank under a compute-sanitizer of its own that way, after the canary, whose deliberate error (cuDeviceGet
of an ordinal no host has) each rank's sanitizer must report: a clean report proves nothing about a process
the sanitizer does not watch."""
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from dist_utils import run_ranks, run_this_rank  # noqa: E402
from test_buffer_ll import _check_ll  # noqa: E402

CHECK_ARGS = (9, 512, 8, 3)  # _check_ll's seed, hidden, experts per rank, top-k


def _canary(rank: int, world: int, device: str) -> int:
    """A CUDA driver call that fails on purpose, harmlessly (nothing is allocated or launched); this rank's
    process id."""
    torch.cuda.init()
    rc = ctypes.CDLL("libcuda.so.1").cuDeviceGet(ctypes.byref(ctypes.c_int()), 1 << 20)
    if rc == 0:
        raise RuntimeError("ll_checks canary: cuDeviceGet accepted ordinal 2**20")
    return os.getpid()


def _repeat(rank: int, world: int, device: str, runs: int) -> list:
    """This rank's share of `runs` runs of the checks in one group (a rank started on its own)."""
    return [_check_ll(rank, world, device, *CHECK_ARGS) for _ in range(runs)]


if __name__ == "__main__":  # (the spawned ranks import this module again)
    own = "RANK" in os.environ
    if sys.argv[1] == "canary":
        got = (run_this_rank(_canary, device="cuda", backend="gloo") if own else
               run_ranks(_canary, 2, device="cuda", backend="gloo", timeout=120))
        print(f"canary: ranks' process ids {got}", flush=True)
        sys.exit(0)
    per_node, runs = sys.argv[1], int(sys.argv[2])
    device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
    env = {"UCCL_EP_RANKS_PER_NODE": per_node, "UCCL_EP_TIMEOUT_S": "120"}
    if own:  # (gloo: CUDA tensors in the ranks, as the MPS tests run them)
        print(f"rank {os.environ['RANK']}: {run_this_rank(_repeat, runs, device=device, backend='gloo', env=env)}",
              flush=True)
        sys.exit(0)
    for i in range(runs):
        got = run_ranks(_check_ll, 2, *CHECK_ARGS, device=device, backend="gloo", timeout=900, env=env)
        print(f"run {i}: {got}", flush=True)
