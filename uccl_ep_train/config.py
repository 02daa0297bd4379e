"""Performance configuration (`Config`: DeepEP's positional arguments, then our kernels' tuning knobs) and
UCCL_* environment settings.

`Config(num_sms, nvl_chunk, nvl_buffer[, rdma_chunk, rdma_buffer])` carries the SM count and chunk sizes
of the high-throughput kernels. The reference backend ignores them (it has no kernels); the native
backend reads them. Defaults per rank count come from `DEFAULT_DISPATCH` / `DEFAULT_COMBINE`, tables that
the intranode benchmark's tuning sweep writes (never hand edits in buffer code). The keyword-only fields
tune the native intranode kernels per call (docs/api.md, "Config"); None leaves the choice to the backend.
"""
from __future__ import annotations

import math
import os
from dataclasses import KW_ONLY, dataclass
from typing import Mapping, Optional, Sequence

from .topology import ranks_per_node_from_env

# Worst-case per-token metadata our kernels stage next to a token: up to 128 top-k (int64 id + float
# weight), up to 128 float scales, and a 16-byte source record.
_MAX_TOPK = 128
_MAX_SCALES = 128
_TOKEN_META_BYTES = _MAX_TOPK * (8 + 4) + _MAX_SCALES * 4 + 16
NUM_MAX_NVL_PEERS = 8


# SMs of a high-throughput call when nobody says otherwise: DeepEP's Buffer.num_sms (Buffer.set_num_sms
# changes it for the default configs; Megatron's dispatcher sets its own, megatron_patch/settings.py).
DEFAULT_NUM_SMS = 20


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_at_least(low: int):
    return lambda v: _is_int(v) and v >= low


