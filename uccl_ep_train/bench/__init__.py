"""Benchmarks: torchrun/spawn entry points printing DeepEP conventions and writing JSON records."""
