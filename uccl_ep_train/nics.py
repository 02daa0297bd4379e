"""Which RDMA NIC(s) each GPU of a host uses, read from the PCI topology in sysfs.

Why: a proxy thread that opens "the first RDMA device" puts every GPU of an 8-GPU, 8-NIC node on one NIC
(1/8 of the bandwidth, GPUDirect across sockets, maybe a storage NIC that cannot reach the peers). As NCCL
does, each GPU takes the NIC(s) nearest to it on the PCIe tree:

1. among the NICs with an ACTIVE port, those sharing the GPU's deepest PCI ancestor below the root complex
   (the same PCIe switch, or the same root port); several when the topology puts several at that distance
   (AWS p5en: two EFA devices per GPU);
2. else those on the GPU's NUMA node;
3. else every active NIC (the other socket: slower, but it works).

GPUs whose best set is the same share it fairly (sorted by PCI address: 2 GPUs and 2 NICs under one
switch get one NIC each; 1 GPU and 2 NICs, both). A choice keeps NICs of one kind only. `UCCL_EP_NICS`
overrides (`parse_nics_setting`, docs/proxy.md "How a GPU finds its NICs"). Every reader takes a sysfs
`root` ("/" by default) so that tests feed trees shaped like real machines.

What is read under `root`:
- sys/bus/pci/devices/<address>: `class`, `vendor`, `numa_node`; the link resolves to the device's place in
  the PCI tree (sys/devices/pci0000:00/0000:00:01.0/.../<address>).
- sys/class/infiniband/<name>: `device` (the NIC's PCI function: its place, `numa_node`, and `driver`,
  which gives the kind: efa, mlx5, bnxt_re, ionic, irdma, ...), `ports/<n>/state` and `link_layer`.
"""
from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional

# PCI driver of a NIC's function -> the kind of RDMA NIC it is (the RDMA driver's name).
_DRIVER_KIND = {
    "efa": "efa",             # AWS Elastic Fabric Adapter: SRD, no RC QPs (libfabric's efa provider)
    "mlx5_core": "mlx5",      # NVIDIA ConnectX (InfiniBand or RoCE)
    "bnxt_en": "bnxt_re",     # Broadcom (Thor-2)
    "ionic": "ionic",         # AMD Pensando (Pollara)
    "ice": "irdma",           # Intel E810
    "i40e": "irdma",          # Intel X722
}
EFA_KIND = "efa"
# Kinds known to offer reliable-connected queue pairs (the verbs transport).
RC_KINDS = ("mlx5", "bnxt_re", "ionic", "irdma")

_NVIDIA, _AMD = 0x10DE, 0x1002
_SETTING = "UCCL_EP_NICS"

REASON_SWITCH = "same PCIe switch"
REASON_NUMA = "same NUMA node"
REASON_FALLBACK = "fallback: no active NIC on the GPU's PCIe switch or NUMA node"
REASON_NO_GPU = "no GPU to place: spread over the host's NICs by local rank"
REASON_UNKNOWN_GPU = "GPU's PCI address unknown: spread over the host's NICs by local rank"
REASON_SETTING = _SETTING
REASON_NONE = "no RDMA NIC with an ACTIVE port on this host"


@dataclass(frozen=True)
class Nic:
    """An RDMA device as sysfs shows it."""

    name: str                          # libibverbs device name: mlx5_0, rdmap16s27, bnxt_re0
    kind: str                          # efa, mlx5, bnxt_re, ionic, irdma, or the PCI driver's name
    pci: tuple[str, ...]               # root complex, bridges ..., the NIC's function; () when not on PCI
    numa_node: int                     # -1 when unknown
    ports: tuple[tuple[int, str, str], ...] = ()  # (port, state, link_layer)

    @property
    def active(self) -> bool:
        return any(state == "ACTIVE" for _, state, _ in self.ports)

    @property
    def link_layers(self) -> tuple[str, ...]:
        return tuple(sorted({ll for _, _, ll in self.ports if ll}))


@dataclass(frozen=True)
class Gpu:
    bus_id: str                        # 0000:18:00.0
    vendor: str                        # nvidia | amd
    pci: tuple[str, ...]
    numa_node: int