def _width(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and not math.isnan(v) and v >= 0


_POSITIVE = (_int_at_least(1), "a positive int (or None)")
_COUNT = (_int_at_least(0), "an int >= 0 (or None)")
# Config's knobs: name -> (whether a value other than None is valid, what it must be)
_KNOB_RANGES = {
    "dispatch_push_warps": _POSITIVE,
    "combine_push_warps": _POSITIVE,
    "flag_batch": _POSITIVE,
    "combine_flag_batch": _POSITIVE,
    "combine_kernel": (lambda v: _is_int(v) and v in (1, 2), "1 or 2"),
    "expand_blocks": _COUNT,
    "fold_blocks": _COUNT,
    "fuse_max_width": (_width, "a number >= 0 (or None)"),
}


@dataclass(frozen=True)
class Config:
    """Kernel tuning: DeepEP's Config (positional), then keyword-only knobs of the native intranode kernels.

    Each knob is None by default: the native backend then picks what backends/native.py measured best for the
    call (most follow the SM count). docs/api.md ("Config") says what each does and which must agree across
    ranks."""

    num_sms: int = DEFAULT_NUM_SMS
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 128
    _: KW_ONLY
    dispatch_push_warps: Optional[int] = None  # warps per block that push in the dispatch (the rest copy out)
    combine_push_warps: Optional[int] = None  # the same for the combine (the rest reduce)
    flag_batch: Optional[int] = None  # rows a dispatch push warp sends between two fences
    combine_flag_batch: Optional[int] = None  # the same for the combine
    combine_kernel: Optional[int] = None  # 1: reduce through registers, 2: staged through shared memory
    expand_blocks: Optional[int] = None  # side blocks of an expert-major dispatch (0: none)
    fold_blocks: Optional[int] = None  # side blocks of an expert-major combine (0: none)
    fuse_max_width: Optional[float] = None  # up to this fold width the kernels expand / fold themselves

    def __post_init__(self) -> None:
        for name in ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                     "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"):
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise ValueError(f"Config.{name} must be a positive int, got {v!r}")
        if self.num_max_nvl_chunked_send_tokens > self.num_max_nvl_chunked_recv_tokens:
            raise ValueError("Config: num_max_nvl_chunked_send_tokens must be <= num_max_nvl_chunked_recv_tokens")
        self._check_knobs()

    def _check_knobs(self) -> None:
        """The knobs' ranges (None always passes): a bad value fails here, naming the field, not at a call."""
        for name, (ok, what) in _KNOB_RANGES.items():
            v = getattr(self, name)
            if v is not None and not ok(v):
                raise ValueError(f"Config.{name} must be {what}, got {v!r}")

    @property
    def num_channels(self) -> int:
        return max(self.num_sms // 2, 1)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer a Buffer needs for tokens of `hidden_bytes` at `num_ranks` ranks."""
        if hidden_bytes <= 0 or num_ranks <= 0:
            raise ValueError(f"get_nvl_buffer_size_hint: hidden_bytes ({hidden_bytes}) and num_ranks ({num_ranks}) must be > 0")
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = self.num_channels * nvl_ranks * self.num_max_nvl_chunked_recv_tokens
        counters = self.num_channels * nvl_ranks * 4 * 8
        return _align(counters + slots * (hidden_bytes + _TOKEN_META_BYTES), 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, num_tokens: Optional[int] = None,
                                  num_topk: int = _MAX_TOPK) -> int:
        """Bytes of RDMA buffer for the internode path (0 when all ranks share one node).

        A node holds UCCL_EP_RANKS_PER_NODE (else LOCAL_WORLD_SIZE, else 8) ranks. With `num_tokens` (tokens
        per rank, at most `num_topk` experts each) it is exactly what the native internode kernels need for
        a dispatch and a combine of that many tokens under any routing, from the layout they use: a Buffer
        made with it never grows. Without it (DeepEP's two arguments) it is DeepEP's channel-ring sizing;
        our buffers then grow, collectively and once per larger batch, when a call needs more (a warning
        names the size to pass)."""
        if hidden_bytes <= 0 or num_ranks <= 0:
            raise ValueError(f"get_rdma_buffer_size_hint: hidden_bytes ({hidden_bytes}) and num_ranks ({num_ranks}) must be > 0")
        if num_tokens is not None and (num_tokens < 0 or num_topk <= 0):
            raise ValueError(f"get_rdma_buffer_size_hint: num_tokens ({num_tokens}) must be >= 0 and num_topk "
                             f"({num_topk}) > 0")
        per_node = min(ranks_per_node_from_env() or NUM_MAX_NVL_PEERS, num_ranks)
        if num_ranks <= per_node:
            return 0
        if num_tokens is not None:
            from . import sizing

            if sizing.layouts_available():
                return sizing.internode_worst_need(num_tokens, hidden_bytes, num_ranks, per_node, num_topk)[0]
        rdma_ranks = -(-num_ranks // per_node)
        slots = self.num_channels * rdma_ranks * self.num_max_rdma_chunked_recv_tokens * 2  # send + recv
        return _align(slots * (hidden_bytes + _TOKEN_META_BYTES) + self.num_channels * rdma_ranks * 64, 128)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a



# Defaults per number of ranks: (nvl_chunk, nvl_buffer, rdma_chunk, rdma_buffer); num_sms comes from
# Buffer.num_sms. Rank counts not listed take the nearest smaller entry.
DEFAULT_DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (16, 288, 20, 128),
                    32: (16, 288, 32, 128), 64: (16, 288, 28, 128)}
DEFAULT_COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                   32: (1, 288, 8, 128), 64: (1, 288, 20, 128)}


def default_config(table: dict, num_sms: int, num_ranks: int) -> Config:
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be > 0, got {num_ranks}")
    keys = sorted(k for k in table if k <= num_ranks) or [min(table)]
    return Config(num_sms, *table[keys[-1]])


def default_nvl_bytes(hidden_bytes: int, num_ranks: int, num_sms: int = DEFAULT_NUM_SMS,
                      combine_bytes: Optional[int] = None) -> int:
    """NVLink bytes for dispatched rows of `hidden_bytes` (and combined rows of `combine_bytes`, default the
    same) at `num_ranks` ranks: the larger of the default dispatch and combine configs' size hints (what the
    uccl dispatcher and ElasticBuffer make their Buffers with). Our native backends open that much and grow
    when a call needs more (uccl_ep_train.sizing)."""
    combine = hidden_bytes if combine_bytes is None else combine_bytes
    return max(default_config(DEFAULT_DISPATCH, num_sms, num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks),
               default_config(DEFAULT_COMBINE, num_sms, num_ranks).get_nvl_buffer_size_hint(combine, num_ranks))


