"""The fuzz suite on GPUs (tests/fuzz_cases.py, tests/fuzz_runner.py): a fixed sample of seeds, each one node
layout of at most SAMPLE_WORLD ranks sharing the GPU(s) under MPS, every case's outputs compared with the
reference backend and the dense oracle, plus OVERFLOW_SEEDS seeds with a case whose expert capacity
overflows a block (the capacity error on every rank; fuzz_cases.OVERFLOWS). A failure names its repro
(`scripts/fuzz_gpu.sh --seed S --case K`); long runs: `scripts/fuzz_gpu.sh --seeds N --minutes M` (README,
"Fuzz and soak tests")."""
from __future__ import annotations

import pytest

from fuzz_cases import case, generate, layout_of, seeds_overflowing, seeds_with
from fuzz_runner import run_cases

pytestmark = [pytest.mark.gpu]

SAMPLE_SEEDS, SAMPLE_WORLD, OVERFLOW_SEEDS = 4, 6, 1


def _missing(nodes: int) -> str:
    from uccl_ep_train.backends.low_latency import low_latency_available
    from uccl_ep_train.backends.native import native_available

    if not native_available():
        return "native module without GPU kernels"
    if nodes > 1:
        from test_internode_gpu import _ready

        return _ready() or ""
    return "" if low_latency_available() else "native module without the low-latency kernels"


@pytest.mark.parametrize("seed", seeds_with(SAMPLE_SEEDS, SAMPLE_WORLD) +
                         seeds_overflowing(OVERFLOW_SEEDS, SAMPLE_WORLD))
def test_fuzz_sample(mps, seed):
    why = _missing(layout_of(seed)[0])
    if why:
        pytest.skip(why)
    cases = generate(seed)
    got = run_cases(cases, sut="native", timeout=600)
    assert len(got) == cases[0].world and all(len(per_rank) == len(cases) for per_rank in got)


# Cases the long runs found, kept: (2, 2) asked an LL expert for more rows of one rank than max_tokens (the
# generator now stays within it); (14, 2) and (15, 6) are sync-free dispatches (num_worst_tokens) whose ranks hold
# different token counts: the rank with the most grew its buffer alone and its peers went on to their next call;
# (41, 4) overflows an expert capacity in a sync-free expert-major dispatch on a Buffer that had to grow: the grow
# came after notify and dropped the error notify had recorded, so the refused rows moved (now: sized first).
FOUND = [(2, 2), (14, 2), (15, 6), (41, 4)]


@pytest.mark.parametrize("seed,index", FOUND, ids=[f"seed{s}-case{i}" for s, i in FOUND])
def test_fuzz_found(mps, seed, index):
    c = case(seed, index)
    why = _missing(c.nodes)
    if why:
        pytest.skip(why)
    got = run_cases([c], sut="native", timeout=300)
    assert len(got) == c.world and all(len(per_rank) == 1 for per_rank in got)
