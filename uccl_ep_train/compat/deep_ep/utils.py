"""`deep_ep.utils`: events and the NVLink connectivity check."""
from __future__ import annotations

import torch
import torch.distributed as dist

from uccl_ep_train.events import EventHandle, EventOverlap  # noqa: F401


def check_nvlink_connections(group: dist.ProcessGroup) -> None:
    """PCIe-only GPUs pair at most two ranks over NVLink (DeepEP's rule); CPU groups need nothing."""
    if torch.cuda.is_available() and "PCIE" in torch.cuda.get_device_name() and group.size() > 2:
        raise RuntimeError("check_nvlink_connections: PCIe GPUs only have pairwise NVLink connections")