@dataclass(frozen=True)
class NicChoice:
    """The NICs one GPU (rank) uses, their kind and why they were chosen."""

    devices: tuple[str, ...]           # libibverbs device names; () when there is no RDMA NIC
    kind: str                          # the devices' kind; "" with no devices
    reason: str
    found: tuple[str, ...] = field(default=())  # every RDMA device of the host, "name (kind, state)"
    # Why no NIC could be chosen (a bad UCCL_EP_NICS; `devices` is then empty). Only the transports that open
    # NICs fail on it (proxy.choose_transport): ipc ignores it.
    error: str = ""


# -- sysfs ------------------------------------------------------------------------------------------
def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _hex(path: str) -> int:
    try:
        return int(_read(path), 16)
    except ValueError:
        return -1


def _numa(path: str) -> int:
    try:
        return int(_read(path))
    except ValueError:
        return -1


_PCI_ADDR = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def _pci_path(root: str, link: str) -> tuple[str, ...]:
    """The PCI chain of a sysfs device link: ('pci0000:00', '0000:00:01.0', ..., the device), or ()."""
    real = os.path.realpath(link)
    devices = os.path.join(os.path.realpath(root), "sys", "devices")
    if not real.startswith(devices + os.sep):
        return ()
    parts = real[len(devices) + 1:].split(os.sep)
    if not parts or not parts[0].startswith("pci"):
        return ()
    chain = [parts[0]]
    for p in parts[1:]:
        if not _PCI_ADDR.match(p):
            break
        chain.append(p)
    return tuple(chain) if len(chain) > 1 else ()


def read_gpus(root: str = "/") -> list[Gpu]:
    """NVIDIA and AMD GPUs on the PCI bus (display/3D controllers; AMD Instinct boards that enumerate as
    processing accelerators too), sorted by PCI address."""
    base = os.path.join(root, "sys", "bus", "pci", "devices")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    out = []
    for bus in names:
        d = os.path.join(base, bus)
        vendor, cls = _hex(os.path.join(d, "vendor")), _hex(os.path.join(d, "class")) >> 8
        if vendor not in (_NVIDIA, _AMD):
            continue
        if cls >> 8 != 0x03 and not (vendor == _AMD and cls >> 8 == 0x12):
            continue
        out.append(Gpu(bus.lower(), "nvidia" if vendor == _NVIDIA else "amd", _pci_path(root, d),
                       _numa(os.path.join(d, "numa_node"))))
    return out


def read_nics(root: str = "/") -> list[Nic]:
    """RDMA devices of /sys/class/infiniband, sorted by name."""
    base = os.path.join(root, "sys", "class", "infiniband")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    out = []
    for name in names:
        d = os.path.join(base, name)
        dev = os.path.join(d, "device")
        driver = os.path.basename(os.path.realpath(os.path.join(dev, "driver"))) \
            if os.path.exists(os.path.join(dev, "driver")) else ""
        ports = []
        try:
            port_names = sorted(os.listdir(os.path.join(d, "ports")), key=lambda p: int(p) if p.isdigit() else 0)
        except OSError:
            port_names = []
        for p in port_names:
            state = _read(os.path.join(d, "ports", p, "state"))  # "4: ACTIVE"
            ports.append((int(p) if p.isdigit() else 0, state.split(":")[-1].strip(),
                          _read(os.path.join(d, "ports", p, "link_layer"))))
        out.append(Nic(name, _DRIVER_KIND.get(driver, driver or "unknown"),
                       _pci_path(root, dev) if os.path.exists(dev) else (),
                       _numa(os.path.join(dev, "numa_node")), tuple(ports)))
    return out


