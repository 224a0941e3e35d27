#!/usr/bin/env bash
# Create .venv (CPU: torch 2.13.0 from the local wheel; triton 3.6 for the interpreter) and install coat-fp8 with
# its DeepSpeed, Megatron-core and test extras. Idempotent; reuses an existing .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@"; }
.venv/bin/python -c "import torch" 2>/dev/null || pip install torch==2.13.0
# within pyproject.toml's bounds (tests/packaging/test_dependency_bounds.py checks the result)
pip install triton==3.6.0 numpy "pytest>=8" pytest-timeout "transformers>=5,<6" "accelerate>=1.1,<2" \
    "tokenizers>=0.23,<0.24" matplotlib "ruff==0.17.6"
# DeepSpeed ships only an sdist; its build imports torch, so no build isolation. DS_BUILD_OPS=0: ops JIT-build on use.
.venv/bin/python -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8
pip install "megatron-core==0.16.1"
pip install --no-build-isolation --no-deps -e .
