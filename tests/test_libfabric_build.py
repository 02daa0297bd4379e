"""The native module built with UCCL_EP_LIBFABRIC=<prefix> (native_build.py) uses that prefix's libfabric.

Built against a CUDA-enabled libfabric from scripts/build_libfabric.sh, the module must load that library,
not the system's libfabric.so.1 of the same soname, which would silently lack FI_HMEM; and that libfabric
must dlopen CUDA rather than link it, so the module still imports on machines without a driver.
Skipped unless UCCL_EP_LIBFABRIC is set (as for the build) in the test's environment.
"""
import os
import subprocess
import sys

import pytest

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


def test_module_loads_the_prefix_libfabric():
    lib_dir = os.path.realpath(os.path.join(PREFIX, "lib"))
    done = subprocess.run([sys.executable, "-c", _LOADED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"importing uccl_ep_train._native failed:\n{done.stderr}"
    transports, *loaded = done.stdout.split()
    assert "fabric" in transports.split(","), f"fabric transport not compiled in (transports: {transports})"
    assert loaded, "no libfabric.so mapped after importing the module"
    assert all(os.path.dirname(os.path.realpath(p)) == lib_dir for p in loaded), \
        f"the module loaded {loaded}, not the libfabric in {lib_dir}"


def test_prefix_libfabric_dlopens_cuda():
    lib = os.path.join(PREFIX, "lib", "libfabric.so.1")
    done = subprocess.run(["objdump", "-p", lib], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"objdump -p {lib} failed: {done.stderr}"
    needed = [line.split()[1] for line in done.stdout.splitlines() if line.split()[:1] == ["NEEDED"]]
    assert needed, f"objdump -p {lib} lists no NEEDED libraries"
    linked = [n for n in needed if n.startswith(("libcuda.", "libcudart.", "libnvidia-ml."))]
    assert not linked, f"{lib} links {linked}: build it with CUDA dlopen (scripts/build_libfabric.sh)"
