#!/usr/bin/env bash
# NVIDIA MPS control daemon for several ranks on one GPU (emulated nodes): start | stop | status.
#
# Why: ranks sharing a GPU spin kernels that wait for each other. Without MPS the GPU time-slices between
# processes and a hand-over takes ~5 ms; with MPS the kernels run side by side and it takes ~2-3 us. See
# docs/emulation.md. Idempotent: `start` with a daemon running and `stop` with none say so and exit 0; so
# does every command on a machine without nvidia-cuda-mps-control.
#
# Pipes and logs go to CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY (default /tmp/mps-pipe,
# /tmp/mps-log). CUDA clients look for the daemon in CUDA_MPS_PIPE_DIRECTORY (their default is
# /tmp/nvidia-mps), so export the line `start` prints before launching the ranks.
set -euo pipefail

usage() { echo "usage: bash scripts/mps.sh start|stop|status" >&2; exit 2; }
[ $# -eq 1 ] || usage
action=$1
case "$action" in start|stop|status) ;; *) usage ;; esac

export CUDA_MPS_PIPE_DIRECTORY="${CUDA_MPS_PIPE_DIRECTORY:-/tmp/mps-pipe}"
export CUDA_MPS_LOG_DIRECTORY="${CUDA_MPS_LOG_DIRECTORY:-/tmp/mps-log}"
pipe=$CUDA_MPS_PIPE_DIRECTORY
exports="export CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$CUDA_MPS_LOG_DIRECTORY"

if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  echo "mps: nvidia-cuda-mps-control not found (no NVIDIA driver on this machine): nothing to $action"
  exit 0
fi

# The daemon answers on its control socket; the client mode of nvidia-cuda-mps-control fails without one.
running() {
  [ -S "$pipe/control" ] && echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1
}

wait_for() {  # wait_for up|down SECONDS
  local want=$1 tries=$(($2 * 10))
  for ((i = 0; i < tries; i++)); do
    if running; then [ "$want" = up ] && return 0; else [ "$want" = down ] && return 0; fi
    sleep 0.1
  done
  return 1
}

case "$action" in
  status)
    if running; then
      servers=$(echo get_server_list | nvidia-cuda-mps-control | tr '\n' ' ')
      echo "mps: control daemon running (pipes $pipe, logs $CUDA_MPS_LOG_DIRECTORY; servers: ${servers:-none yet})"
      echo "$exports"
    else
      echo "mps: no control daemon answers in $pipe"
    fi
    ;;
  start)
    if running; then
      echo "mps: control daemon already running in $pipe; left as it is"
    else
      mkdir -p "$pipe" "$CUDA_MPS_LOG_DIRECTORY"
      nvidia-cuda-mps-control -d
      if ! wait_for up 10; then
        echo "mps: started nvidia-cuda-mps-control -d but it does not answer in $pipe after 10 s" \
             "(see $CUDA_MPS_LOG_DIRECTORY/control.log)" >&2
        exit 1
      fi
      echo "mps: started the control daemon (pipes $pipe, logs $CUDA_MPS_LOG_DIRECTORY)"
    fi
    echo "$exports"
    ;;
  stop)
    if ! running; then
      echo "mps: no control daemon answers in $pipe; nothing to stop"
    else
      # quit stops accepting clients, waits for the running ones to finish, then exits.
      echo quit | nvidia-cuda-mps-control
      if ! wait_for down 30; then
        echo "mps: asked the control daemon in $pipe to quit, still answering after 30 s" \
             "(clients still running? see $CUDA_MPS_LOG_DIRECTORY/control.log)" >&2
        exit 1
      fi
      echo "mps: stopped the control daemon in $pipe"
    fi
    ;;
esac
