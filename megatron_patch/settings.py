"""Process-wide uccl dispatcher settings, filled from our Megatron flags (`--uccl-ep-*`) or the API."""
from __future__ import annotations

from typing import Optional

num_sms: Optional[int] = None  # --uccl-ep-num-sms: SMs for the high-throughput kernels
# The dispatcher's SM count when no flag sets one. `uccl-ep-train bench megatron --num-sms 20/32/132`, 2xH200,
# DeepSeek-V3 layer: 4.27 / 3.73 / 3.67 ms per round trip: from 32 SMs on, the expert-major dispatches expand
# inside the kernel (benchmarks/results/megatron_round_trip_2xH200.json); 32 of 132 SMs leave the rest to GEMMs.
DEFAULT_NUM_SMS = 32


def add_arguments(parser):
    """Megatron-LM `extra_args_provider`: our flags next to Megatron's."""
    group = parser.add_argument_group(title="uccl-ep-train")
    group.add_argument("--uccl-ep-num-sms", type=int, default=None,
                       help=f"SMs used by uccl dispatch/combine kernels (even; default: {DEFAULT_NUM_SMS})")
    group.add_argument("--uccl-ep-backend", choices=["auto", "reference", "native"], default=None,
                       help="force the uccl_ep_train backend (sets UCCL_EP_BACKEND)")
    group.add_argument("--uccl-ep-timeout-s", type=float, default=None,
                       help="deadline for any wait on peers (sets UCCL_EP_TIMEOUT_S)")
    return parser


def apply_arguments(args) -> None:
    """Take the parsed `--uccl-ep-*` flags into effect."""
    import os
    global num_sms
    if getattr(args, "uccl_ep_num_sms", None) is not None:
        if args.uccl_ep_num_sms <= 0 or args.uccl_ep_num_sms % 2:
            raise ValueError(f"--uccl-ep-num-sms must be a positive even number, got {args.uccl_ep_num_sms}")
        num_sms = args.uccl_ep_num_sms
    if getattr(args, "uccl_ep_backend", None):
        os.environ["UCCL_EP_BACKEND"] = args.uccl_ep_backend
    if getattr(args, "uccl_ep_timeout_s", None) is not None:
        os.environ["UCCL_EP_TIMEOUT_S"] = str(args.uccl_ep_timeout_s)
