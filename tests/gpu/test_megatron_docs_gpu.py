"""docs/megatron.md's own-training-loop script on a GPU: its CUDA branch (NCCL, model_parallel_cuda_manual_seed, the
Triton kernels) trains as the CPU branch does in CI (tests/megatron/test_megatron_docs.py)."""
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

import test_megatron_docs  # noqa: E402


def test_own_training_loop_from_the_docs_trains_on_the_gpu(tmp_path):
    proc, losses = test_megatron_docs.run_documented_script(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(losses) == 10, proc.stdout[-3000:]
    assert losses[-1] < 0.6 * losses[0], losses
