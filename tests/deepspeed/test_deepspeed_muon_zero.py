"""CoatFP8Muon from the ds_config on DeepSpeed's ZeRO-1/2 Muon path (coat_ds.muon_zero), CPU, 2 gloo ranks, one job:
tests/jobs/ds_muon_zero_job.py."""
import json
import warnings

import torch.multiprocessing as mp

import ds_muon_zero_job

warnings.filterwarnings("ignore", category=RuntimeWarning)


def test_coat_muon_on_deepspeed_zero2_muon_path(tmp_path):
    """With state_dtype "fp32" the weights and losses are DeepSpeed's own "type": "Muon"'s bit for bit after 3 steps
    (ZeRO-2 fp32 model, ZeRO-1 bf16 model); after one step every rank holding a piece of a matrix, the one cut by the
    partition edge included, holds (1 - momentum) x the whole averaged gradient autograd gives on the global batch.
    FP8 momentum: within ds_muon_zero_job.FP8_TOLERANCE of DeepSpeed's Muon (relative to the distance it moved the
    weights), momentum bytes per parameter as below; the AdamW group's partition keeps its parameters' segments. A
    ZeRO-2 checkpoint (bf16 model, FP8 momentum) resumes bit for bit. ZeRO-3, DeepSpeed-incompatible Muon options,
    universal-checkpoint loads and optimizer offload are refused at deepspeed.initialize, naming why."""
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(ds_muon_zero_job.muon_zero_worker, args=(2, str(tmp_path / "rdzv"), str(tmp_path / "ck"), str(out)),
             nprocs=2, join=True)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        per_param = report["momentum_bytes"] / report["momentum_numel"]
        print(f"rank {rank}: FP8 momentum {report['momentum_bytes']} bytes over {report['momentum_numel']} matrix "
              f"elements ({per_param:.3f} B/param; partition {report['partition_numel']} elements); distance from "
              f"DeepSpeed's Muon {report['fp8_distance']:.4f}")
        assert 1.0 < per_param < 1.12
