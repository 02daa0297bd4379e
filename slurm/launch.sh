#!/usr/bin/env bash
# Per-node launcher for uccl-ep-train recipes: run once per node (srun --ntasks-per-node=1, see
# train.sbatch) or by hand on one machine without Slurm.
#
#   slurm/launch.sh RECIPE [plan options] [-- extra arguments for the entry point]
#
# It derives the torchrun rendezvous from Slurm (MASTER_ADDR = first host of SLURM_JOB_NODELIST,
# MASTER_PORT from SLURM_JOB_ID, node rank = SLURM_NODEID, nodes = SLURM_JOB_NUM_NODES, LOCAL_WORLD_SIZE
# = GPUs on this node), exports UCCL_SOCKET_IFNAME / UCCL_IB_GID_INDEX and their NCCL (and Gloo) twins,
# checks the Megatron-LM checkout, validates the recipe against the cluster shape and exports its UCCL_*
# settings (`uccl-ep-train plan`), runs `uccl-ep-train doctor` as a pre-flight check, then execs torchrun
# on `uccl-ep-train pretrain-gpt` (Megatron-LM's pretrain_gpt with --moe-token-dispatcher-type uccl).
#
# Plan options pass through to `uccl-ep-train plan`: --tp/--pp/--ep/--etp/--cp/--mbs/--gbs/--seq-length,
# --nic cx7|efa|thor2|pollara, --entry pretrain-gpt|train.
#
# Environment (all optional unless noted):
#   MEGATRON_LM_PATH      Megatron-LM checkout (holds pretrain_gpt.py); required for --entry pretrain-gpt
#   MASTER_ADDR / MASTER_PORT / NODE_RANK / NNODES / LOCAL_WORLD_SIZE   override what Slurm gives
#   UCCL_SOCKET_IFNAME    bootstrap interface (default: NCCL_SOCKET_IFNAME, else the route to MASTER_ADDR)
#   UCCL_IB_GID_INDEX     RoCE GID index (default: NCCL_IB_GID_INDEX); the two are kept equal
#   UCCL_IB_TIMEOUT / _RETRY_CNT / _SL / _TC   verbs QP settings (default: NCCL_IB_TIMEOUT / ... when set)
#   UCCL_PYTHON           Python with uccl_ep_train installed (default: python3)
#   UCCL_TORCHRUN         torchrun command (default: torchrun if on PATH, else "$UCCL_PYTHON -m torch.distributed.run")
#   UCCL_SKIP_DOCTOR=1    skip the pre-flight check;  UCCL_DOCTOR_CMD  replace it (a shell command)
#   UCCL_LAUNCH_DRY_RUN=1 print the torchrun command instead of running it
set -euo pipefail

die() { echo "launch.sh: error: $*" >&2; exit 2; }
log() { echo "[launch.sh node ${NODE_RANK:-?}] $*" >&2; }

