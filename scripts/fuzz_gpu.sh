#!/usr/bin/env bash
# The GPU fuzz suite, long or one case: seeded cases (tests/fuzz_cases.py) on native Buffers, every output
# compared with the reference backend (tests/fuzz_runner.py). Ranks beyond the GPUs share them under NVIDIA
# MPS: a daemon that answers is used, else one is started for the run and stopped after it.
#
#   bash scripts/fuzz_gpu.sh --seeds N [--first S] [--minutes M] [--cases C] [--gpus G]    a run: prints
#                                                    every seed's result, then the failures with their repro
#                                                    lines; --gpus G runs G seeds at once, one per GPU
#   bash scripts/fuzz_gpu.sh --seed S [--case K]      one seed (or one case of it): a failure's repro
#
# PYTHON picks the interpreter (default: .venv/bin/python when present, else python3). Needs the native
# module built for this GPU (`python setup.py build_ext --inplace`, or scripts/gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh  # $py and the NVLink multicast ban
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_NVML_BASED_CUDA_CHECK=1  # the parent asks NVML for GPUs: it stays off the CUDA driver (MPS)
if ! bash scripts/mps.sh status 2>/dev/null | grep -q "running"; then
  eval "$(bash scripts/mps.sh start | grep '^export')"
  trap 'bash scripts/mps.sh stop' EXIT
else
  eval "$(bash scripts/mps.sh status | grep '^export' || true)"
fi
"$py" tests/fuzz_runner.py "$@"
