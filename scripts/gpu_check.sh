#!/usr/bin/env bash
# GPU checks on a machine with NVIDIA GPUs (one is enough): builds the native module for the GPU present,
# starts NVIDIA MPS (scripts/mps.sh: multi-rank tests put several ranks on one GPU), runs every `gpu`-marked
# test, and stops MPS.
#
#   bash scripts/gpu_check.sh [pytest arguments]      e.g. -k internode, -x
#
# PYTHON picks the interpreter (default: .venv/bin/python when present, else python3). The build log goes to
# build/gpu_check_build.log; the native module is built with the C/C++ compilers in CC / CXX.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh  # $py and the NVLink multicast ban
mkdir -p build
echo "gpu_check: building the native module (log: build/gpu_check_build.log)"
if ! "$py" setup.py build_ext --inplace > build/gpu_check_build.log 2>&1; then
  grep -m 20 -B2 -A8 -i "error" build/gpu_check_build.log || tail -40 build/gpu_check_build.log
  echo "gpu_check: the native build failed" >&2
  exit 1
fi
"$py" -c "from uccl_ep_train import _native; assert hasattr(_native, 'IntranodeBuffer'), 'built without GPU kernels'"
# MPS up before pytest starts, down after it exited: a daemon's `quit` waits for its clients, and the
# pytest process becomes one when a test uses CUDA in it
eval "$(bash scripts/mps.sh start | grep '^export')"
trap 'bash scripts/mps.sh stop' EXIT
"$py" -m pytest -m gpu tests -p no:warnings -rs "$@"
