"""The fuzz suite on GPUs (tests/fuzz_cases.py, tests/fuzz_runner.py): a fixed sample of seeds, each one node
layout of at most SAMPLE_WORLD ranks sharing the GPU(s) under MPS, every case's outputs compared with the
reference backend and the dense oracle, plus OVERFLOW_SEEDS seeds with a case whose expert capacity
overflows a block (the capacity error on every rank; fuzz_cases.OVERFLOWS). A failure names its repro
(`scripts/fuzz_gpu.sh --seed S --case K`); long runs: `scripts/fuzz_gpu.sh --seeds N --minutes M` (README,
"Fuzz and soak tests")."""
from __future__ import annotations

import pytest

from fuzz_cases import generate, layout_of, seeds_overflowing, seeds_with
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