def env_number(name: str, default, cast=float):
    """A numeric setting from the environment (`cast` int or float); a malformed value is an error, not 0."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a valid {cast.__name__}") from None


def timeout_s() -> float:
    """UCCL_EP_TIMEOUT_S: how long any wait for peers may take before it fails with a named error."""
    return env_number("UCCL_EP_TIMEOUT_S", 300.0)


# Every environment setting the library and its native module read: name -> (default, meaning). The README's
# settings table lists the same names (tests/test_doctor.py checks both against the code); `uccl-ep-train
# doctor` prints the ones set and names any UCCL_* variable that nothing reads.
SETTINGS: dict[str, tuple[str, str]] = {
    # choice of path
    "UCCL_EP_BACKEND": ("auto", "`auto`, `reference` or `native`"),
    "UCCL_EP_DEVICE": ("cpu on gloo groups", "`cuda`: a gloo group's Buffers keep CUDA tensors (ranks sharing a GPU)"),
    "UCCL_EP_RANKS_PER_NODE": ("LOCAL_WORLD_SIZE, else ranks per host", "ranks per node (1-8; emulated nodes)"),
    "UCCL_EP_ALLOW_SHARED_GPU": ("0", "`1`: ranks may share a GPU without MPS (debugging only: ~5 ms per hand-over)"),
    # errors
    "UCCL_EP_TIMEOUT_S": ("300", "any wait for peers fails after this long, naming rank, channel and phase"),
    "UCCL_EP_CHECK_VALUES": ("unset: on the host unless the kernels check them", "`1`: check values on the host before any communication (a sync per call), `0`: never"),
    "UCCL_EP_FAULT": ("off", "fault injection: `reorder=P,delay_us=D,seed=S,die_after=N` (docs/proxy.md)"),
    # proxies and transports
    "UCCL_EP_TRANSPORT": ("by NIC kind: ipc on one host, fabric (efa) on EFA, verbs on RC NICs, fabric (tcp) without", "`ipc`, `verbs` or `fabric` (docs/proxy.md)"),
    "UCCL_EP_NICS": ("by PCI topology: the GPU's PCIe switch, else NUMA node", "NICs per local rank: `0=mlx5_0;1-2=mlx5_1,mlx5_2;*=mlx5_3`, or `mlx5_0,mlx5_1` / `^mlx5_8` to filter (docs/proxy.md)"),
    "UCCL_EP_PROXY_THREADS": ("4 (ranks sharing a GPU: by cores)", "proxy threads (channels) per rank"),
    "UCCL_EP_DISABLE_CPU_AFFINITY": ("0", "`1`: do not pin proxy threads to cores near the GPU"),
    "UCCL_EP_RDMA_CHUNK_BYTES": ("2 MiB on a NIC, 8 MiB on ipc", "bytes per internode write"),
    "UCCL_EP_START_PROXIES": ("0", "`1`: start proxies on CPU runs too (initialize_uccl)"),
    "UCCL_EP_RING_PUBLISH": ("by CPU", "`fence` or `vector`: how the GPU publishes ring commands"),
    "UCCL_RDMA_ADAPTIVE_SLEEP": ("0 with GPUs, 1 on CPU runs", "`1`: idle proxy threads sleep instead of spinning"),
    "UCCL_EP_VERBS_DEVICE": ("unset (UCCL_EP_NICS)", "one RDMA device for every rank: the older form of `UCCL_EP_NICS=*=DEV`"),
    "UCCL_EP_VERBS_NATIVE_ATOMICS": ("0", "`1`: RDMA atomics instead of the ordered emulation"),
    # verbs QP settings (NCCL_IB_* twins: slurm/launch.sh copies those over; read by csrc/transport/verbs_policy.cpp,
    # whose defaults tests/test_verbs_policy.py checks against the first number of each default here)
    "UCCL_IB_GID_INDEX": ("-1 (choose: RoCE v2 IPv4-mapped, else RoCE v2 IPv6; InfiniBand 0)", "GID table entry (RoCE)"),
    "UCCL_IB_SL": ("0", "InfiniBand service level"),
    "UCCL_IB_TC": ("0", "traffic class (RoCE: DSCP << 2)"),
    "UCCL_IB_TIMEOUT": ("20", "ACK timeout 4.096 us * 2^value per try (20: ~4.3 s; NCCL's default)"),
    "UCCL_IB_RETRY_CNT": ("7", "transport retries before completion error 12 (retry exceeded)"),
    "UCCL_IB_RNR_RETRY": ("6", "receiver-not-ready retries, 10 ms apart (7 = forever: a stalled peer would hang "
                                "the sender instead of failing with its name)"),
    # flow control (defaults per NIC vendor: NIC_FLOW_CONTROL below)
    "UCCL_IB_MAX_INFLIGHT_NORMAL": ("8 (Thor-2, Pollara: 1)", "writes in flight per (proxy thread, destination)"),
    "UCCL_IB_MAX_INFLIGHT_LOW_LATENCY": ("32", "the same for low-latency proxies"),
    "UCCL_IB_MAX_INFLIGHT_BYTES": ("0 = no limit (Thor-2: 1572864, Pollara: 2097152)",
                                   "bytes in flight per (proxy thread, destination)"),
    "UCCL_EP_FABRIC_CQ_DATA_BYTES": ("what the provider offers (8, efa 4)", "`4` packs rank and immediate into 4 bytes of CQ data on any provider (tests EFA's layout); `8` insists on 8 bytes (refused where the provider has 4)"),
    "UCCL_EP_DEBUG_FABRIC": ("0", "`1`: the fabric transport logs its setup"),
}


@dataclass(frozen=True)
class NicFlowControl:
    """In-flight limits a NIC family needs from the proxy (UCCL_IB_MAX_INFLIGHT_BYTES / _NORMAL)."""

    vendor: str
    pci_vendor_id: int  # as ibv_device_attr.vendor_id reports it (bnxt_re and ionic give the PCI vendor id)
    max_inflight_bytes: int
    max_inflight_normal: int

    def env(self) -> dict[str, str]:
        return {"UCCL_IB_MAX_INFLIGHT_BYTES": str(self.max_inflight_bytes),
                "UCCL_IB_MAX_INFLIGHT_NORMAL": str(self.max_inflight_normal)}


# RDMA NICs whose RC path needs strict flow control, by verbs driver (the device name's prefix): UCCL-EP's
# limits for them; without them the fabric drops under load and senders end in completion error 12 (retry
# exceeded). ConnectX and others run with the SETTINGS defaults. The one table: the proxy applies it
# (nic_flow_control), the recipes' NIC profiles and docs/proxy.md quote it.
NIC_FLOW_CONTROL: dict[str, NicFlowControl] = {
    "bnxt_re": NicFlowControl("Broadcom Thor-2", 0x14E4, 1572864, 1),
    "ionic": NicFlowControl("AMD Pollara", 0x1DD8, 2097152, 1),
}


def nic_flow_control(devices: list[dict], used: Sequence[str] = (), low_latency: bool = False,
                     env: Optional[Mapping[str, str]] = None) -> tuple[dict[str, int], str]:
    """The proxy options (`max_inflight_bytes`, and `max_inflight` for normal proxies) that the verbs NICs a
    rank uses need and the environment does not set, and a note naming the vendor ("" when none applies).

    `devices`: dicts with "name" and "vendor_id" (`_native.verbs_devices()`); `used`: the names this rank's
    proxy threads open (`ProxyGroup.devices`); empty: the transport's default, so every device of the host
    counts. The strictest limits of the devices that count win. A variable the user set always wins."""
    env = os.environ if env is None else env
    found = []
    for d in devices:
        if used and d.get("name") not in used:
            continue
        for driver, fc in NIC_FLOW_CONTROL.items():
            if str(d.get("name", "")).startswith(driver) or int(d.get("vendor_id") or 0) == fc.pci_vendor_id:
                found.append(fc)
                break
    if not found:
        return {}, ""
    out: dict[str, int] = {}
    if not env.get("UCCL_IB_MAX_INFLIGHT_BYTES"):
        out["max_inflight_bytes"] = min(fc.max_inflight_bytes for fc in found)
    if not low_latency and not env.get("UCCL_IB_MAX_INFLIGHT_NORMAL"):
        out["max_inflight"] = min(fc.max_inflight_normal for fc in found)
    vendors = ", ".join(sorted({fc.vendor for fc in found}))
    return out, f"{vendors} flow control: {out or 'set by the environment'} (config.NIC_FLOW_CONTROL)"
