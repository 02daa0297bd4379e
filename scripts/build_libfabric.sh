#!/usr/bin/env bash
# Build a CUDA-enabled libfabric (FI_HMEM) for testing the fabric transport on GPU memory.
#
# Why: distribution libfabrics (Debian's 1.17, the GPU machines' 1.17) are built without CUDA, so their
# providers refuse FI_HMEM registrations of device memory. This builds the pinned release below with
# CUDA HMEM and the providers the fabric transport uses -- tcp + rxm (csrc/transport/fabric.cpp asks for
# "tcp;ofi_rxm"), shm, sockets (tests/test_fabric.py), efa (compiled against rdma-core; it needs an EFA
# device to run) -- into a small prefix that the native module is then built against with
# UCCL_EP_LIBFABRIC=<prefix> (see native_build.py, docs/proxy.md). efa is a plugin (lib/libfabric/, found
# through libfabric's built-in path or FI_PROVIDER_PATH), so libfabric.so itself links libc alone and loads
# on machines without rdma-core.
#
# Usage: scripts/build_libfabric.sh [SOURCE] [PREFIX]
#   SOURCE  a libfabric source directory or tarball of the pinned release; without it the pinned tag is
#           cloned from GitHub.
#   PREFIX  where to install (default build/libfabric; build/ is git-ignored).
# Needs: a C compiler, make, autoconf, automake, libtool (for git sources, which have no configure yet;
# apt-get install autoconf automake libtool), rdma-core headers (libibverbs-dev, for efa), a CUDA
# toolkit (CUDA_HOME, else the one nvcc belongs to, found as native_build.py finds it) and its NVML header
# (when the toolkit lacks it, pip downloads NVIDIA's nvidia-nvml-dev package of the same CUDA version).
# MAX_JOBS sets make's parallelism (default: all cores).
#
# CUDA is loaded at run time (--enable-cuda-dlopen; libfabric's own default is to link libcudart/libcuda):
# the prefix loads on machines without a driver and uses whichever CUDA 13 driver the GPU machine has.
# libfabric dlopens the unversioned "libcudart.so": it is found through LD_LIBRARY_PATH, the ld.so cache,
# or the toolkit's library directory that this build records as libfabric's run path.
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned: the newest libfabric release when this was written (2.x; CUDA FI_HMEM in shm and efa, in rxm over
# a core provider that has it; tcp has none). Change both together; the clone is checked against the commit.
LIBFABRIC_TAG=v2.6.0
LIBFABRIC_COMMIT=5de2d6a2df83595bcc38531cb91bf59495559495
LIBFABRIC_URL=https://github.com/ofiwg/libfabric.git

log() { echo "[build_libfabric] $*" >&2; }
die() { log "error: $*"; exit 1; }

source_arg=${1:-}
prefix=${2:-build/libfabric}
case "$prefix" in /*) ;; *) prefix="$PWD/$prefix" ;; esac
work="$PWD/build/libfabric-work"
jobs=${MAX_JOBS:-$(nproc)}
stamp="$prefix/.built-by-build_libfabric"  # marks a prefix this script may replace
if [ -d "$prefix" ] && [ ! -f "$stamp" ] && [ -n "$(ls -A "$prefix")" ]; then
  die "PREFIX '$prefix' exists and was not made by this script: pass a new or empty directory"
fi

need() { command -v "$1" >/dev/null || die "'$1' not found: $2"; }
need make "install make (apt-get install build-essential)"
need cc "install a C compiler (apt-get install build-essential)"
need objdump "install binutils (it checks what the built libraries link)"
[ -f /usr/include/infiniband/efadv.h ] || die "infiniband/efadv.h not found: the efa provider needs rdma-core headers (apt-get install libibverbs-dev)"

# The CUDA toolkit: the same discovery as the native module's build (native_build.py).
python=${PYTHON:-python3}
cuda_home=$("$python" -c 'import native_build as nb; nvcc = nb._nvcc(); print(nb._cuda_home(nvcc) if nvcc else "")') \
  || die "could not run native_build.py's CUDA discovery with $python (set PYTHON to a Python with setuptools)"
[ -n "$cuda_home" ] || die "no nvcc found: install a CUDA toolkit or set CUDA_HOME"
[ -f "$cuda_home/include/cuda_runtime.h" ] || die "no include/cuda_runtime.h under '$cuda_home': set CUDA_HOME to the CUDA toolkit root"
cuda_lib=""
for d in "$cuda_home/lib64" "$cuda_home/lib"; do
  if [ -e "$d/libcudart.so" ]; then cuda_lib=$d; break; fi
done
[ -n "$cuda_lib" ] || die "no libcudart.so under $cuda_home/lib64 or $cuda_home/lib: set CUDA_HOME to a full CUDA toolkit"
cuda_version=$("$cuda_home/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
[ -n "$cuda_version" ] || die "could not read the CUDA version from $cuda_home/bin/nvcc --version"
log "CUDA $cuda_version toolkit: $cuda_home (runtime in $cuda_lib)"

# libfabric's CUDA code includes nvml.h, which toolkits installed without the NVML component lack: then
# the header comes from NVIDIA's PyPI package of the toolkit's version (headers only, used at compile time).
fetch_nvml_header() {
  local major=${cuda_version%%.*} pkg
  if [ "$major" -ge 13 ]; then pkg="nvidia-nvml-dev==$cuda_version.*"; else pkg="nvidia-nvml-dev-cu$major==$cuda_version.*"; fi
  log "no nvml.h in $cuda_home/include: taking it from the PyPI package $pkg"
  "$python" -m pip download -q --no-deps -d "$work/nvml" "$pkg" >&2 \
    || die "pip could not download $pkg: install the CUDA toolkit's NVML headers (cuda-nvml-dev) instead"
  (cd "$work/nvml" && "$python" -m zipfile -e ./*.whl .) || die "could not unpack $pkg"
  local header
  header=$(find "$work/nvml" -name nvml.h | head -1)
  [ -n "$header" ] || die "$pkg has no nvml.h"
  dirname "$header"
}

# The source tree: a directory, a tarball unpacked into $work, or a fresh clone of the pinned tag.
if [ -n "$source_arg" ] && [ -e "$source_arg" ]; then
  case "$(cd "$(dirname "$source_arg")" && pwd)/" in
    "$work"/*) die "SOURCE '$source_arg' lies in $work, which this script clears: pass a source outside it" ;;
  esac
fi
rm -rf "$work"
mkdir -p "$work"
if [ -z "$source_arg" ]; then
  need git "install git, or pass a libfabric $LIBFABRIC_TAG source directory or tarball"
  log "cloning $LIBFABRIC_URL at $LIBFABRIC_TAG"
  git -c advice.detachedHead=false clone -q --depth 1 --branch "$LIBFABRIC_TAG" "$LIBFABRIC_URL" "$work/src" \
    || die "could not clone $LIBFABRIC_URL: pass a libfabric $LIBFABRIC_TAG source directory or tarball"
  got=$(git -C "$work/src" rev-parse HEAD)
  [ "$got" = "$LIBFABRIC_COMMIT" ] || die "$LIBFABRIC_TAG is commit $got, expected $LIBFABRIC_COMMIT"
  src="$work/src"
elif [ -d "$source_arg" ]; then
  src=$(cd "$source_arg" && pwd)
elif [ -f "$source_arg" ]; then
  mkdir -p "$work/src"
  tar -xf "$source_arg" -C "$work/src" --strip-components=1 || die "could not unpack '$source_arg' (a libfabric source tarball?)"
  src="$work/src"
else
  die "SOURCE '$source_arg' is neither a directory nor a file: pass a libfabric $LIBFABRIC_TAG source directory or tarball, or nothing to clone it"
fi
[ -f "$src/configure.ac" ] && grep -q 'AC_INIT(\[libfabric\]' "$src/configure.ac" \
  || die "'$src' is not a libfabric source tree (no configure.ac with AC_INIT([libfabric]...))"
version=$(sed -n 's/^AC_INIT(\[libfabric\], \[\([^]]*\)\].*/\1/p' "$src/configure.ac")
[ "v$version" = "$LIBFABRIC_TAG" ] || die "the source is libfabric $version, this script pins $LIBFABRIC_TAG: pass that release"
log "libfabric $version from $src"

if [ ! -x "$src/configure" ]; then  # a git tree: generate configure
  for tool in autoconf automake libtoolize; do
    need "$tool" "a git source needs autotools: apt-get install autoconf automake libtool"
  done
  log "autogen.sh"
  (cd "$src" && ./autogen.sh) >"$work/autogen.log" 2>&1 || { tail -20 "$work/autogen.log" >&2; die "autogen.sh failed (log: $work/autogen.log)"; }
fi

nvml_cppflags=""
[ -f "$cuda_home/include/nvml.h" ] || nvml_cppflags="-I$(fetch_nvml_header)"

# Out-of-tree build, so a source directory passed in is left as it was (apart from autogen's outputs).
# Optional libraries that configure would pick up when present (ROCm, numa, liburing, ...) are off: the
# prefix must load on the GPU machine as built here.
mkdir -p "$work/obj"
cd "$work/obj"
log "configure (log: $work/configure.log)"
"$src/configure" --prefix="$prefix" --disable-static \
  --with-cuda="$cuda_home" --enable-cuda-dlopen \
  --enable-only --enable-tcp=yes --enable-rxm=yes --enable-shm=yes --enable-sockets=yes --enable-efa=dl \
  --with-rocr=no --with-ze=no --with-neuron=no --with-synapseai=no --with-gdrcopy=no --with-dsa=no \
  --with-uring=no --with-numa=no --with-lttng=no --disable-kdreg2 --disable-xpmem \
  --with-libnl=no --with-curl=no --with-json-c=no \
  CPPFLAGS="$nvml_cppflags" LDFLAGS="-Wl,-rpath,$cuda_lib" >"$work/configure.log" 2>&1 \
  || { tail -30 "$work/configure.log" >&2; die "configure failed (log: $work/configure.log)"; }
grep -q '^#define HAVE_CUDA 1' config.h || die "configure did not enable CUDA (see $work/configure.log)"
grep -q '^#define ENABLE_CUDA_DLOPEN 1' config.h || die "configure did not enable CUDA dlopen (see $work/configure.log)"

log "make -j$jobs (log: $work/make.log)"
make -j"$jobs" >"$work/make.log" 2>&1 || { grep -m20 -i 'error' "$work/make.log" >&2; die "make failed (log: $work/make.log)"; }
rm -rf "$prefix"
make install-strip >"$work/install.log" 2>&1 || { tail -20 "$work/install.log" >&2; die "make install failed (log: $work/install.log)"; }
# Only what running and compiling against it needs: no man pages, no libtool archives.
rm -rf "$prefix/share/man" "$prefix/share/doc"
find "$prefix/lib" -name '*.la' -delete
echo "libfabric $version, CUDA $cuda_home" >"$stamp"

lib="$prefix/lib/libfabric.so.1"
[ -e "$lib" ] || die "no $lib after install"
efa_plugin="$prefix/lib/libfabric/libefa-fi.so"
[ -e "$efa_plugin" ] || die "no efa plugin $efa_plugin after install"
# What the libraries link: libc alone (plus rdma-core for the efa plugin). Anything else -- CUDA linked
# instead of dlopened, a ROCm or other optional library configure picked up here -- would make the prefix
# fail to load on a GPU machine without it.
for l in "$lib" "$efa_plugin"; do
  extra=$(objdump -p "$l" | awk '$1 == "NEEDED" {print $2}' \
          | grep -vE '^(libc|libdl|libpthread|librt|libm|ld-linux-x86-64|ld-linux-aarch64|libfabric|libefa|libibverbs)\.so' || true)
  [ -z "$extra" ] || die "$l links $(echo $extra): only libc (and rdma-core for efa) may be linked; CUDA is dlopened"
done
log "providers: $(LD_LIBRARY_PATH="$prefix/lib" "$prefix/bin/fi_info" -l 2>/dev/null | grep -o '^[a-z_0-9]*:' | tr -d ':' | sort -u | tr '\n' ' ')"
log "installed $prefix ($(du -sh "$prefix" | cut -f1)); build the module with UCCL_EP_LIBFABRIC=$prefix"
