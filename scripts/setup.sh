#!/usr/bin/env bash
# Set up uccl-ep-train on a fresh Debian/Ubuntu machine: apt packages, a Python >= 3.12 virtual
# environment at .venv in the repo root, and the project installed into it (editable).
# Idempotent: a second run only re-checks. Set UCCL_SETUP_SKIP_APT=1 to skip the apt step.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(libfabric-dev libfabric-bin libibverbs-dev ibverbs-providers rdma-core)

log() { echo "[setup] $*" >&2; }

install_apt() {
  [ "${UCCL_SETUP_SKIP_APT:-0}" = 1 ] && return 0
  command -v apt-get >/dev/null || { log "no apt-get: install ${APT_PACKAGES[*]} yourself"; return 0; }
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""; [ "$(id -u)" != 0 ] && sudo="sudo"
  log "apt-get install ${missing[*]}"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

find_python() {
  # megatron-core 0.17+ needs Python >= 3.12; prefer an explicit choice, then PATH, then pyenv.
  local cands=("${UCCL_PYTHON:-}" python3.13 python3.12 python3)
  if command -v pyenv >/dev/null; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -rV); do
      cands+=("$(pyenv root)/versions/$v/bin/python3")
    done
  fi
  for c in "${cands[@]}"; do
    [ -n "$c" ] || continue
    command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
    if "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  log "no Python >= 3.12 found: install one (e.g. 'pyenv install 3.12' or apt python3.12) or set UCCL_PYTHON"
  return 1
}

install_apt
if [ ! -x .venv/bin/python ]; then
  py=$(find_python)
  log "creating .venv with $py ($("$py" --version))"
  "$py" -m venv .venv
fi
stamp=.venv/.uccl-installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ -n "$(find csrc -newer "$stamp" -type f 2>/dev/null | head -1)" ]; then
  log "installing the project into .venv (first time: torch + megatron-core, a few GB)"
  .venv/bin/python -m pip install -q --upgrade pip setuptools wheel pybind11
  .venv/bin/python -m pip install -q --no-build-isolation -e '.[megatron,plot,test]'
  touch "$stamp"
fi
log "ready: $(.venv/bin/python -c 'import uccl_ep_train, torch; print("uccl_ep_train", uccl_ep_train.__version__, "torch", torch.__version__)')"
