"""CoatFP8Lion and CoatFP8Muon from the ds_config under DeepSpeed 0.19.8 on CPU (2 gloo ranks, one job:
tests/jobs/ds_lion_muon_job.py)."""
import warnings

import torch.multiprocessing as mp

import ds_lion_muon_job

warnings.filterwarnings("ignore", category=RuntimeWarning)


def test_lion_and_muon_from_the_ds_config(tmp_path):
    """Lion on ZeRO-1 and ZeRO-2 (a ZeRO-2 checkpoint resumes bit for bit: losses and weights), Muon on ZeRO-0 with
    muon_param_groups (trains), Muon on ZeRO-2 refused at deepspeed.initialize naming why."""
    mp.spawn(ds_lion_muon_job.lion_muon_worker, args=(2, str(tmp_path / "rdzv"), str(tmp_path / "ck")), nprocs=2,
             join=True)
