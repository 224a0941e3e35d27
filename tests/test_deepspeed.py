"""CoatFP8AdamW under DeepSpeed 0.19.8 on CPU: 2 gloo ranks, ZeRO-0/1/2/3, bf16/fp32, checkpoints, re-sharding.

Each test spawns fresh rank processes (tests/ds_jobs.py); many assertions share one job, because starting
DeepSpeed costs ~10 s per process on CI's 2 cores.
"""
import os
import sys
import warnings

import pytest
import torch.multiprocessing as mp

pytest.importorskip("deepspeed")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ds_helpers as H  # noqa: E402
import ds_jobs  # noqa: E402

warnings.filterwarnings("ignore", category=RuntimeWarning)


def test_zero_stages_match_single_process(tmp_path):
    """Stages 0 (bf16 unfused), 1, 2, 3, BF16_Optimizer, bf16 and fp32: fragment tables pinned against DeepSpeed's
    layout, groups never straddle parameters, states equal a run without DeepSpeed away from cut points (fp32),
    losses / weights / moments within FP8 tolerance, ~2.2 bytes of state per element."""
    mp.spawn(ds_jobs.stages_worker, args=(2, H.free_port(), str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "stages.txt").read_text().count("\n") == 9
