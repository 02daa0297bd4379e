#!/usr/bin/env bash
# The low-latency checks (scripts/ll_checks.py: every LL mode against the oracle, 2 ranks, one per GPU, no MPS)
# under NVIDIA compute-sanitizer, each rank under a sanitizer of its own:
#
#   bash scripts/sanitize_ll.sh [memcheck|racecheck|synccheck|initcheck] [RANKS_PER_NODE] [RUNS]
#
# RANKS_PER_NODE 2 (default): one node, the NVLink kernels; 1: two emulated nodes, the bytes between them
# through the CPU proxies. Why a sanitizer per rank: a sanitizer surely watches the process it starts, while
# whether `--target-processes all` follows ranks that a launcher forks from its fork server is not something
# a clean report can show. So each rank is started here (torchrun's variables), and first a canary: each rank
# makes one failing CUDA call on purpose, which its sanitizer must report, or the run stops. Every rank's
# report is printed (logs under $SANITIZE_DIR, default a temporary directory). Needs 2 GPUs and the native
# module built for them; PYTHON picks the interpreter (scripts/gpu_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh  # $py and the NVLink multicast ban
tool=${1:-memcheck} per_node=${2:-2} runs=${3:-1}
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
dir=${SANITIZE_DIR:-$(mktemp -d)}
mkdir -p "$dir"
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# ranks NAME TOOL ARGS...: rank 0 and rank 1 of ll_checks.py ARGS, each under `sanitizer --tool TOOL`, logs
# $dir/NAME.rank<r>.log; the exit status is the first failing rank's.
ranks() {
  local name=$1 tool=$2 port pids=() rc=0
  shift 2
  port=$("$py" -c "from uccl_ep_train.apps.launch import free_loopback_port; print(free_loopback_port())")
  for r in 0 1; do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$sanitizer" --tool "$tool" --print-limit 20 "$py" scripts/ll_checks.py "$@" > "$dir/$name.rank$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { s=$?; [ $rc -ne 0 ] || rc=$s; }; done
  return $rc
}

ranks canary memcheck canary || true
for r in 0 1; do
  if ! grep -q "cuDeviceGet" "$dir/canary.rank$r.log"; then
    echo "sanitize_ll.sh: rank $r's sanitizer did not report its canary error (a failing cuDeviceGet): it is not" \
         "watching the rank, so its report would prove nothing. Its log, $dir/canary.rank$r.log:" >&2
    cat "$dir/canary.rank$r.log" >&2
    exit 1
  fi
done
echo "canary: each rank's sanitizer reported its rank's deliberate cuDeviceGet error"
rc=0
ranks checks "$tool" "$per_node" "$runs" || rc=$?
for r in 0 1; do echo "--- rank $r ($tool) ---"; cat "$dir/checks.rank$r.log"; done
exit $rc
