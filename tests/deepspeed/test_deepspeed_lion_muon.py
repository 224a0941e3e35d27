"""CoatFP8Lion and CoatFP8Muon from the ds_config under DeepSpeed 0.19.8 on CPU (2 gloo ranks, one job:
tests/jobs/ds_lion_muon_job.py), and Lion's ZeRO-2 state through DeepSpeed's per-parameter state functions
and universal checkpoints (tests/jobs/ds_lion_universal_job.py)."""
import warnings

import torch.multiprocessing as mp

import ds_lion_muon_job
import ds_lion_universal_job

warnings.filterwarnings("ignore", category=RuntimeWarning)


def test_lion_and_muon_from_the_ds_config(tmp_path):
    """Lion on ZeRO-1 and ZeRO-2 (a ZeRO-2 checkpoint resumes bit for bit: losses and weights), Muon on ZeRO-0 with
    muon_param_groups (trains), Muon on ZeRO-0 with bf16 refused at deepspeed.initialize naming why (Muon on ZeRO-1/2:
    test_deepspeed_muon_zero.py). Lion's ZeRO-2 state:
    safe_get/safe_set_full_optimizer_state on the momentum; saved, converted by coat_ds.to_universal (no exp_avg_sq
    files), resumed on 2 ranks bit for bit and on 1 rank with exact weights, momenta and next loss."""
    ck = tmp_path / "ck"
    mp.spawn(ds_lion_muon_job.lion_muon_worker, args=(2, str(tmp_path / "rdzv"), str(ck)), nprocs=2, join=True)
    params = sorted(p for p in (ck / "lion_z2_universal" / "zero").iterdir() if p.is_dir())
    assert params and all((p / "exp_avg.pt").is_file() and not (p / "exp_avg_sq.pt").exists() for p in params)
    mp.spawn(ds_lion_universal_job.load_worker, args=(1, str(tmp_path / "rdzv1"), str(ck)), nprocs=1, join=True)
