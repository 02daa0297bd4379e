"""The low-latency checks of tests/test_buffer_ll.py (every LL mode against the oracle) on 2 ranks, RUNS times:
python scripts/ll_checks.py RANKS_PER_NODE RUNS [DEVICE]. DEVICE cuda (default): one rank per GPU, no MPS (so
that compute-sanitizer can follow the ranks: scripts/sanitize_ll.sh); cpu: the reference path."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from dist_utils import run_ranks  # noqa: E402
from test_buffer_ll import _check_ll  # noqa: E402

if __name__ == "__main__":  # (the spawned ranks import this module again)
    per_node, runs = sys.argv[1], int(sys.argv[2])
    device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
    for i in range(runs):  # (gloo: CUDA tensors in the ranks, as the MPS tests run them)
        got = run_ranks(_check_ll, 2, 9, 512, 8, 3, device=device, backend="gloo", timeout=900,
                        env={"UCCL_EP_RANKS_PER_NODE": per_node, "UCCL_EP_TIMEOUT_S": "120"})
        print(f"run {i}: {got}", flush=True)
