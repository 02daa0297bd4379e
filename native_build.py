"""How setup.py builds `uccl_ep_train._native` (one place for compiler discovery and flags).

Sources: csrc/**/*.cpp (host: proxy, transports, bindings) always; csrc/**/*.cu (kernels) only when nvcc
or hipcc is found. Optional transports are switched on by the headers present:
  UCCL_EP_WITH_FABRIC (rdma/fabric.h), UCCL_EP_WITH_VERBS (infiniband/verbs.h), UCCL_EP_WITH_CUDA / _HIP.
UCCL_EP_LIBFABRIC=<prefix> builds the fabric transport against the libfabric installed there (its
include/ and lib/, with that lib/ as the module's run path, also relative to the module when the prefix is
inside the tree, so a copy of the tree elsewhere finds it) instead of the system's: a CUDA-enabled one
from scripts/build_libfabric.sh (default prefix build/libfabric) for FI_HMEM tests. Changing it relinks.
Nothing is linked statically that torch also carries (libstdc++ stays shared).
"""
from __future__ import annotations

import functools
import glob
import os
import shutil
import subprocess
import sys

from setuptools import Extension
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def _have_header(name: str) -> bool:
    return any(os.path.exists(os.path.join(d, name)) for d in ("/usr/include", "/usr/local/include"))


def _cuda_home(nvcc: str) -> str:
    """CUDA_HOME, else the toolkit that nvcc belongs to (following wrapper scripts and symlinks)."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    real = os.path.realpath(nvcc)
    home = os.path.dirname(os.path.dirname(real))
    if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
        return home
    for cand in ("/usr/local/cuda", "/opt/cuda"):
        if os.path.exists(os.path.join(cand, "include", "cuda_runtime.h")):
            return cand
    return home


def _libfabric_prefix() -> str | None:
    """The libfabric prefix of UCCL_EP_LIBFABRIC (absolute), checked to hold headers and library; None when
    unset (the system libfabric, if its headers are installed). Fails the build at once when the setting
    cannot be honoured, rather than silently building against the system's libfabric."""
    prefix = os.environ.get("UCCL_EP_LIBFABRIC")
    if not prefix:
        return None
    prefix = os.path.abspath(prefix)
    missing = [p for p in ("include/rdma/fabric.h", "lib/libfabric.so") if not os.path.exists(os.path.join(prefix, p))]
    if missing:
        raise SystemExit(f"UCCL_EP_LIBFABRIC={prefix}: no {' or '.join(missing)} there; set it to a libfabric install "
                         "prefix, e.g. the one scripts/build_libfabric.sh installs (build/libfabric)")
    if os.environ.get("UCCL_EP_NO_FABRIC") == "1":
        raise SystemExit("UCCL_EP_LIBFABRIC and UCCL_EP_NO_FABRIC=1 contradict each other: unset one of them")
    return prefix


def _setting_stamp(name: str, value: str) -> str:
    """A file under build/ holding a build setting's value, rewritten only when the value changes: listed in
    the extension's depends, so setuptools relinks the module when the setting changes (it compares only
    file times)."""
    path = os.path.join(ROOT, "build", f"setting-{name}")
    old = open(path).read() if os.path.exists(path) else None
    if old != value:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(value)
    return path


def _torch():
    """torch when the build environment has it (it decides which GPU toolchain and targets fit), else None."""
    try:
        import torch
    except Exception:  # an isolated build environment without torch
        return None
    return torch


def _nvcc() -> str | None:
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if not nvcc:
        cand = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
        nvcc = cand if os.path.exists(cand) else None
    return nvcc


def _hipcc() -> str | None:
    hipcc = shutil.which("hipcc")
    if not hipcc:
        cand = os.path.join(os.environ.get("ROCM_PATH", "/opt/rocm"), "bin", "hipcc")
        hipcc = cand if os.path.exists(cand) else None
    return hipcc


def find_gpu_compiler() -> tuple[str, str] | tuple[None, None]:
    """('cuda', nvcc) or ('hip', hipcc) or (None, None); UCCL_EP_GPU=cuda|hip|none overrides. Automatically:
    the toolchain of the torch present (a ROCm torch builds with hipcc), else nvcc, else hipcc (ROCm's
    hipcc on an AMD machine is found without any setting)."""
    want = os.environ.get("UCCL_EP_GPU", "auto")
    if want == "none":
        return None, None
    torch = _torch()
    rocm_torch = torch is not None and getattr(torch.version, "hip", None)
    order = {"cuda": ["cuda"], "hip": ["hip"]}.get(want, ["hip", "cuda"] if rocm_torch else ["cuda", "hip"])
    for kind in order:
        compiler = _nvcc() if kind == "cuda" else _hipcc()
        if compiler:
            return kind, compiler
    return None, None


