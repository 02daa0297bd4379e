"""Build and install uccl-ep-train.

The pure-Python packages (`uccl_ep_train`, `megatron_patch`) always install; the library needs torch and
numpy only, extras add what the applications need (`megatron`, `plot`) and the tests (`test`). The native module
`uccl_ep_train._native` (csrc/: kernels, proxy, transports; pybind11, no libtorch) is built by
`native_build.py` when a C++ toolchain and pybind11 are present, with CUDA (nvcc) or HIP (hipcc) kernels
when such a compiler is found, and with the libfabric / libibverbs transports when their headers exist.
Set UCCL_EP_NO_NATIVE=1 to skip it; UCCL_EP_REQUIRE_NATIVE=1 turns a failed native build into an error.
"""
import os
import sys

from setuptools import find_packages, setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from native_build import native_build_kwargs  # noqa: E402

# megatron_patch and the applications that drive Megatron (train, pretrain-gpt, bench megatron; train's bar)
MEGATRON = ["megatron-core>=0.19,<0.20", "tqdm"]

setup(
    name="uccl-ep-train",
    version="0.1.0",
    description="Portable expert-parallel dispatch/combine for Megatron and Primus MoE training (UCCL-EP)",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    packages=find_packages(include=["uccl_ep_train", "uccl_ep_train.*", "megatron_patch", "megatron_patch.*"]),
    # what the library imports (pybind11 only builds the native module: pyproject.toml's build requirements)
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "megatron": MEGATRON,
        "plot": ["matplotlib"],  # `train --plot`, `bench intranode --plot`
        "test": ["pytest>=8", *MEGATRON],  # the suite exercises megatron_patch and train
        "gpu": ["transformer-engine[pytorch]"],
        "verbs": ["pyverbs"],
    },
    entry_points={"console_scripts": ["uccl-ep-train=uccl_ep_train.apps.cli:main"]},
    **native_build_kwargs(),
)
