#!/usr/bin/env bash
# Real Megatron-LM pretrain_gpt.py on ONE GPU: 4 ranks (2 emulated nodes x 2, UCCL_EP_RANKS_PER_NODE=2)
# share it under MPS, Megatron-LM's groups on gloo with CUDA tensors; a tiny MoE GPT (8 experts, top-2,
# EP=4, DP=4) on mock data trains 30 iterations once per dispatcher (alltoall, uccl, flex on our deep_ep),
# same seeds; then uccl_ep_train/apps/megatron_log.py compares each run's per-iteration "lm loss" with
# alltoall's (1e-2 relative) and writes LOGDIR/pretrain_gpt_emulated.json (result records). docs/megatron.md.
#
#   eval "$(bash scripts/mps.sh start | grep '^export')"
#   bash scripts/pretrain_gpt_emulated.sh CHECKOUT LOGDIR [DISPATCHERS]
#
# CHECKOUT: a Megatron-LM checkout (pretrain_gpt.py at its root). DISPATCHERS: comma-separated, from
# alltoall,uccl,flex (default all three; alltoall first: it is the reference). Settings (environment):
# PYTHON (interpreter, as scripts/gpu_env.sh picks it), RUN_TIMEOUT_S (per dispatcher, default 180; each
# run took about 50 s on one H200),
# MLM_WHEELS (a folder, relative to the repository, of pure-python wheels Megatron-LM needs beyond torch,
# put on PYTHONPATH as they are; default build/wheels-mlm: e.g. `pip download --no-deps --only-binary=:all:
# -d build/wheels-mlm packaging` where the venv lacks packaging). The uccl and flex runs take
# UCCL_EP_BACKEND=native (no silent fallback to the reference backend) and must say so in their log.
# Exit status: 0 only if every run trained on its backend and matched.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
usage="usage: bash scripts/pretrain_gpt_emulated.sh CHECKOUT LOGDIR [alltoall,uccl,flex]"
[ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
checkout=$(cd "$1" 2>/dev/null && pwd) || { echo "CHECKOUT: no folder $1" >&2; exit 2; }
[ -f "$checkout/pretrain_gpt.py" ] \
  || { echo "CHECKOUT: $checkout has no pretrain_gpt.py (a Megatron-LM checkout?)" >&2; exit 2; }
mkdir -p "$2" && logdir=$(cd "$2" && pwd)
dispatchers=${3:-alltoall,uccl,flex}
case ",$dispatchers," in *,alltoall,*) ;; *) echo "DISPATCHERS: alltoall must be among them (the reference)" >&2; exit 2 ;; esac
for d in ${dispatchers//,/ }; do
  case "$d" in alltoall|uccl|flex) ;; *) echo "DISPATCHERS: unknown '$d' (alltoall, uccl, flex)" >&2; exit 2 ;; esac
done
timeout_s=${RUN_TIMEOUT_S:-180}
[ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] \
  || echo "warning: CUDA_MPS_PIPE_DIRECTORY unset: start MPS first (eval \"\$(bash scripts/mps.sh start | grep '^export')\")" >&2

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
wheels=${MLM_WHEELS:-build/wheels-mlm}
for whl in "$wheels"/*.whl; do  # pure-python wheels import from the zip itself: no pip, nothing installed
  [ -f "$whl" ] && export PYTHONPATH="$PYTHONPATH:$(realpath "$whl")"  # after ours and the venv's: only what is missing
done

# Megatron-LM's rank 0 builds its dataset helpers (megatron/core/datasets/Makefile) with `python3 -m
# pybind11` and `python3-config`, which in a venv may be another Python or missing: build them here with
# this interpreter, and pass the same suffix to rank 0's make (MAKEFLAGS) so it finds them up to date.
command -v make >/dev/null && command -v "${CXX:-g++}" >/dev/null \
  || { echo "needs make and ${CXX:-g++}: Megatron-LM's rank 0 runs make on its dataset helpers at every start" >&2; exit 1; }
ext=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
make -s -C "$checkout/megatron/core/datasets" LIBEXT="$ext" CPPFLAGS="$("$py" -m pybind11 --includes)" \
  || { echo "could not build $checkout/megatron/core/datasets/helpers_cpp$ext (needs g++ and pybind11)" >&2; exit 1; }
export MAKEFLAGS="LIBEXT=$ext"

# The tiny MoE GPT: local transformer (no TransformerEngine), no apex fusions, mock data with a tokenizer
# that needs no files, no dropout (the runs must see the same numbers), fp32 gradient all-reduce (gloo),
# plain DDP (no distributed optimizer: it would reduce-scatter), no evaluation, no checkpoint.
model=(--transformer-impl local --distributed-backend gloo
  --num-layers 2 --hidden-size 128 --ffn-hidden-size 256 --num-attention-heads 4
  --seq-length 128 --max-position-embeddings 128 --position-embedding-type learned_absolute
  --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128 --moe-aux-loss-coeff 1e-2
  --expert-model-parallel-size 4 --micro-batch-size 2 --global-batch-size 8
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --num-workers 0
  --train-iters 30 --log-interval 1 --eval-iters 0 --eval-interval 1000
  --lr 1e-3 --lr-decay-style constant --bf16 --accumulate-allreduce-grads-in-fp32 --seed 1234
  --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion
  --no-gradient-accumulation-fusion --no-persist-layer-norm)

status=0
runs=()
port=29610
for d in ${dispatchers//,/ }; do
  case "$d" in
    flex) flags=(--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend uccl)
          extra_path=$("$py" -m uccl_ep_train.apps.cli deep-ep-path) || { status=1; continue; } ;;
    *) flags=(--moe-token-dispatcher-type "$d"); extra_path= ;;
  esac
  log="$logdir/$d.log"
  echo "[pretrain_gpt_emulated] $d -> $log (timeout ${timeout_s}s)"
  start=$(date +%s)
  PYTHONPATH="${extra_path:+$extra_path:}$PYTHONPATH" UCCL_EP_RANKS_PER_NODE=2 UCCL_EP_BACKEND=native \
    timeout -k 20 "$timeout_s" "$py" -m torch.distributed.run --nproc-per-node 4 \
      --master-addr 127.0.0.1 --master-port $((port++)) \
      -m uccl_ep_train.apps.cli pretrain-gpt --megatron-lm "$checkout" "${model[@]}" "${flags[@]}" \
      >"$log" 2>&1
  rc=$?
  # what served the MoE layers: the native backend, across the 2 emulated nodes (the dispatcher's start line;
  # flex: the Buffer's), else the run does not count
  case "$d" in
    uccl) served="on the native backend (internode, 2 nodes x 2 ranks)" ;;
    flex) served="Buffer uses the native backend" ;;
    *) served= ;;
  esac
  if [ $rc -eq 0 ] && [ -n "$served" ] && ! grep -qF "$served" "$log"; then
    echo "[pretrain_gpt_emulated] $d: its log does not say '$served'" >&2
    rc=1
  fi
  echo "[pretrain_gpt_emulated] $d: exit $rc after $(( $(date +%s) - start ))s"
  [ $rc -eq 0 ] || { status=1; tail -n 25 "$log"; }
  [ "$d" = alltoall ] || runs+=(--run "$d=$log")
done

"$py" -m uccl_ep_train.apps.megatron_log --reference "alltoall=$logdir/alltoall.log" "${runs[@]}" \
  --json "$logdir/pretrain_gpt_emulated.json" \
  --command "bash scripts/pretrain_gpt_emulated.sh $(basename "$checkout") LOGDIR $dispatchers" || status=1
exit $status
