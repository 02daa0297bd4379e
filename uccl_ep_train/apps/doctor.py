"""`uccl-ep-train doctor`: what this machine offers the proxy and transports.

Lists RDMA devices (ports, state, link layer, GIDs, atomics, peer-memory and DMA-BUF support) through
pyverbs when it loads, else through the native module's libibverbs queries, and says plainly when there
are none; then GPUs, the NIC(s) each GPU's rank would use and why (uccl_ep_train/nics.py: same PCIe switch,
same NUMA node, fallback, UCCL_EP_NICS), the transport that choice leads to and why, the native module,
compiled transports, libfabric providers with FI_EP_RDM, and the settings in effect (and UCCL_* variables that nothing reads). `--json PATH` writes the same as one JSON object. Exit code 0 unless the native
module is required (`--require-native`) and missing.

`--peers` runs the pre-flight check across ranks instead (uccl_ep_train/apps/preflight.py): every rank
registers a region on its GPU and NICs, writes a pattern to its peers, checks the bytes and times a bulk
transfer; rank 0 prints one table, and the exit code is 1 when any rank met a problem.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
from typing import Optional

from uccl_ep_train.apps import preflight

# the launch (slurm/launch.sh, train.sbatch, the Primus YAMLs) and libfabric variables doctor also reports when
# set (the library's own: config.SETTINGS)
OTHER_VARS = ["UCCL_SOCKET_IFNAME", "UCCL_EP_TRAIN_HOME", "UCCL_EP_NUM_SMS", "FI_PROVIDER", "FI_TCP_IFACE"]


def _pyverbs_devices():
    """Devices through pyverbs, or (None, reason) when it does not load."""
    try:
        import pyverbs.device as d  # type: ignore
    except Exception as e:  # ImportError, or a symbol-version mismatch with the system rdma-core
        return None, f"pyverbs not usable ({type(e).__name__}: {e})"
    out = []
    try:
        for dev in d.get_device_list():
            name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
            entry = {"name": name, "ports": [], "source": "pyverbs"}
            with d.Context(name=name) as ctx:
                attr = ctx.query_device()
                entry["fw_ver"] = attr.fw_ver.decode() if isinstance(attr.fw_ver, bytes) else str(attr.fw_ver)
                entry["vendor_id"], entry["vendor_part_id"] = attr.vendor_id, attr.vendor_part_id
                for port in range(1, attr.phys_port_cnt + 1):
                    pa = ctx.query_port(port)
                    gids = []
                    for i in range(min(pa.gid_tbl_len, 16)):
                        try:
                            g = str(ctx.query_gid(port, i))
                        except Exception:
                            break
                        if g and set(g.replace(":", "")) != {"0"}:
                            gids.append(f"{i}:{g}")
                    entry["ports"].append({"port": port, "state": str(pa.state), "link_layer": str(pa.link_layer),
                                           "lid": pa.lid, "gids": gids})
            out.append(entry)
    except Exception as e:
        return None, f"pyverbs query failed ({e})"
    return out, "pyverbs"


def _native_info():
    try:
        from uccl_ep_train import _native  # type: ignore
    except Exception as e:
        return None, f"not built or not importable ({e})"
    return _native, "ok"


def collect() -> dict:
    report: dict = {"rdma": {}, "gpus": [], "native": {}, "fabric_providers": [], "settings": {},
                    "unread_settings": []}
    native, why = _native_info()
    report["native"] = {
        "importable": native is not None,
        "status": why,
        "with_cuda": bool(getattr(native, "WITH_CUDA", False)) if native else False,
        "with_hip": bool(getattr(native, "WITH_HIP", False)) if native else False,
        "transports": list(native.compiled_transports()) if native and hasattr(native, "compiled_transports") else [],
        "gpu_producers": bool(native and hasattr(native, "gpu_push_commands")),
        "gpu_archs": str(getattr(native, "GPU_ARCHS", "")) if native else "",
    }
    devices, source = _pyverbs_devices()
    if devices is None:
        note = source
        if native is not None and getattr(native, "WITH_VERBS", False):
            devices, source = [dict(d, source="native") for d in native.verbs_devices()], "native libibverbs"
        else:
            devices, source = [], "none (neither pyverbs nor native verbs queries available)"
        report["rdma"]["pyverbs"] = note
    report["rdma"]["source"] = source
    report["rdma"]["devices"] = devices
    report["rdma"]["gpu_memory"] = local_gpu_memory_registration()
    try:
        import torch
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                report["gpus"].append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                                       "sms": p.multi_processor_count,
                                       "numa_cpus": list(native.cpus_near_gpu(i))[:64] if native and native.WITH_CUDA else []})
    except Exception as e:  # pragma: no cover
        report["gpus_error"] = str(e)
    try:
        from uccl_ep_train.backends.native import native_problem

        report["native"]["problem"] = native_problem()
    except Exception as e:  # pragma: no cover - torch missing or broken
        report["native"]["problem"] = f"cannot check ({e})"
    report["nics"] = _nic_map(report["native"]["transports"])
    report["fabric_providers"] = _fabric_providers()
    report["fabric"] = _fabric_probe(native, report["native"]["transports"], bool(report["gpus"]),
                                     *_fabric_choice(report["nics"]))
    from uccl_ep_train.config import SETTINGS

    report["settings"] = {k: os.environ[k] for k in [*SETTINGS, *OTHER_VARS] if k in os.environ}
    # a UCCL_* variable nothing reads is usually a typo or a setting of another project (UCCL-EP's own)
    report["unread_settings"] = sorted(k for k in os.environ if k.startswith(("UCCL_EP_", "UCCL_IB_", "UCCL_RDMA_"))
                                       and k not in SETTINGS and k not in OTHER_VARS)
    return report


def _nic_map(compiled: list[str], root: str = "/") -> dict:
    """What ProxyGroup would choose for each GPU of this host: its NICs (with the reason) and the transport
    across hosts; on one host, GPU ranks take ipc when it is compiled in. Torch's device numbering when CUDA
    is up (CUDA_VISIBLE_DEVICES respected), else every GPU sysfs (under `root`) lists, in PCI order."""
    from uccl_ep_train import nics as N
    from uccl_ep_train.proxy import choose_transport

    buses: list = []
    try:
        import torch
        if root == "/" and torch.cuda.is_available():
            buses = [N.gpu_bus_id(i) for i in range(torch.cuda.device_count())]
    except Exception:  # pragma: no cover - torch missing or broken
        pass
    if not buses:
        buses = [g.bus_id for g in N.read_gpus(root)]
    out: dict = {"gpus": [], "found": list(N.describe(N.read_nics(root)))}
    requested = os.environ.get("UCCL_EP_TRANSPORT") or None
    provider = os.environ.get("FI_PROVIDER") or None
    for i, bus in enumerate(buses or [None]):
        entry: dict = {"index": i if bus else -1, "bus_id": bus}
        try:
            c = N.choose_nics(bus, i, root=root)
            entry.update(devices=list(c.devices), kind=c.kind, reason=c.reason)
            t = choose_transport(c, compiled, same_host=False, gpu=i if bus else -1, requested=requested,
                                 provider=provider)
            entry["transport"] = {"name": t.transport, "provider": t.provider, "devices": list(t.devices),
                                  "reason": t.reason}
        except ValueError as e:
            entry["error"] = str(e)
        out["gpus"].append(entry)
    gpu_ranks = any(buses)
    out["one_host"] = "ipc (every rank on one host, with GPUs)" if "ipc" in compiled and gpu_ranks and not requested \
        else "the same as across hosts"
    return out


# Peer-memory clients that let ibv_reg_mr take GPU pointers: NVIDIA's only. amdgpu is AMD's GPU driver, not a
# peer-memory client, and upstream bnxt_re (Thor-2) and ionic (Pollara) have none: AMD GPUs go through DMA-BUF.
NVIDIA_PEER_MEMORY = ("nvidia_peermem", "nv_peer_mem")


def gpu_memory_registration(gpu_vendor: str, modules: Optional[list[str]], dmabuf: bool) -> dict:
    """How the verbs transport can register this host's GPU memory, in the order it tries (csrc/transport/
    verbs.cpp): peer memory (NVIDIA only), then DMA-BUF (ibv_reg_dmabuf_mr on an fd from the GPU runtime).

    gpu_vendor: "nvidia", "amd" or "none"; modules: loaded kernel module names (None: unknown); dmabuf: this
    libibverbs has ibv_reg_dmabuf_mr. `ok` is False when no method is left: internode GPU runs then fail at
    registration, naming this."""
    peer = [m for m in NVIDIA_PEER_MEMORY if modules and m in modules] if gpu_vendor == "nvidia" else []
    methods = ([f"peer memory ({peer[0]})"] if peer else []) + (["DMA-BUF"] if dmabuf and gpu_vendor != "none" else [])
    if gpu_vendor == "none":
        note = "no GPU visible: nothing to register"
    elif methods:
        note = "tries " + ", then ".join(methods) + (
            " (DMA-BUF on AMD also needs ROCm >= 5.6 and a NIC driver with DMA-BUF)" if gpu_vendor == "amd" else
            " (DMA-BUF also needs the NVIDIA open kernel module and a NIC driver with DMA-BUF)" if not peer else "")
    elif gpu_vendor == "nvidia":
        note = ("no nvidia_peermem / nv_peer_mem loaded and this libibverbs has no ibv_reg_dmabuf_mr: "
                "`modprobe nvidia_peermem` or install rdma-core >= 34")
    else:
        note = ("AMD GPUs register through DMA-BUF only (no peer-memory client on upstream NIC drivers) and this "
                "libibverbs has no ibv_reg_dmabuf_mr: install rdma-core >= 34")
    return {"gpu_vendor": gpu_vendor, "peer_memory": peer[0] if peer else "none", "dmabuf": dmabuf,
            "methods": methods, "ok": bool(methods) or gpu_vendor == "none", "note": note}


def local_gpu_memory_registration() -> dict:
    """`gpu_memory_registration` for this host: its GPUs' vendor, loaded modules and libibverbs."""
    return gpu_memory_registration(_gpu_vendor(), _loaded_modules(), _verbs_has_dmabuf())


