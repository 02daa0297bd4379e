#!/usr/bin/env bash
# The low-latency checks (scripts/ll_checks.py: every LL mode against the oracle, 2 ranks, one per GPU, no MPS)
# under NVIDIA compute-sanitizer, which follows the ranks the launcher forks (--target-processes all):
#
#   bash scripts/sanitize_ll.sh [memcheck|racecheck|synccheck|initcheck] [RANKS_PER_NODE] [RUNS]
#
# RANKS_PER_NODE 2 (default): one node, the NVLink kernels; 1: two emulated nodes, the bytes between them
# through the CPU proxies. A canary runs first: each rank makes one failing CUDA call on purpose, which the
# sanitizer must report once per rank, or the run stops (a clean report proves nothing about a process the
# sanitizer does not watch; its summary counts all processes together). Needs 2 GPUs (one rank each: not
# tried with ranks sharing a GPU under MPS) and the native module built for them; PYTHON picks the
# interpreter (scripts/gpu_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh  # $py and the NVLink multicast ban
tool=${1:-memcheck} per_node=${2:-2} runs=${3:-1}
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
canary=$("$sanitizer" --tool memcheck --target-processes all "$py" scripts/ll_checks.py canary 2>&1) || true
seen=$(grep -c "on CUDA API call to cuDeviceGet" <<< "$canary" || true)
if [ "$seen" -lt 2 ]; then
  echo "sanitize_ll.sh: compute-sanitizer reported $seen of the 2 ranks' canary errors (a failing cuDeviceGet" \
       "each): it is not watching every rank, so its report would prove nothing. Its output:" >&2
  echo "$canary" >&2
  exit 1
fi
echo "canary: the sanitizer reported both ranks' deliberate cuDeviceGet errors"
exec "$sanitizer" --tool "$tool" --target-processes all --print-limit 20 "$py" scripts/ll_checks.py "$per_node" "$runs"
