#!/usr/bin/env bash
# Create .venv and install coat-fp8 with its DeepSpeed, Megatron-core and test extras (torch 2.13.0; triton 3.6 for
# the interpreter). Idempotent; reuses an existing .venv.
# On a machine without an NVIDIA driver, torch comes from PyTorch's CPU index (PyPI's torch brings several GB of
# CUDA packages); a local wheel in pip's find-links is still used.
#   --deepspeed-cpu-ops  also build DeepSpeed's shared-memory allreduce op (ShareMemCommBuilder,
#                        deepspeed_shm_comm) now, with the compiler's output shown: DeepSpeed on the CPU accelerator
#                        (DS_ACCELERATOR=cpu, the Trainer's --use_cpu) builds it silently at its first
#                        init_distributed otherwise (minutes on 2 cores; cached in ~/.cache/torch_extensions after).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DS_CPU_OPS=0
for arg in "$@"; do
    case "$arg" in
        --deepspeed-cpu-ops) BUILD_DS_CPU_OPS=1 ;;
        *) echo "launch/setup.sh: unknown option $arg (known: --deepspeed-cpu-ops)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@"; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia/version ]; then
        pip install torch==2.13.0
    else
        pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    fi
fi
# within pyproject.toml's bounds (tests/packaging/test_dependency_bounds.py checks the result)
pip install triton==3.6.0 numpy "pytest>=8" pytest-timeout "transformers>=5,<6" "accelerate>=1.1,<2" \
    "tokenizers>=0.23,<0.24" matplotlib "ruff==0.17.6"
# DeepSpeed ships only an sdist; its build imports torch, so no build isolation. DS_BUILD_OPS=0: ops JIT-build on use.
.venv/bin/python -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8
pip install "megatron-core==0.16.1"
pip install --no-build-isolation --no-deps -e .
if [ "$BUILD_DS_CPU_OPS" = 1 ]; then
    echo "building DeepSpeed's CPU shared-memory allreduce op (deepspeed_shm_comm; a few minutes on 2 cores)"
    DS_ACCELERATOR=cpu .venv/bin/python -c \
        "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load(verbose=True)"
fi