def _gpu_vendor() -> str:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return "none"
    if not torch.cuda.is_available():
        return "none"
    return "amd" if getattr(torch.version, "hip", None) else "nvidia"


def _loaded_modules() -> Optional[list[str]]:
    try:
        with open("/proc/modules") as f:
            return [line.split(" ", 1)[0] for line in f if line.strip()]
    except OSError:
        return None


def _verbs_has_dmabuf() -> bool:
    try:
        return hasattr(ctypes.CDLL("libibverbs.so.1"), "ibv_reg_dmabuf_mr")
    except OSError:
        return False


def _fabric_choice(nic_map: dict) -> tuple[str, str]:
    """(provider, domain) the first GPU's proxies would give the fabric transport (`_nic_map`'s choice: efa and
    its `-rdm` domain on EFA, tcp without a NIC), else FI_PROVIDER and libfabric's first domain."""
    for g in nic_map.get("gpus", []):
        t = g.get("transport") or {}
        if t.get("name") == "fabric":
            return t.get("provider") or "", (t.get("devices") or [""])[0]
    return os.environ.get("FI_PROVIDER", ""), ""


def _fabric_probe(native, transports: list[str], gpus: bool, provider: str = "", device: str = "") -> dict:
    """What the fabric transport's endpoints would open here with `provider` and `device` (domain), for GPU
    memory when GPUs are visible: the transport's own selection (`_native.fabric_probe`), or its refusal,
    word for word."""
    if native is None or "fabric" not in transports:
        return {"error": "the fabric transport is not compiled in (libfabric headers: libfabric-dev, or "
                         "UCCL_EP_LIBFABRIC=<prefix>)"}
    try:
        return dict(native.fabric_probe(provider, device, gpus), gpu_memory_asked=gpus)
    except RuntimeError as e:
        return {"error": str(e), "gpu_memory_asked": gpus}