# -- automatic choice -----------------------------------------------------------------------------------
def _common(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _one_kind(nics: Iterable[Nic]) -> tuple[Nic, ...]:
    """The NICs of the first one's kind: one rank's endpoints must all speak the same transport."""
    nics = tuple(nics)
    return tuple(n for n in nics if n.kind == nics[0].kind) if nics else ()


def _nearest(gpu: Gpu, active: list[Nic]) -> tuple[tuple[Nic, ...], str]:
    depth = max((_common(gpu.pci, n.pci) for n in active), default=0)
    if depth >= 2:  # below the root complex: a root port or a switch in common
        return _one_kind(n for n in active if _common(gpu.pci, n.pci) == depth), REASON_SWITCH
    if gpu.numa_node >= 0:
        near = [n for n in active if n.numa_node == gpu.numa_node]
        if near:
            return _one_kind(near), REASON_NUMA
    return _one_kind(active), REASON_FALLBACK


def _share(items: tuple, i: int, count: int) -> tuple:
    """Member i of `count` sharers takes its fair part of `items` (at least one)."""
    n = len(items)
    if n >= count:
        return items[i * n // count:(i + 1) * n // count]
    return (items[i * n // count],)


def host_map(gpus: list[Gpu], nics: list[Nic]) -> dict[str, NicChoice]:
    """GPU PCI address -> its NICs, for every GPU of the host (the same on every rank of the host)."""
    active = [n for n in nics if n.active]
    found = describe(nics)
    if not active:
        return {g.bus_id: NicChoice((), "", REASON_NONE, found) for g in gpus}
    groups: dict[tuple, list[Gpu]] = defaultdict(list)
    for g in sorted(gpus, key=lambda g: g.bus_id):
        groups[_nearest(g, active)].append(g)
    out = {}
    for (cands, reason), members in groups.items():
        for i, g in enumerate(members):
            mine = _share(cands, i, len(members))
            out[g.bus_id] = NicChoice(tuple(n.name for n in mine), mine[0].kind, reason, found)
    return out


def describe(nics: Iterable[Nic]) -> tuple[str, ...]:
    return tuple(f"{n.name} ({n.kind}, {'ACTIVE' if n.active else 'no ACTIVE port'})" for n in nics)


# -- UCCL_EP_NICS ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NicsSetting:
    """UCCL_EP_NICS parsed. Either a filter of the automatic choice (`only` or `exclude`), or a map from
    local rank to devices (`ranks`, with `default` for the local ranks not listed)."""

    only: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    ranks: dict[int, tuple[str, ...]] = field(default_factory=dict)
    default: tuple[str, ...] = ()

    @property
    def is_map(self) -> bool:
        return bool(self.ranks or self.default)


_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _names(text: str, where: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(","))
    for n in names:
        if not _NAME.match(n):
            raise ValueError(f"{_SETTING}: {where}: {n!r} is not an RDMA device name (such as mlx5_0 or "
                             "rdmap16s27; separate devices with ',')")
    if len(set(names)) != len(names):
        raise ValueError(f"{_SETTING}: {where}: a device is named twice in {text!r}")
    return names


def parse_nics_setting(value: str) -> NicsSetting:
    """Parses UCCL_EP_NICS (NCCL_IB_HCA-like; the one parser of the setting):

    - `mlx5_0,mlx5_1,...`: only these devices; the PCI topology picks among them per GPU.
    - `^mlx5_8,mlx5_9`: every device but these (e.g. storage NICs).
    - `0=mlx5_0;1=mlx5_1;2-3=mlx5_2,mlx5_3;*=mlx5_4`: local rank (or range of local ranks, or `*` for
      the local ranks not listed) -> its devices, exactly as given; proxy thread t opens device t % count.
    """
    text = value.strip()
    if not text:
        raise ValueError(f"{_SETTING} is set but empty; unset it for the automatic choice")
    if "=" not in text:
        if text.startswith("^"):
            return NicsSetting(exclude=_names(text[1:], "exclusion"))
        return NicsSetting(only=_names(text, "device list"))
    ranks: dict[int, tuple[str, ...]] = {}
    default: tuple[str, ...] = ()
    for entry in text.split(";"):
        entry = entry.strip()
        if not entry:
            continue
        key, sep, devs = entry.partition("=")
        key = key.strip()
        if not sep or not devs.strip():
            raise ValueError(f"{_SETTING}: entry {entry!r} must be LOCAL_RANK=DEVICE[,DEVICE...] (entries "
                             "separated by ';')")
        names = _names(devs, f"entry {entry!r}")
        if key == "*":
            if default:
                raise ValueError(f"{_SETTING}: '*' is given twice")
            default = names
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", key)
        if not m:
            raise ValueError(f"{_SETTING}: {key!r} in entry {entry!r} is not a local rank, a range a-b or '*'")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"{_SETTING}: range {key!r} is empty (write low-high)")
        for r in range(lo, hi + 1):
            if r in ranks:
                raise ValueError(f"{_SETTING}: local rank {r} is given twice")
            ranks[r] = names
    return NicsSetting(ranks=ranks, default=default)


def _resolve(setting: NicsSetting, local_rank: int, nics: list[Nic]) -> list[Nic]:
    """Applies a filter (returns the NICs the automatic choice may use) or a map (returns this rank's)."""
    by_name = {n.name: n for n in nics}
    host = ", ".join(describe(nics)) or "none"

    def known(names: tuple[str, ...]) -> list[Nic]:
        missing = [x for x in names if x not in by_name]
        if missing:
            raise ValueError(f"{_SETTING} names {', '.join(missing)}, not an RDMA device of this host (found: "
                             f"{host}); `uccl-ep-train doctor` lists them")
        return [by_name[x] for x in names]

    if setting.only:
        return known(setting.only)
    if setting.exclude:
        known(setting.exclude)
        return [n for n in nics if n.name not in setting.exclude]
    names = setting.ranks.get(local_rank, setting.default)
    if not names:
        raise ValueError(f"{_SETTING} has no entry for local rank {local_rank}; add `{local_rank}=DEVICE` or "
                         "`*=DEVICE`")
    chosen = known(names)
    down = [n.name for n in chosen if not n.active]
    if down:
        raise ValueError(f"{_SETTING}: local rank {local_rank}'s {', '.join(down)} has no ACTIVE port (found: "
                         f"{host}); name a device whose link is up")
    if len({n.kind for n in chosen}) > 1:
        raise ValueError(f"{_SETTING}: local rank {local_rank} mixes NIC kinds ("
                         + ", ".join(f"{n.name}: {n.kind}" for n in chosen) + "); one rank's NICs must be of one kind")
    return chosen


def choose_nics(gpu_bus: Optional[str], local_rank: int, root: str = "/",
                setting: Optional[str] = None) -> NicChoice:
    """This rank's NICs: the GPU at PCI address `gpu_bus` (None: no GPU, or its address is unknown), with
    `setting` the value of UCCL_EP_NICS (None: read the environment, where UCCL_EP_VERBS_DEVICE=DEV, the
    older setting, means UCCL_EP_NICS=*=DEV). Raises ValueError naming the setting
    when it is malformed or names what the host does not have."""
    if setting is None:
        setting = os.environ.get(_SETTING)
        legacy = os.environ.get("UCCL_EP_VERBS_DEVICE")
        if legacy and setting is not None:
            raise ValueError(f"both {_SETTING} and UCCL_EP_VERBS_DEVICE are set; keep {_SETTING} "
                             f"({_SETTING}=*={legacy} says what UCCL_EP_VERBS_DEVICE={legacy} does)")
        if legacy:  # the older setting: one device for every rank of the host
            setting = f"*={legacy}"
    nics = read_nics(root)
    found = describe(nics)
    parsed = parse_nics_setting(setting) if setting is not None else None
    if parsed is not None and parsed.is_map:
        chosen = _resolve(parsed, local_rank, nics)
        return NicChoice(tuple(n.name for n in chosen), chosen[0].kind, REASON_SETTING, found)
    usable = _resolve(parsed, local_rank, nics) if parsed is not None else nics
    if parsed is not None and not any(n.active for n in usable):
        raise ValueError(f"{_SETTING}={setting!r} leaves no RDMA device with an ACTIVE port (found: "
                         f"{', '.join(found) or 'none'})")
    suffix = f" ({_SETTING} filter)" if parsed is not None else ""
    gpus = read_gpus(root)
    if gpu_bus is not None:
        gpu_bus = gpu_bus.lower()
        mapping = host_map(gpus, usable)
        if gpu_bus in mapping:
            c = mapping[gpu_bus]
            return NicChoice(c.devices, c.kind, c.reason + suffix, found)
    active = _one_kind(n for n in usable if n.active)
    if not active:
        return NicChoice((), "", REASON_NONE, found)
    reason = REASON_NO_GPU if gpu_bus is None else REASON_UNKNOWN_GPU
    pick = active[local_rank % len(active)]
    return NicChoice((pick.name,), pick.kind, reason + suffix, found)


def gpu_bus_id(device: int) -> Optional[str]:
    """PCI address (0000:18:00.0) of CUDA/HIP device `device` as this process numbers it (so
    CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES are respected); None when unknown or `device` < 0."""
    if device < 0:
        return None
    try:
        import torch

        p = torch.cuda.get_device_properties(device)
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except Exception:  # no torch, no such device, or a torch without the PCI fields
        return None


def local_rank(gpu: int) -> int:
    """The key of this rank in UCCL_EP_NICS's map: LOCAL_RANK (torchrun, slurm/launch.sh), else the GPU
    index (0 without a GPU)."""
    raw = os.environ.get("LOCAL_RANK")
    if raw:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"LOCAL_RANK={raw!r} is not an int") from None
    return max(gpu, 0)
