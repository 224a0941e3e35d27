"""CoatFP8AdamW `"master_remainders": true` under DeepSpeed 0.19.8 ZeRO-1/2/3 with bf16 master weights and
gradients (2 gloo ranks on CPU, tests/jobs/ds_remainders_job.py): bit-identical training to the fp32-master run,
the model's bf16 partitions as the masters, rigid checkpoints exact, universal checkpoints exact at DP 2 -> 2 and
2 -> 1 and interchangeable with fp32-master runs; configurations without bf16 masters are refused; under gradient
clipping equal to the fp32-master run with bf16-rounded clipped gradients; a tag damaged by a kill during save is
found (coat_ds.checkpoint_tags)."""
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch.multiprocessing as mp

import ds_remainders_job  # noqa: E402

warnings.filterwarnings("ignore", category=RuntimeWarning)


def lines(tmp_path, rank):
    return (tmp_path / f"remainders_rank{rank}.txt").read_text().splitlines()


@pytest.fixture(scope="module")
def remainder_run(tmp_path_factory):
    """The job's first phase (2 ranks): its report lines and the rigid checkpoints z2_remainders, z3_remainders."""
    out = tmp_path_factory.mktemp("remainders")
    mp.spawn(ds_remainders_job.remainders_worker, args=(2, str(out / "rdzv"), str(out)), nprocs=2, join=True)
    return out


def test_remainders_train_like_fp32_masters_and_checkpoint_exactly(remainder_run):
    tmp_path = remainder_run
    for rank in (0, 1):
        got = lines(tmp_path, rank)
        for stage in (1, 2, 3):
            line, = [x for x in got if x.startswith(f"stage {stage} equal")]
            assert 4.1 < float(line.split()[-1]) < 4.6, line  # remainders + FP8 moments (+ segment tables)
        assert "stage 2 checkpoint exact" in got and "stage 3 checkpoint exact" in got
        assert "refused without bf16 masters" in got
        assert "stage 2 clipped equal to bf16-rounded clipped gradients" in got
        assert "stage 3 clipped equal to bf16-rounded clipped gradients" in got
    for stage in (2, 3):
        tag = f"z{stage}_remainders"
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "coat_ds.to_universal", "--input_folder", str(tmp_path / tag),
                               "--output_folder", str(tmp_path / f"{tag}_universal"), "--num_extract_workers", "1",
                               "--num_merge_workers", "1"], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    mp.spawn(ds_remainders_job.universal_worker, args=(2, str(tmp_path / "rdzv2"), str(tmp_path)), nprocs=2,
             join=True)
    mp.spawn(ds_remainders_job.universal_worker, args=(1, str(tmp_path / "rdzv1"), str(tmp_path)), nprocs=1,
             join=True)
    for stage in (2, 3):
        assert f"universal stage {stage} world 2 exact" in lines(tmp_path, 1)
        assert f"universal stage {stage} world 1 exact" in lines(tmp_path, 0)


def test_a_tag_killed_during_save_is_named_and_the_previous_one_resumed(remainder_run, tmp_path):
    """DeepSpeed's `latest` names z3_remainders (saved after z2_remainders); a kill during that save leaves a rank's
    optimizer file cut short or missing: coat_ds.checkpoint_tags names the damage and the tag to resume from."""
    from coat_ds.checkpoint_tags import latest_complete_tag, tag_problems

    for tag in ("z2_remainders", "z3_remainders"):
        shutil.copytree(remainder_run / tag, tmp_path / tag)
    (tmp_path / "latest").write_text("z3_remainders")
    assert tag_problems(tmp_path, "z2_remainders") == tag_problems(tmp_path, "z3_remainders") == []
    assert latest_complete_tag(tmp_path) == "z3_remainders"
    optim = tmp_path / "z3_remainders" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:optim.stat().st_size // 2])
    assert tag_problems(tmp_path, "z3_remainders") == [f"{optim.name} is cut short"]
    assert latest_complete_tag(tmp_path) == "z2_remainders"
    optim.unlink()
    assert tag_problems(tmp_path, "z3_remainders") == [f"{optim.name} is missing"]
    model = tmp_path / "z2_remainders" / "mp_rank_00_model_states.pt"
    model.write_bytes(model.read_bytes()[:100])
    assert latest_complete_tag(tmp_path) is None
