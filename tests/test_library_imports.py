"""The core library stands alone: importing it (and its public pieces) loads neither megatron nor the
applications' extras, so a DeepEP user's `import uccl_ep_train` costs what the library needs."""
from __future__ import annotations

import subprocess
import sys

APPLICATION_ONLY = ("megatron", "megatron_patch", "matplotlib", "transformer_engine")


def test_importing_the_library_loads_no_megatron():
    code = ("import sys, uccl_ep_train\n"
            "from uccl_ep_train import Buffer, Config, EventOverlap, autograd, permute, validation\n"
            "from uccl_ep_train.compat import deep_ep, primus_turbo\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {APPLICATION_ONLY!r}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing the library loaded: {done.stdout.strip()}"
