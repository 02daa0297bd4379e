"""MPS for commands that put several ranks on one GPU (`train --ranks R` with fewer GPUs than R): use the
control daemon that already answers, or start one for the run and stop it afterwards.

Why here and not in the library: only a command that spawns its ranks can start the daemon before any rank
creates a CUDA context (a context created earlier is no MPS client). The library's part is the check every
rank makes (`uccl_ep_train.gpu_sharing.check_gpu_sharing`). scripts/mps.sh does the same by hand, with the
same directories (`gpu_sharing.SCRIPT_PIPE_DIRECTORY` / `SCRIPT_LOG_DIRECTORY`), so a daemon started by
either is found by the other.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from typing import Iterator

from uccl_ep_train.gpu_sharing import SCRIPT_LOG_DIRECTORY, SCRIPT_PIPE_DIRECTORY, mps_active

CONTROL = "nvidia-cuda-mps-control"
START_TIMEOUT_S = 10.0  # how long a daemon started here may take to answer
STOP_TIMEOUT_S = 60.0   # `quit` waits for the clients (the ranks, gone by then) to leave


@contextlib.contextmanager
def mps_for_ranks() -> Iterator[tuple[dict[str, str], str]]:
    """Yields (the environment the ranks need to reach the daemon, a sentence saying which daemon serves them).

    A daemon that answers where this process's CUDA would look (CUDA_MPS_PIPE_DIRECTORY or CUDA's default) or
    in scripts/mps.sh's directory is used as it is. Otherwise one is started in scripts/mps.sh's directories
    and asked to quit on the way out. Raises SystemExit saying how to start MPS when the control binary is
    not on PATH."""
    if mps_active():
        yield {}, "MPS: the control daemon already running"
        return
    env = {"CUDA_MPS_PIPE_DIRECTORY": SCRIPT_PIPE_DIRECTORY, "CUDA_MPS_LOG_DIRECTORY": SCRIPT_LOG_DIRECTORY}
    if mps_active(SCRIPT_PIPE_DIRECTORY):
        yield env, f"MPS: the control daemon already running in {SCRIPT_PIPE_DIRECTORY}"
        return
    if shutil.which(CONTROL) is None:
        raise SystemExit(f"ranks sharing a GPU need NVIDIA MPS, and {CONTROL} is not on PATH: install the NVIDIA "
                         f"driver's MPS tools, or start MPS yourself and export CUDA_MPS_PIPE_DIRECTORY")
    for d in env.values():
        os.makedirs(d, exist_ok=True)
    daemon_env = {**os.environ, **env}
    started = subprocess.run([CONTROL, "-d"], env=daemon_env, capture_output=True, text=True,
                             timeout=START_TIMEOUT_S)
    if started.returncode != 0:
        raise SystemExit(f"{CONTROL} -d failed ({started.returncode}): {(started.stderr or started.stdout).strip()} "
                         f"(see {SCRIPT_LOG_DIRECTORY}/control.log; or start MPS with bash scripts/mps.sh start)")
    deadline = time.monotonic() + START_TIMEOUT_S
    while not mps_active(SCRIPT_PIPE_DIRECTORY):
        if time.monotonic() > deadline:
            raise SystemExit(f"started {CONTROL} -d but it does not answer in {SCRIPT_PIPE_DIRECTORY} after "
                             f"{START_TIMEOUT_S:.0f} s (see {SCRIPT_LOG_DIRECTORY}/control.log)")
        time.sleep(0.1)
    try:
        yield env, f"MPS: started a control daemon for this run in {SCRIPT_PIPE_DIRECTORY} (stopped at the end)"
    finally:
        subprocess.run([CONTROL], input="quit\n", text=True, env=daemon_env, timeout=STOP_TIMEOUT_S,
                       stdout=subprocess.DEVNULL)
