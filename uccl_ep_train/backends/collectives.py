"""torch.distributed collectives with deadlines: a peer that never arrives ends in an error that names
this rank, the phase and the peers, after UCCL_EP_TIMEOUT_S, instead of a silent hang.

Host-side waits (gloo, and every exchange whose result the host reads) poll the work object against the
deadline. Payload exchanges on NCCL stay stream-ordered (no host wait), so they are bounded by the NCCL
process group's own timeout/watchdog.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from ..config import timeout_s
from ..errors import exchange_failed, exchange_timed_out


class CommTimeoutError(TimeoutError):
    pass


def wait_work(work: Optional[dist.Work], rank: int, phase: str, host_wait: bool, channel: str = "-") -> None:
    if work is None:
        return
    if not host_wait:
        work.wait()
        return
    limit = timeout_s()
    deadline = time.monotonic() + limit
    sleep = 0.0
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise CommTimeoutError(exchange_timed_out(rank, phase, channel, limit))
        time.sleep(sleep)
        sleep = min(sleep * 2 + 1e-5, 1e-3)
    try:
        work.wait()
    except Exception as exc:
        raise RuntimeError(exchange_failed(rank, phase, channel, exc)) from exc


class Comm:
    """The few collectives the reference backend needs, on one group, each with a named phase."""

    def __init__(self, group: dist.ProcessGroup, rank: int, num_ranks: int, device: torch.device) -> None:
        self.group, self.rank, self.num_ranks, self.device = group, rank, num_ranks, device
        self.host_wait_payload = device.type != "cuda"

    def all_gather(self, t: torch.Tensor, phase: str) -> torch.Tensor:
        """[*] -> [num_ranks, *]; the host always waits (its result sizes the next step)."""
        out = [torch.empty_like(t) for _ in range(self.num_ranks)]
        work = dist.all_gather(out, t.contiguous(), group=self.group, async_op=True)
        wait_work(work, self.rank, phase, host_wait=True)
        return torch.stack(out)

    def all_to_all_rows(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int], phase: str,
                        async_op: bool = False):
        """Exchange rows of a 2-D uint8 tensor. Returns the received rows, or (rows, finish) with async_op."""
        row = send.size(1) if send.dim() == 2 else 0
        recv = torch.empty((sum(recv_counts), row), dtype=send.dtype, device=send.device)
        work = dist.all_to_all_single(recv.view(-1), send.contiguous().view(-1),
                                      output_split_sizes=[c * row for c in recv_counts],
                                      input_split_sizes=[c * row for c in send_counts],
                                      group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            wait_work(work, self.rank, phase, host_wait=self.host_wait_payload)
            return recv

        return (recv, finish) if async_op else finish()

    def barrier(self, phase: str) -> None:
        self.all_gather(torch.zeros(1, dtype=torch.int32, device=self.device), phase)
