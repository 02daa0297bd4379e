# Sourced from the repository root by the GPU scripts (gpu_check.sh, fuzz_gpu.sh): the interpreter in $py
# (PYTHON, else .venv/bin/python when present, else python3) and what every process on a GPU host needs.
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast: it can take a shared host's GPUs down
