"""`uccl-ep-train train --ranks-per-node`: nodes of consecutive ranks give the one-node run's losses."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("megatron.core")


def _losses_one_node_and_two(rank: int, world: int, device: str) -> tuple[list[float], list[float]]:
    """The tiny default train, 2 steps, as parsed from the command line: one node, then 2 nodes x 2 ranks
    (the rank's environment set as `train --ranks-per-node 2` sets it). Same seeds, same rows: same losses."""
    import torch

    from uccl_ep_train.apps.train import build_parser, train_rank, use_ranks_per_node

    os.environ.pop("UCCL_EP_RANKS_PER_NODE", None)  # the first run is one node whatever the caller set
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    curves = []
    for extra in ([], ["--ranks-per-node", "2"]):
        args = build_parser().parse_args(["--ranks", str(world), "--steps", "2", "--quiet", *extra])
        use_ranks_per_node(args.ranks_per_node)
        curves.append([r["loss"] for r in train_rank(rank, world, args, torch.device(device))])
    return curves[0], curves[1]


def test_two_emulated_nodes_match_one_node():
    # one spawn of 4 ranks runs both configurations (megatron's start-up dominates on small CPUs)
    from dist_utils import run_ranks

    for one, two in run_ranks(_losses_one_node_and_two, 4, timeout=400):
        assert len(one) == len(two) == 2
        for step, (a, b) in enumerate(zip(one, two)):
            assert abs(a - b) <= 1e-5, f"step {step + 1}: one node {a} vs 2 nodes x 2 ranks {b}"


@pytest.mark.parametrize("ranks,per_node", [(4, 3), (4, 0), (16, 16)])
def test_ranks_per_node_is_checked(ranks, per_node):
    from uccl_ep_train.apps.train import check_ranks_per_node

    with pytest.raises(SystemExit, match="--ranks-per-node must be in 1..8 and divide the number of ranks"):
        check_ranks_per_node(per_node, ranks)
    check_ranks_per_node(None, ranks)
    check_ranks_per_node(2, 4)


def test_cli_rejects_bad_ranks_per_node(monkeypatch):
    from uccl_ep_train.apps.train import main

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="divide the number of ranks"):
        main(["--ranks", "4", "--ranks-per-node", "3", "--steps", "1"])
