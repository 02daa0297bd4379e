"""Events for overlapping communication with compute (DeepEP's EventHandle / EventOverlap).

On CUDA an EventHandle is a CUDA event recorded on a stream. On CPU (gloo) the reference backend
completes its work before returning, so the handle is already complete; the same calls work on both, so
code written for GPUs (async_finish, previous_event, `with event:`) runs unchanged on CPU ranks.
Also the raw handle of a device's current stream, the form our kernels take, and the host <-> GPU copies of
small values that calls make next to their kernels (page-locked, never pageable: `host_values` says why).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch


_get_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent on CPU-only builds


def current_raw_stream(device_index: Optional[int] = None) -> int:
    """The handle of the current stream of a device (default: the current one), as the kernels take it:
    without building a torch.cuda.Stream object, which costs more host time than a kernel launch."""
    index = torch.cuda.current_device() if device_index is None else device_index
    if _get_raw_stream is not None:
        return _get_raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def capturing() -> bool:
    """Whether the current stream is being captured into a CUDA graph (cheap: no device query when CUDA was
    never initialised in this process, so nothing can be capturing)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def host_values(t: torch.Tensor) -> list:
    """A small tensor's values as a Python list, read once the current stream's earlier work is done: an event
    recorded after it is awaited first, so the copy itself waits for nothing. Never `t.tolist()` / `.cpu()` on
    a GPU tensor with kernels queued before it: a copy into (or out of) pageable memory holds the CUDA driver
    while it waits for its stream, and other threads of the process then wait in their own copy calls. The
    fabric transport's proxy threads make such calls (libfabric's shm and tcp providers copy GPU memory with
    cudaMemcpy): were the stream's earlier kernels waiting for those proxies (an internode combine), nothing
    would move until they time out (docs/internode.md, "Host copies and the fabric transport"). Measured on an
    H200 (tests/test_host_copies_gpu.py), a 1 MB device-to-device copy issued by another thread while this
    thread's stream ran a 1 s kernel: done at once while this thread awaited an event; done only after the
    kernel while this thread copied through pageable memory."""
    await_current_stream(t.device)
    return t.tolist()


def await_current_stream(device: Any) -> None:
    """Waits until the work queued so far on `device`'s current stream ran, through an event (a no-op on CPU):
    what a host read of GPU values must do first (host_values says why)."""
    if torch.device(device).type == "cuda":
        EventHandle(torch.cuda.current_stream(device)).synchronize()


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the GPU, copied on the current stream from page-locked memory, without holding the
    driver while earlier kernels run (`host_values`). The caching host allocator keeps the page-locked block
    until the copy ran and hands it out again: only the first call of a size allocates (cudaHostAlloc, which
    does wait for the device), and calls that repeat their sizes (every dispatch's counts) reuse it. A CPU
    `device` gets a plain copy."""
    if torch.device(device).type != "cuda":
        return torch.from_numpy(a).to(device)
    return torch.from_numpy(a).pin_memory().to(device, non_blocking=True)


class EventHandle:
    """A point in a stream's work: CUDA event where CUDA is in use, an already-complete marker on CPU."""

    def __init__(self, stream: Optional["torch.cuda.Stream"] = None) -> None:
        self.event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """The current stream waits for this point (a no-op on CPU, where work is already done)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def stream_wait(self, stream: "torch.cuda.Stream") -> None:
        if self.event is not None:
            stream.wait_event(self.event)

    def query(self) -> bool:
        return True if self.event is None else self.event.query()

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class EventOverlap:
    """DeepEP's wrapper: `event.current_stream_wait()` or `with event: ...` overlaps work with the comm.

    `extra_tensors` keeps tensors alive until the event is waited on (graph-safe `record_stream`).
    """

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is None:
            raise RuntimeError("EventOverlap.current_stream_wait: no event (the call was not made with async_finish)")
        self.event.current_stream_wait()
        self.extra_tensors = None

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
            self.extra_tensors = None
