"""CoatFP8AdamW under DeepSpeed 0.19.8 on CPU: 2 gloo ranks, ZeRO-0/1/2/3, bf16/fp32, checkpoints, re-sharding.

Each test spawns fresh rank processes (tests/jobs/ds_job.py); many assertions share one job, because starting
DeepSpeed costs ~10 s per process on CI's 2 cores.
"""
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.multiprocessing as mp

import ds_helpers as H  # noqa: E402
import ds_job  # noqa: E402

warnings.filterwarnings("ignore", category=RuntimeWarning)


def test_zero_stages_match_single_process(tmp_path):
    """Stages 0 (bf16 unfused), 1, 2, 3, BF16_Optimizer, bf16 and fp32: fragment tables pinned against DeepSpeed's
    layout, groups never straddle parameters, states equal a run without DeepSpeed away from cut points (fp32),
    losses / weights / moments within FP8 tolerance, ~2.2 bytes of state per element."""
    mp.spawn(ds_job.stages_worker, args=(2, str(tmp_path / "rdzv"), str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "stages.txt").read_text().count("\n") == 9


def test_checkpoints_nonfinite_and_resharding(tmp_path):
    """Same-DP save/load bit-exact (ZeRO-2 bf16, ZeRO-3 fp32), also through universal checkpoints; NaN/Inf gradients
    (DeepSpeed's overflow check skips
    the step; without it the optimizer skips the affected groups); zero_to_fp32; DP 2 -> 1 (ZeRO-2 and ZeRO-3) and
    1 -> 2 (ZeRO-2) through coat_ds.to_universal; bad configs; the client-callable route."""
    ck = tmp_path / "ck"
    ck.mkdir()
    mp.spawn(ds_job.checkpoint_worker, args=(2, str(tmp_path / "rdzv2"), str(ck)), nprocs=2, join=True)
    check_zero_to_fp32(ck)
    to_universal(ck / "z2_bf16", ck / "z2_bf16_universal")
    to_universal(ck / "z3_fp32", ck / "z3_fp32_universal")
    mp.spawn(ds_job.universal_same_dp_worker, args=(2, str(tmp_path / "rdzv2u"), str(ck)), nprocs=2, join=True)
    mp.spawn(ds_job.one_rank_worker, args=(1, str(tmp_path / "rdzv1"), str(ck)), nprocs=1, join=True)
    to_universal(ck / "dp1", ck / "dp1_universal")
    # a script that never imports coat_ds, under torchrun: registration by the .pth hook, CPU offload, DP 1 -> 2
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(H.free_port()),
         str(H.JOBS / "ds_registration_job.py"), str(ck)], expect="DP 1 -> 2 OK")


def run(cmd, expect):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and expect in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


def to_universal(tag_dir, out_dir):
    run([sys.executable, "-m", "coat_ds.to_universal", "--input_folder", str(tag_dir), "--output_folder",
         str(out_dir), "--num_extract_workers", "1", "--num_merge_workers", "1"], expect="dequantized")
    assert (out_dir / "zero").is_dir()


def check_zero_to_fp32(ck):
    """DeepSpeed's zero_to_fp32 still recovers the fp32 weights from checkpoints holding FP8 states."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for tag in ("z2_bf16", "z3_fp32"):
        expected = torch.load(ck / f"{tag}_expected.pt", weights_only=False)["weights"]
        recovered = get_fp32_state_dict_from_zero_checkpoint(str(ck), tag=tag)
        assert list(recovered) == [n for n, _ in H.make_model().named_parameters()]
        for got, want in zip(recovered.values(), expected):
            assert torch.equal(got.float().view(-1), want.view(-1)), tag


def test_unknown_layout_falls_back_with_one_warning():
    from coat_ds import zero_segments

    zero_segments._warned.clear()
    with pytest.warns(RuntimeWarning, match="no known DeepSpeed layout"):
        assert zero_segments.fragment_segments(torch.zeros(10), [torch.zeros(3)]) == [(0, 10, 0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert zero_segments.fragment_segments(torch.zeros(12), [torch.zeros(3)]) == [(0, 12, 0)]
    # a per-parameter master copy (FP16_UnfusedOptimizer) is one whole parameter, no warning
    assert zero_segments.fragment_segments(torch.zeros(3, 4), [torch.zeros(3, 4)]) == [(0, 12, 0)]