@functools.lru_cache(maxsize=None)
def gpu_archs(kind: str) -> tuple[str, ...]:
    """The GPU targets: UCCL_EP_CUDA_ARCHS / UCCL_EP_HIP_ARCHS (comma-separated) if set, else those of the
    GPUs torch sees here, else the defaults (CUDA: 90, Hopper; HIP: gfx942 and gfx950, MI300 and MI350).
    CUDA builds also embed PTX of the newest target, so newer GPUs run the kernels (JIT at first load)."""
    var, default = ("UCCL_EP_CUDA_ARCHS", ("90",)) if kind == "cuda" else ("UCCL_EP_HIP_ARCHS", ("gfx942", "gfx950"))
    if os.environ.get(var):
        return tuple(a.strip() for a in os.environ[var].split(",") if a.strip())
    torch = _torch()
    try:
        if torch is not None and torch.cuda.is_available():
            props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
            seen = sorted({(f"{p.major}{p.minor}" if kind == "cuda" else p.gcnArchName.split(":")[0]) for p in props})
            if seen:
                return tuple(seen)
    except Exception:  # a driver problem: build for the defaults
        pass
    return default


class NativeBuildExt(build_ext):
    """Compiles .cu files with nvcc/hipcc into objects, then lets setuptools link them with the host code."""

    def build_extension(self, ext):
        kind, compiler = find_gpu_compiler()
        cu_sources = [s for s in ext.sources if s.endswith(".cu")]
        ext.sources = [s for s in ext.sources if not s.endswith(".cu")]
        objects = []
        if kind and cu_sources:
            objects = self._compile_gpu(kind, compiler, cu_sources, ext)
        ext.extra_objects = list(ext.extra_objects or []) + objects
        self._parallel_compile()
        try:
            super().build_extension(ext)
        except Exception as exc:  # a missing toolchain must not break the pure-Python install
            if os.environ.get("UCCL_EP_REQUIRE_NATIVE") == "1":
                raise
            print(f"[uccl-ep-train] native module not built ({exc}); the reference backend will be used",
                  file=sys.stderr)

    def _parallel_compile(self):
        """Compile host sources on all cores (setuptools compiles one file at a time)."""
        compiler = self.compiler
        orig = compiler.compile

        def compile_parallel(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                             extra_preargs=None, extra_postargs=None, depends=None):
            macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs)
            cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

            def one(obj):
                src, ext = build[obj]
                compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

            _run_on_jobs(one, objects)
            return objects

        if _jobs() > 1 and hasattr(compiler, "_setup_compile"):
            compiler.compile = compile_parallel
        else:
            compiler.compile = orig

    def _compile_gpu(self, kind, compiler, sources, ext):
        build_dir = os.path.join(self.build_temp, "gpu")
        os.makedirs(build_dir, exist_ok=True)
        includes = [f"-I{d}" for d in ext.include_dirs]
        defines = [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in ext.define_macros]
        if kind == "cuda":
            archs = gpu_archs("cuda")
            flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
                     "-DUCCL_EP_WITH_CUDA=1", "-lineinfo"]
            flags += [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
            newest = max(archs, key=int)
            flags += [f"-gencode=arch=compute_{newest},code=compute_{newest}"]  # PTX for newer GPUs
            host_cxx = os.environ.get("CXX")
            if host_cxx:
                flags += ["-ccbin", host_cxx]
        else:
            archs = gpu_archs("hip")
            flags = ["-O3", "-std=c++17", "-fPIC", "-DUCCL_EP_WITH_HIP=1", "-x", "hip"]
            flags += [f"--offload-arch={a}" for a in archs]
        objects, stale = [], []
        # Headers any kernel may include: an object newer than its source and all of them is reused.
        headers = [h for pat in ("csrc/**/*.h", "csrc/**/*.cuh") for h in glob.glob(pat, recursive=True)]
        newest_header = max((os.path.getmtime(h) for h in headers), default=0.0)
        stamp = " ".join(flags + includes + defines)
        for src in sources:
            obj = os.path.join(build_dir, os.path.basename(src).replace(".cu", ".o"))
            objects.append(obj)
            stamp_file = obj + ".flags"
            if not (os.path.exists(obj) and os.path.exists(stamp_file)
                    and os.path.getmtime(obj) > max(os.path.getmtime(src), newest_header)
                    and open(stamp_file).read() == stamp):
                stale.append((src, obj))

        def one(item: tuple) -> None:
            src, obj = item
            cmd = [compiler, "-c", src, "-o", obj] + flags + includes + defines
            print(" ".join(cmd), file=sys.stderr)
            subprocess.check_call(cmd)
            with open(obj + ".flags", "w") as f:
                f.write(stamp)

        # The largest source first: one kernel file takes most of the time (intranode.cu, ~2 of the ~4 minutes on
        # one core), so the others compile beside it.
        stale.sort(key=lambda item: -os.path.getsize(item[0]))
        _run_on_jobs(one, stale)
        return objects


def _jobs() -> int:
    """Compile workers: MAX_JOBS (the variable torch's and most native builds read), else all cores."""
    return max(1, int(os.environ.get("MAX_JOBS", os.cpu_count() or 1)))


def _run_on_jobs(fn, items) -> None:
    """Runs fn on every item on _jobs() threads (the compilers are separate processes); the first failure raises."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max_workers=_jobs()) as pool:
        list(pool.map(fn, items))


def native_build_kwargs() -> dict:
    if os.environ.get("UCCL_EP_NO_NATIVE") == "1":
        return {}
    # UCCL_EP_NATIVE_EXCLUDE=csrc/kernels[,...]: leave subtrees out (e.g. to build the proxy alone).
    exclude = [e.strip().rstrip("/") + "/" for e in os.environ.get("UCCL_EP_NATIVE_EXCLUDE", "").split(",") if e.strip()]
    keep = lambda path: not any(path.startswith(e) for e in exclude)  # noqa: E731
    cpp = sorted(p for p in glob.glob("csrc/**/*.cpp", recursive=True) if keep(p))
    if not cpp:
        return {}
    try:
        import pybind11
    except ImportError:
        print("[uccl-ep-train] pybind11 missing: native module skipped", file=sys.stderr)
        return {}
    kind, _ = find_gpu_compiler()
    sources = cpp + (sorted(p for p in glob.glob("csrc/**/*.cu", recursive=True) if keep(p)) if kind else [])
    define_macros, libraries, library_dirs, include_dirs = [], ["pthread"], [], [pybind11.get_include(), "csrc"]
    runtime_library_dirs = []
    if kind:  # what the kernels were compiled for (`_native.GPU_ARCHS`, Buffer.is_sm90_compiled)
        define_macros.append(("UCCL_EP_GPU_ARCHS", '"' + ",".join(gpu_archs(kind)) + '"'))
    if kind == "cuda":
        define_macros.append(("UCCL_EP_WITH_CUDA", "1"))
        cuda_home = _cuda_home(find_gpu_compiler()[1])
        include_dirs.append(os.path.join(cuda_home, "include"))
        library_dirs += [os.path.join(cuda_home, "lib64")]
        runtime_library_dirs += [os.path.join(cuda_home, "lib64")]
        libraries += ["cudart"]  # never -lcuda: the module must import on machines without a driver
    elif kind == "hip":
        define_macros.append(("UCCL_EP_WITH_HIP", "1"))
        libraries += ["amdhip64"]
    extra_compile_args = ["-O3", "-std=c++17", "-fvisibility=hidden"]
    fabric_prefix = _libfabric_prefix()
    if fabric_prefix:
        # -I for the host sources only (no kernel includes libfabric): the kernels' objects stay valid.
        extra_compile_args.append(f"-I{os.path.join(fabric_prefix, 'include')}")
        fabric_lib = os.path.join(fabric_prefix, "lib")
        library_dirs.append(fabric_lib)
        runtime_library_dirs.append(fabric_lib)
        if fabric_lib.startswith(ROOT + os.sep):  # a prefix inside the tree travels with it (to a GPU machine)
            runtime_library_dirs.append("$ORIGIN/" + os.path.relpath(fabric_lib, os.path.join(ROOT, "uccl_ep_train")))
    if (fabric_prefix or _have_header("rdma/fabric.h")) and os.environ.get("UCCL_EP_NO_FABRIC") != "1":
        define_macros.append(("UCCL_EP_WITH_FABRIC", "1"))
        libraries.append("fabric")
    if _have_header("infiniband/verbs.h") and os.environ.get("UCCL_EP_NO_VERBS") != "1":
        define_macros.append(("UCCL_EP_WITH_VERBS", "1"))
        libraries.append("ibverbs")
    # Any header or kernel change must relink: setuptools compares these with the built module.
    depends = sorted(p for pat in ("csrc/**/*.h", "csrc/**/*.cuh", "csrc/**/*.cu")
                     for p in glob.glob(pat, recursive=True) if keep(p))
    depends.append(_setting_stamp("UCCL_EP_LIBFABRIC", fabric_prefix or ""))
    ext = Extension(
        "uccl_ep_train._native",
        sources=sources,
        depends=depends,
        include_dirs=include_dirs,
        define_macros=define_macros,
        libraries=libraries,
        library_dirs=library_dirs,
        runtime_library_dirs=runtime_library_dirs,
        extra_compile_args=extra_compile_args,
        language="c++",
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": NativeBuildExt}}
