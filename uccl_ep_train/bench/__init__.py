"""Benchmarks: torchrun/spawn entry points printing DeepEP conventions and writing JSON records."""
from __future__ import annotations

import argparse


def add_layer_shape_args(p: argparse.ArgumentParser) -> None:
    """The MoE layer shape the benchmarks default to: DeepSeek-V3 (4096 tokens/rank, hidden 7168, 256
    experts, top-8), one definition for every benchmark that routes tokens."""
    p.add_argument("--num-tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--num-topk", type=int, default=8)
