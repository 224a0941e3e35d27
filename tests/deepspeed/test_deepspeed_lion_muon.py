"""CoatFP8Lion and CoatFP8Muon from the ds_config under DeepSpeed 0.19.8 on CPU (2 gloo ranks, one job:
tests/jobs/ds_lion_muon_job.py, which runs ds_muon_zero_job's checks too), and Lion's ZeRO-2 state through DeepSpeed's
per-parameter state functions and universal checkpoints (tests/jobs/ds_lion_universal_job.py)."""
import json
import warnings

import pytest
import torch.multiprocessing as mp

import ds_lion_muon_job
import ds_muon_zero_job
import ds_lion_universal_job

warnings.filterwarnings("ignore", category=RuntimeWarning)


def test_lion_and_muon_from_the_ds_config(tmp_path):
    """Lion on ZeRO-1 and ZeRO-2 (a ZeRO-2 checkpoint resumes bit for bit: losses and weights), Muon on ZeRO-0 with
    muon_param_groups (trains), Muon on ZeRO-0 with bf16 refused at deepspeed.initialize naming why. Lion's ZeRO-2
    state: safe_get/safe_set_full_optimizer_state on the momentum; saved, converted by coat_ds.to_universal (no
    exp_avg_sq files), resumed on 2 ranks bit for bit and on 1 rank with exact weights, momenta and next loss.

    Muon on ZeRO-1/2 (DeepSpeed's Muon path, coat_ds.muon_zero): with state_dtype "fp32" the weights and losses are
    DeepSpeed's own "type": "Muon"'s bit for bit after 3 steps (ZeRO-2 fp32 model, ZeRO-1 bf16 model); after one step
    every rank holding a piece of a matrix, the one cut by the partition edge included, holds (1 - momentum) x the whole
    averaged gradient autograd gives on the global batch. FP8 momentum: bit for bit DeepSpeed's Muon with its momentum
    rounded through FP8 after each step (ZeRO-2 fp32 and ZeRO-1 bf16 models); within ds_muon_zero_job.FP8_TOLERANCE of
    plain DeepSpeed Muon (relative to the distance it moved the weights); about 1.1 momentum bytes per matrix element;
    the AdamW group's partition keeps its parameters' segments; a ZeRO-2 checkpoint resumes bit for bit. ZeRO-3,
    DeepSpeed-incompatible Muon options, universal-checkpoint loads and optimizer offload are refused at
    deepspeed.initialize, naming why; coat_ds.to_universal refuses the Muon ZeRO-2 checkpoint, naming why and writing
    nothing."""
    ck = tmp_path / "ck"
    mp.spawn(ds_lion_muon_job.lion_muon_worker, args=(2, str(tmp_path / "rdzv"), str(ck)), nprocs=2, join=True)
    params = sorted(p for p in (ck / "lion_z2_universal" / "zero").iterdir() if p.is_dir())
    assert params and all((p / "exp_avg.pt").is_file() and not (p / "exp_avg_sq.pt").exists() for p in params)
    for rank in range(2):
        report = json.loads((ck / f"muon_zero_rank{rank}.json").read_text())
        per_element = report["momentum_bytes"] / report["momentum_numel"]
        print(f"Muon ZeRO-2 rank {rank}: FP8 momentum {report['momentum_bytes']} bytes over {report['momentum_numel']} "
              f"matrix elements ({per_element:.3f} B each; the partition: {report['partition_numel']} elements); "
              f"distance from DeepSpeed's Muon {report['fp8_distance']:.4f}")
        # one E4M3 code per element and 12 bytes of metadata per group of 128, groups not crossing matrices
        matrices = [r * c for r, c in ds_muon_zero_job.MATRICES[rank]]
        assert report["momentum_numel"] == sum(matrices)
        assert report["momentum_bytes"] == sum(n + 12 * -(-n // 128) for n in matrices)
    from coat_ds.to_universal import convert
    with pytest.raises(ValueError, match="cannot become a universal checkpoint"):
        convert(str(ck / "muon_z2"), str(ck / "muon_z2_universal"))
    assert not (ck / "muon_z2_universal").exists()
    assert not [p.name for p in ck.iterdir() if p.name.startswith(".coat_dequantized_")]
    mp.spawn(ds_lion_universal_job.load_worker, args=(1, str(tmp_path / "rdzv1"), str(ck)), nprocs=1, join=True)


def test_flat_muon_tensors_are_stepped_only_on_deepspeeds_muon_path():
    """A flat tensor in a Muon group (what a ZeRO wrapper hands the optimizer) is an error at the step, until
    coat_ds.muon_zero puts the optimizer on DeepSpeed's Muon path: then its gradient is the update, applied as
    p (1 - lr wd) - lr update."""
    import pytest
    import torch

    from coat_ds import CoatFP8Muon

    w = torch.nn.Parameter(torch.randn(4, 8))
    opt = CoatFP8Muon([w], lr=0.02, weight_decay=0.1)
    flat = torch.nn.Parameter(w.detach().reshape(-1).clone())
    flat.grad = torch.randn(32)
    opt.param_groups[0]["params"] = [flat]
    with pytest.raises(RuntimeError, match="whole 2-D matrices"):
        opt.step()
    expected = flat.detach() * (1 - 0.02 * 0.1) - 0.02 * flat.grad
    opt.use_deepspeed_muon_path()
    opt.step()
    torch.testing.assert_close(flat.detach(), expected, rtol=1e-6, atol=1e-7)