[ $# -ge 1 ] && [ "${1#-}" = "$1" ] || die "usage: launch.sh RECIPE [plan options] [-- extra args]"
RECIPE=$1; shift
PY=${UCCL_PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || die "python '$PY' not found (set UCCL_PYTHON)"

# ---- plan options vs. extra args ------------------------------------------------------------------------
PLAN_OPTS=(); EXTRA=(); ENTRY=pretrain-gpt
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; EXTRA=("$@"); break ;;
    --entry) [ $# -ge 2 ] || die "--entry needs a value (pretrain-gpt or train)"
             ENTRY=$2; PLAN_OPTS+=("$1" "$2"); shift 2 ;;
    --entry=*) ENTRY=${1#--entry=}; PLAN_OPTS+=("$1"); shift ;;
    *) PLAN_OPTS+=("$1"); shift ;;
  esac
done

# ---- cluster shape from Slurm ----------------------------------------------------------------------------
first_host() {  # first hostname of a Slurm nodelist such as "gpu[003-006,010],login1"
  if command -v scontrol >/dev/null 2>&1; then scontrol show hostnames "$1" | head -n1; return; fi
  "$PY" - "$1" <<'PYEOF'
import re, sys
first = re.split(r",(?![^\[]*\])", sys.argv[1])[0]
m = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", first)
if m:
    lo = m.group(2).split(",")[0].split("-")[0]
    first = m.group(1) + lo + m.group(3)
print(first)
PYEOF
}

count_gpus() {
  local n
  for v in "${SLURM_GPUS_ON_NODE:-}" "${SLURM_GPUS_PER_NODE:-}"; do
    n=${v##*:}; n=${n%%(*}
    if [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -gt 0 ]; then echo "$n"; return; fi
  done
  for v in "${SLURM_JOB_GPUS:-}" "${CUDA_VISIBLE_DEVICES:-}"; do
    if [ -n "$v" ]; then echo "$v" | tr ',' '\n' | grep -c .; return; fi
  done
  n=0
  if command -v nvidia-smi >/dev/null 2>&1; then n=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true); fi
  if [ "${n:-0}" -eq 0 ] && command -v rocm-smi >/dev/null 2>&1; then
    n=$( (rocm-smi --showid 2>/dev/null || true) | grep -o 'GPU\[[0-9]*\]' | sort -u | grep -c . || true)
  fi
  if [ "${n:-0}" -gt 0 ]; then echo "$n"; else echo 1; fi
}

NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
LOCAL_WORLD_SIZE=${LOCAL_WORLD_SIZE:-$(count_gpus)}
if [ -z "${MASTER_ADDR:-}" ]; then
  if [ -n "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}" ]; then
    MASTER_ADDR=$(first_host "${SLURM_JOB_NODELIST:-$SLURM_NODELIST}")
  else
    MASTER_ADDR=127.0.0.1
  fi
fi
MASTER_PORT=${MASTER_PORT:-$(( 20000 + ${SLURM_JOB_ID:-9500} % 20000 ))}
export MASTER_ADDR MASTER_PORT NNODES NODE_RANK LOCAL_WORLD_SIZE
[[ "$NNODES" =~ ^[0-9]+$ && "$NODE_RANK" =~ ^[0-9]+$ && "$LOCAL_WORLD_SIZE" =~ ^[0-9]+$ ]] \
  || die "bad cluster shape: NNODES=$NNODES NODE_RANK=$NODE_RANK LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE"
[ "$NODE_RANK" -lt "$NNODES" ] || die "NODE_RANK $NODE_RANK >= NNODES $NNODES"

# ---- network: UCCL_* and their NCCL / Gloo twins -------------------------------------------------------
if [ -z "${UCCL_SOCKET_IFNAME:-}" ]; then
  if [ -n "${NCCL_SOCKET_IFNAME:-}" ]; then
    UCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME
  elif command -v ip >/dev/null 2>&1; then
    UCCL_SOCKET_IFNAME=$( (ip -o route get "$MASTER_ADDR" 2>/dev/null || true) | sed -n 's/.* dev \([^ ]*\).*/\1/p' | head -n1)
  fi
fi
if [ -n "${UCCL_SOCKET_IFNAME:-}" ]; then
  export UCCL_SOCKET_IFNAME
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$UCCL_SOCKET_IFNAME}
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$UCCL_SOCKET_IFNAME}
fi
if [ -n "${UCCL_IB_GID_INDEX:-}" ] || [ -n "${NCCL_IB_GID_INDEX:-}" ]; then
  export UCCL_IB_GID_INDEX=${UCCL_IB_GID_INDEX:-$NCCL_IB_GID_INDEX}
  export NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-$UCCL_IB_GID_INDEX}
  [ "$UCCL_IB_GID_INDEX" = "$NCCL_IB_GID_INDEX" ] \
    || log "warning: UCCL_IB_GID_INDEX=$UCCL_IB_GID_INDEX differs from NCCL_IB_GID_INDEX=$NCCL_IB_GID_INDEX"
