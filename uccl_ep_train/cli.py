"""`uccl-ep-train` command line: each subcommand lives in its own module with a `main(argv) -> int`.

    train          the main job: tiny DeepSeek-V3-shaped MoE trained with the uccl dispatcher
    bench NAME     benchmarks (uccl_ep_train.bench.NAME): intranode, megatron, proxy, ...
    doctor         RDMA NICs, GPUs, native module, transports on this machine
    plan           validate a recipe against a cluster shape, print launch command and memory estimate
    pretrain-gpt   Megatron-LM's pretrain_gpt with `--moe-token-dispatcher-type uccl` registered
    deep-ep-path   print the directory to put on PYTHONPATH so `import deep_ep` resolves to ours
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": "uccl_ep_train.train",
    "doctor": "uccl_ep_train.doctor",
    "plan": "uccl_ep_train.plan",
    "pretrain-gpt": "megatron_patch.pretrain_gpt",
    "deep-ep-path": "uccl_ep_train.compat",
}


def _usage() -> str:
    return (__doc__ or "").strip()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0].startswith("-"):
            print("usage: uccl-ep-train bench NAME [args]   (NAME: a module of uccl_ep_train.bench)", file=sys.stderr)
            return 2
        module = "uccl_ep_train.bench." + rest[0].replace("-", "_")
        rest = rest[1:]
    elif cmd in COMMANDS:
        module = COMMANDS[cmd]
    else:
        print(f"uccl-ep-train: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
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