def _render_fabric(f: dict) -> str:
    if "error" in f:
        return f"fabric transport: {f['error']}"
    return (f"fabric transport: provider {f['provider']} domain {f['domain']} (libfabric {f['library_version']}, "
            f"API {f['api_version']}), {f['cq_data_bytes']}-byte CQ data (provider offers {f['cq_data_size']}), "
            f"GPU memory {'yes (FI_HMEM)' if f['hmem'] else 'not asked' if not f['gpu_memory_asked'] else 'no'}"
            + ("; its CUDA copies queue on the default stream: issue EP calls from a stream of your own"
               if f.get("waits_for_default_stream") else ""))


def _fabric_providers() -> list[str]:
    exe = shutil.which("fi_info")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "-l"], capture_output=True, text=True, timeout=20).stdout
    except Exception:
        return []
    return sorted({line.strip().rstrip(":") for line in out.splitlines() if line.strip().endswith(":")})


def render(r: dict) -> str:
    lines = ["uccl-ep-train doctor", ""]
    rd = r["rdma"]
    lines.append(f"RDMA devices (via {rd['source']}):")
    if rd.get("pyverbs"):
        lines.append(f"  note: {rd['pyverbs']}")
    if not rd["devices"]:
        lines.append("  no RDMA devices found on this machine: internode runs need a NIC (ConnectX, EFA, Broadcom,")
        lines.append("  Pollara); single-host runs use the ipc transport, CPU tests the fabric (tcp/shm) transport.")
    for d in rd["devices"]:
        lines.append(f"  {d['name']}: fw {d.get('fw_ver', '?')} vendor 0x{int(d.get('vendor_id', 0)):x} "
                     f"part {d.get('vendor_part_id', '?')} atomics {d.get('atomic_cap', '?')} "
                     f"dmabuf {d.get('dmabuf', '?')} nvidia-peer-memory {d.get('peer_memory', '?')}")
        for p in d.get("ports", []):
            lines.append(f"    port {p['port']}: {p['state']} {p['link_layer']} lid {p.get('lid')} "
                         f"gids {', '.join(p.get('gids', [])) or 'none'}")
    gm = rd["gpu_memory"]
    lines.append(f"  GPU memory registration ({gm['gpu_vendor']} GPUs): {gm['note']}"
                 + ("" if gm["ok"] else "  <- internode GPU runs cannot register their buffers"))
    lines.append("")
    lines.append("GPUs:" if r["gpus"] else "GPUs: none visible to torch")
    for g in r["gpus"]:
        lines.append(f"  [{g['index']}] {g['name']} {g['memory_gib']} GiB, {g['sms']} SMs")
    lines.append("")
    lines.extend(_render_nics(r["nics"]))
    n = r["native"]
    lines.append("")
    lines.append(f"native module: {'importable' if n['importable'] else n['status']}"
                 + (f" (CUDA {n['with_cuda']}, HIP {n['with_hip']}, kernels for {n['gpu_archs'] or 'no GPU'}, "
                    f"transports: {', '.join(n['transports']) or 'none'}, GPU producers {n['gpu_producers']})"
                    if n["importable"] else ""))
    if n.get("problem"):
        lines.append(f"  NATIVE KERNELS UNUSABLE HERE: {n['problem']} (Buffer falls back to the reference backend)")
    lines.append(f"libfabric providers (fi_info -l): {', '.join(r['fabric_providers']) or 'fi_info not found'}")
    lines.append(_render_fabric(r["fabric"]))
    lines.append("settings: " + (", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "none set (defaults)"))
    if r["unread_settings"]:
        lines.append("set but read by nothing here (typo? see the README's settings table): "
                     + ", ".join(r["unread_settings"]))
    return "\n".join(lines)


def _render_nics(m: dict) -> list[str]:
    lines = ["GPU -> NIC (PCI topology: same PCIe switch, else same NUMA node, else any; UCCL_EP_NICS overrides):"]
    for g in m["gpus"]:
        who = f"[{g['index']}] {g['bus_id']}" if g["bus_id"] else "no GPU (CPU ranks)"
        if "error" in g:
            lines.append(f"  {who}: ERROR {g['error']}")
            continue
        t = g["transport"]
        nics = ", ".join(g["devices"]) or "none"
        kind = f" ({g['kind']})" if g["kind"] else ""
        lines.append(f"  {who} -> {nics}{kind}: "
                     f"{g['reason']}")
        lines.append(f"      transport across hosts: {t['name']}"
                     + (f" (provider {t['provider']})" if t["provider"] else "")
                     + (f", threads open {', '.join(t['devices'])}" if t["devices"] else "") + f": {t['reason']}")
    lines.append(f"  on one host: {m['one_host']}; RDMA devices: {', '.join(m['found']) or 'none'}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="uccl-ep-train doctor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    p.add_argument("--require-native", action="store_true", help="exit 1 when the native module is missing")
    peers = p.add_argument_group("--peers: the pre-flight check across ranks (uccl_ep_train/apps/preflight.py)")
    peers.add_argument("--peers", action="store_true",
                       help="every rank writes a pattern to its peers through the proxies, checks the bytes, "
                            "times a bulk transfer per NIC; rank 0 prints one table (under torchrun, "
                            "or --ranks N on this host)")
    preflight.add_arguments(peers)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.peers:
        return preflight.main(args)
    given = [f"--{k.replace('_', '-')}" for k, v in preflight.defaults(p).items() if getattr(args, k) != v]
    if given:
        p.error(f"{', '.join(given)} only apply with --peers")
    report = collect()
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.require_native and not report["native"]["importable"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