fi
# The proxies' QPs take the NCCL settings a cluster is already tuned with, unless the UCCL_* name is set.
for v in TIMEOUT RETRY_CNT SL TC; do
  u=UCCL_IB_$v n=NCCL_IB_$v
  if [ -z "${!u:-}" ] && [ -n "${!n:-}" ]; then export "$u=${!n}"; fi
done

# ---- Megatron-LM checkout ---------------------------------------------------------------------------------
if [ "$ENTRY" = pretrain-gpt ]; then
  [ -n "${MEGATRON_LM_PATH:-}" ] || die "MEGATRON_LM_PATH is not set: clone https://github.com/NVIDIA/Megatron-LM and export MEGATRON_LM_PATH=/path/to/Megatron-LM"
  [ -f "$MEGATRON_LM_PATH/pretrain_gpt.py" ] || die "MEGATRON_LM_PATH=$MEGATRON_LM_PATH has no pretrain_gpt.py (is it a Megatron-LM checkout?)"
  MEGATRON_LM_PATH=$(cd "$MEGATRON_LM_PATH" && pwd)
  export MEGATRON_LM_PATH
  export PYTHONPATH="$MEGATRON_LM_PATH${PYTHONPATH:+:$PYTHONPATH}"
fi

# ---- recipe: validate against the cluster, export its environment, build the torchrun command -------------
if [ -z "${UCCL_TORCHRUN:-}" ]; then
  if command -v torchrun >/dev/null 2>&1; then UCCL_TORCHRUN=torchrun; else UCCL_TORCHRUN="$PY -m torch.distributed.run"; fi
fi
PLAN_OUT=$("$PY" -m uccl_ep_train.apps.cli plan --recipe "$RECIPE" --nodes "$NNODES" --gpus-per-node "$LOCAL_WORLD_SIZE" \
             ${PLAN_OPTS[@]+"${PLAN_OPTS[@]}"} --emit shell --torchrun "$UCCL_TORCHRUN" --node-rank "$NODE_RANK" \
             --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" -- ${EXTRA[@]+"${EXTRA[@]}"}) \
  || die "recipe $RECIPE does not fit $NNODES node(s) x $LOCAL_WORLD_SIZE GPU(s), or bad plan options (see above)"
UCCL_LAUNCH_CMD=
eval "$PLAN_OUT"
[ -n "$UCCL_LAUNCH_CMD" ] || die "uccl-ep-train plan returned no launch command"

# ---- pre-flight: uccl-ep-train doctor on every node ------------------------------------------------------
log "$(hostname 2>/dev/null || echo localhost): nodes=$NNODES gpus=$LOCAL_WORLD_SIZE master=$MASTER_ADDR:$MASTER_PORT" \
    "ifname=${UCCL_SOCKET_IFNAME:-unset} gid=${UCCL_IB_GID_INDEX:-unset}"
if [ "${UCCL_SKIP_DOCTOR:-0}" != 1 ]; then
  if [ -n "${UCCL_DOCTOR_CMD:-}" ]; then
    eval "$UCCL_DOCTOR_CMD" || die "pre-flight check failed on node $NODE_RANK ($UCCL_DOCTOR_CMD)"
  else
    "$PY" -m uccl_ep_train.apps.cli doctor || die "pre-flight 'uccl-ep-train doctor' failed on node $NODE_RANK (UCCL_SKIP_DOCTOR=1 skips it)"
  fi
fi

# ---- torchrun ----------------------------------------------------------------------------------------------
if [ "${UCCL_LAUNCH_DRY_RUN:-0}" = 1 ]; then
  echo "$UCCL_LAUNCH_CMD"
  exit 0
fi
log "exec $UCCL_LAUNCH_CMD"
eval "exec $UCCL_LAUNCH_CMD"
