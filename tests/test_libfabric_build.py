"""The libfabric of UCCL_EP_LIBFABRIC=<prefix> (scripts/build_libfabric.sh; native_build.py) as built and used.

The native module built with the setting must load that prefix's libfabric, not the system's libfabric.so.1
of the same soname, which would silently lack CUDA; that libfabric must dlopen CUDA rather than link it, so
it loads on machines without a driver. tests/fabric_hmem_probe.cpp, compiled against the prefix, moves a
pattern host -> region -> host by RMA writes to its own endpoint: on host memory over shm and tcp here
(which also proves the probe checks what it claims), and on CUDA memory over shm on a GPU (`gpu`): the proof
that this libfabric registers and writes GPU memory (FI_HMEM), independent of the fabric transport.
Skipped unless UCCL_EP_LIBFABRIC is set (as for the build) in the test's environment.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PREFIX = os.environ.get("UCCL_EP_LIBFABRIC")
pytestmark = pytest.mark.skipif(not PREFIX, reason="UCCL_EP_LIBFABRIC not set: the module uses the system libfabric")

# Run in a fresh interpreter: its mappings show only what importing the module loaded.
_LOADED = """
import uccl_ep_train._native as n
print(",".join(n.compiled_transports()))
with open("/proc/self/maps") as maps:
    for path in sorted({line.split()[-1] for line in maps if "libfabric.so" in line}):
        print(path)
"""


def _prefix_lib() -> str:
    return os.path.realpath(os.path.join(PREFIX, "lib"))


def _prefix_version() -> str:
    """major.minor of the prefix's libfabric, from its pkg-config file."""
    text = Path(_prefix_lib(), "pkgconfig", "libfabric.pc").read_text()
    return re.search(r"^Version:\s*(\d+\.\d+)", text, re.M).group(1)


def _compile_probe(out: Path, cuda: bool) -> Path:
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        pytest.skip("no C++ compiler (g++ or CXX) to build tests/fabric_hmem_probe.cpp")
    lib = _prefix_lib()
    cmd = [cxx, "-std=c++17", "-O2", "-Wall", str(ROOT / "tests" / "fabric_hmem_probe.cpp"), "-o", str(out),
           f"-I{os.path.join(PREFIX, 'include')}", f"-L{lib}", "-lfabric", f"-Wl,-rpath,{lib}"]
    if cuda:
        sys.path.insert(0, str(ROOT))
        import native_build  # the one place that finds the CUDA toolkit

        nvcc = native_build._nvcc()
        if not nvcc:
            pytest.fail("no nvcc: the CUDA probe needs the CUDA toolkit (set CUDA_HOME)")
        home = native_build._cuda_home(nvcc)
        cuda_lib = next((d for d in (os.path.join(home, "lib64"), os.path.join(home, "lib"))
                         if os.path.exists(os.path.join(d, "libcudart.so"))), None)
        assert cuda_lib, f"no libcudart.so under {home}/lib64 or {home}/lib"
        cmd += ["-DPROBE_CUDA", f"-I{os.path.join(home, 'include')}", f"-L{cuda_lib}", "-lcudart",
                f"-Wl,-rpath,{cuda_lib}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"compiling the probe failed:\n{' '.join(cmd)}\n{done.stderr}"
    return out


def _probe(binary: Path, provider: str, memory: str) -> str:
    env = dict(os.environ, FI_LOG_LEVEL="warn")  # libfabric's own reason lands in the failure message
    done = subprocess.run([str(binary), provider, memory], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, f"{provider} on {memory} memory failed:\n{done.stdout}{done.stderr}"
    assert done.stdout.startswith(f"ok {provider} {memory}:"), done.stdout
    version = re.search(r"libfabric (\d+\.\d+)", done.stdout).group(1)
    assert version == _prefix_version(), f"the probe ran libfabric {version}, the prefix holds {_prefix_version()}"
    return done.stdout


def test_module_loads_the_prefix_libfabric():
    done = subprocess.run([sys.executable, "-c", _LOADED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"importing uccl_ep_train._native failed:\n{done.stderr}"
    transports, *loaded = done.stdout.split()
    assert "fabric" in transports.split(","), f"fabric transport not compiled in (transports: {transports})"
    assert loaded, "no libfabric.so mapped after importing the module"
    assert all(os.path.dirname(os.path.realpath(p)) == _prefix_lib() for p in loaded), \
        f"the module loaded {loaded}, not the libfabric in {_prefix_lib()}"


def test_prefix_libfabric_dlopens_cuda():
    lib = os.path.join(PREFIX, "lib", "libfabric.so.1")
    done = subprocess.run(["objdump", "-p", lib], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"objdump -p {lib} failed: {done.stderr}"
    needed = [line.split()[1] for line in done.stdout.splitlines() if line.split()[:1] == ["NEEDED"]]
    assert needed, f"objdump -p {lib} lists no NEEDED libraries"
    linked = [n for n in needed if n.startswith(("libcuda.", "libcudart.", "libnvidia-ml."))]
    assert not linked, f"{lib} links {linked}: build it with CUDA dlopen (scripts/build_libfabric.sh)"


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
def test_probe_writes_host_memory(tmp_path, provider):
    _probe(_compile_probe(tmp_path / "probe", cuda=False), provider, "host")


@pytest.mark.gpu
def test_probe_writes_cuda_memory_over_shm(tmp_path):
    _probe(_compile_probe(tmp_path / "probe_cuda", cuda=True), "shm", "cuda")
