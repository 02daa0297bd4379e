"""Stand-ins that let megatron-core run on CPU-only gloo ranks (the embedded default: no GPU, no NIC).

megatron-core assumes CUDA in a few places that do not matter for correctness on one CPU stream:
stream/event objects, `torch.cuda.current_device()` as an allocation device, CUDA RNG state, a causal
mask built on 'cuda', and tensor split sizes handed to `all_to_all_single` (gloo wants lists). Each shim
is installed only when CUDA is absent, and only once.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

_installed = False


class _CpuStream:
    """A CUDA stream stand-in: CPU work is already ordered, so every wait is a no-op."""

    def __init__(self, *args, **kwargs) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuEvent:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT = _CpuStream()


def _split_list(v):
    return v.tolist() if isinstance(v, torch.Tensor) else v


def install() -> bool:
    """Install the shims when CUDA is unavailable; returns whether they are active."""
    global _installed
    if torch.cuda.is_available():
        return False
    if _installed:
        return True
    torch.cuda.Stream = _CpuStream
    torch.cuda.Event = _CpuEvent
    torch.cuda.current_stream = lambda device=None: _CURRENT
    torch.cuda.default_stream = lambda device=None: _CURRENT
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.get_rng_state = lambda device=None: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)

    original_a2a = dist.all_to_all_single

    @functools.wraps(original_a2a)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        return original_a2a(output, input, _split_list(output_split_sizes), _split_list(input_split_sizes),
                            *args, **kwargs)

    dist.all_to_all_single = all_to_all_single

    try:
        import megatron.core.transformer.utils as mutils
    except ImportError:
        pass
    else:
        @functools.lru_cache(maxsize=None)
        def get_default_causal_mask(sq: int) -> torch.Tensor:
            return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

        mutils.get_default_causal_mask = get_default_causal_mask
    try:
        import megatron.core.tensor_parallel.random as mrandom
    except ImportError:
        pass
    else:  # the RNG tracker forks the "CUDA" generator: on CPU ranks that is the CPU generator
        mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
        mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    _installed = True
    return True
