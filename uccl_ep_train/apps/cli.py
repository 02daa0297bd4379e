"""`uccl-ep-train` command line (each subcommand lives in its own module with a `main(argv) -> int`).

USAGE lists them; it is what `uccl-ep-train`, `--help` and an unknown command print.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys

USAGE = """usage: uccl-ep-train COMMAND [args]   (COMMAND --help for its options; --version)

Expert-parallel dispatch/combine for MoE training (DeepEP's API; Megatron's `uccl` dispatcher).

    train            the main job: tiny DeepSeek-V3-shaped MoE trained with the uccl dispatcher
    bench NAME       benchmarks (uccl_ep_train.apps.bench.NAME; `bench --help` lists them)
    doctor           RDMA NICs, GPUs, native module, transports on this machine
    plan             validate a recipe against a cluster shape, print launch command and memory estimate
    pretrain-gpt     Megatron-LM's pretrain_gpt with `--moe-token-dispatcher-type uccl` registered
    deep-ep-path     print the directory to put on PYTHONPATH so `import deep_ep` resolves to ours
    install-deep-ep  install ours as the `deep_ep` distribution (primus-cli's USING_UEP=1 route)
"""

COMMANDS = {
    "train": "uccl_ep_train.apps.train",
    "doctor": "uccl_ep_train.apps.doctor",
    "plan": "uccl_ep_train.apps.plan",
    "pretrain-gpt": "megatron_patch.pretrain_gpt",
    "deep-ep-path": "uccl_ep_train.compat",
    "install-deep-ep": "uccl_ep_train.compat.deep_ep_dist",
}

# `uccl-ep-train bench NAME` runs uccl_ep_train.apps.bench.NAME (dashes as underscores); listed by `bench --help`
BENCHMARKS = {
    "intranode": "HT dispatch/combine on this node's GPUs (NVLink), DeepEP's GB/s convention, NCCL beside it",
    "internode": "HT dispatch/combine across (emulated) nodes: CPU proxies + NVLink, RDMA and NVL GB/s",
    "megatron": "the Megatron dispatcher round trip (uccl, alltoall, flex) at the DeepSeek-V3 layer shape",
    "expert-major": "expert-major dispatch/combine, permutation fused into the kernels vs separate",
    "low-latency": "DeepEP's low-latency dispatch/combine (128 tokens, top-8 of 256): native kernels vs reference",
    "proxy": "GPU->CPU command channel: commands/s, pickup latency, ipc/fabric bandwidth",
}

# Commands that drive Megatron: megatron-core is no requirement of the library, but of these (the `megatron` extra)
NEEDS_MEGATRON = {"train", "pretrain-gpt", "bench megatron"}


def _bench_usage() -> str:
    width = max(map(len, BENCHMARKS))
    return "usage: uccl-ep-train bench NAME [args]   (NAME --help for its options)\n\n" + "\n".join(
        f"  {name:<{width}}  {what}" for name, what in BENCHMARKS.items())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE.strip())
        return 0
    if argv[0] == "--version":
        from uccl_ep_train import __version__

        print(f"uccl-ep-train {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if rest and rest[0] in ("-h", "--help"):
            print(_bench_usage())
            return 0
        if not rest or rest[0].startswith("-"):
            print(_bench_usage(), file=sys.stderr)
            return 2
        module = "uccl_ep_train.apps.bench." + rest[0].replace("-", "_")
        cmd, rest = f"bench {rest[0]}", rest[1:]
    elif cmd in COMMANDS:
        module = COMMANDS[cmd]
    else:
        print(f"uccl-ep-train: unknown command {cmd!r} (commands: {', '.join(['bench', *COMMANDS])})\n\n"
              f"{USAGE.strip()}", file=sys.stderr)
        return 2
    if cmd in NEEDS_MEGATRON and importlib.util.find_spec("megatron") is None:
        print(f"uccl-ep-train {cmd}: needs megatron-core (pip install 'uccl-ep-train[megatron]')", file=sys.stderr)
        return 2
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            print(f"uccl-ep-train: command {cmd!r} is not available ({module} not found)", file=sys.stderr)
            return 2
        raise
    return int(mod.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
