#!/usr/bin/env bash
# Compile-check the native module for AMD with HIP, so the AMD path stays honest on machines without an
# AMD GPU: every csrc/**/*.cu with hipcc (device + host passes), every csrc/**/*.cpp with the host compiler
# against the HIP runtime headers (as native_build.py builds them for ROCm). Installs Debian's hipcc (ROCm 5.2) when it is missing and apt can.
# ROCm 5.2 does not know gfx942 (MI300X): check gfx90a here; real ROCm builds add gfx942 (native_build.py).
# Usage: scripts/check_hip_build.sh [offload-arch]     Exit status: 0 ok, 1 compile error, 2 no hipcc.
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH="${1:-gfx90a}"

if ! command -v hipcc >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "check_hip_build: installing hipcc (Debian ROCm packages)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends hipcc >/dev/null 2>&1 ||
      { apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends hipcc >/dev/null; } ||
      { echo "check_hip_build: could not install hipcc" >&2; exit 2; }
  else
    echo "check_hip_build: hipcc not found (and cannot apt-get install it here)" >&2
    exit 2
  fi
fi

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
status=0
pids=()
mapfile -t srcs < <(find csrc -name '*.cu' | sort)
for src in "${srcs[@]}"; do
  obj="$OUT/$(basename "$src" .cu).o"
  # HIP_PLATFORM=amd: without it Debian's hipcc hands the file to nvcc
  HIP_PLATFORM=amd hipcc -x hip --offload-arch="$ARCH" -std=c++17 -O2 -fPIC -DUCCL_EP_WITH_HIP=1 -Icsrc \
    -c "$src" -o "$obj" >"$obj.log" 2>&1 &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then
    echo "check_hip_build: ok    ${srcs[$i]} ($ARCH)"
  else
    echo "check_hip_build: FAIL  ${srcs[$i]} ($ARCH)"
    cat "$OUT/$(basename "${srcs[$i]}" .cu).o.log"
    status=1
  fi
done
# host code (proxy, transports, bindings) against the HIP runtime headers
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
incs=(-Icsrc "-I$("$PY" -c 'import pybind11; print(pybind11.get_include())')"
      "-I$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')")
# The optional transports' HIP paths (FI_HMEM_ROCR, DMA-BUF through HSA) are checked where their headers exist.
transports=()
[ -e /usr/include/rdma/fabric.h ] && transports+=(-DUCCL_EP_WITH_FABRIC=1)
[ -e /usr/include/infiniband/verbs.h ] && transports+=(-DUCCL_EP_WITH_VERBS=1)
while IFS= read -r src; do
  if g++ -std=c++17 -fPIC -fsyntax-only -DUCCL_EP_WITH_HIP=1 -D__HIP_PLATFORM_AMD__ "${transports[@]}" "${incs[@]}" "$src" \
      >"$OUT/host.log" 2>&1; then
    echo "check_hip_build: ok    $src (host, HIP runtime)"
  else
    echo "check_hip_build: FAIL  $src (host, HIP runtime)"
    cat "$OUT/host.log"
    status=1
  fi
done < <(find csrc -name '*.cpp' | sort)
exit $status
