"""launch/train_ds.py on CPU: checkpoints (--save-dir/--save-at, --resume, --universal) with gloo ranks under
torchrun, CoatFP8AdamW + FP8 activations (configs/ds_zero2_coat_full.json), ZeRO-2, a 6-step run saved after step 3
and resumed on 2 and on 1 rank (tests/jobs/train_ds_runs.py runs the flow; the 2-GPU test runs it for ZeRO-2 and
ZeRO-3); and its --data corpus windows."""
from pathlib import Path

import numpy as np
import pytest
import torch

import train_ds_runs as runs
from script_modules import load_script
from launch.token_data import CorpusData

# The same training on 1 and on 2 ranks differs: FP8 activations take per-tensor scales over each rank's micro-batch
# (2 sequences or 4), the gradient reduction adds in another order, and the optimizer's FP8 groups are cut at other
# partition edges. A change of rank count at step 3 brings these differences into steps 4-6 only, so the resumed
# curve stays within twice what the rank count makes over the whole run (`noise`, measured in the same flow), and
# at least FLOOR (about 1e-4 of the loss, which starts near ln(512) = 6.2 here). The noise itself is bounded: the
# rank count must not change training.
NOISE_BOUND = 1e-2
FLOOR = 5e-4


def training(stage: int) -> runs.Training:
    """A peak learning rate above the config's, so that steps 4-6 move the loss by more than the tolerance."""
    flags = ["--ds-config", str(runs.CONFIGS / "ds_zero2_coat_full.json"), "--zero-stage", str(stage),
             "--model", "tiny-fp8", "--seq-len", "32", "--global-batch", "4", "--lr", "3e-3", "--deterministic"]
    return runs.Training(flags=flags, env=runs.environment(cpu=True), timeout_s=300)


def test_resume_across_data_parallel_sizes(tmp_path):
    """ZeRO-2: 2 -> 2 (rigid and universal) bit-exact after the save; 2 -> 1 through coat_ds.to_universal within
    twice the 1-rank vs 2-rank difference; a rigid checkpoint of 2 ranks on 1 rank stops before training, saying to
    convert. ZeRO-3 runs the same flow in tests/gpu/test_ds_checkpoint_sizes_gpu.py (2 GPUs, NCCL), not here: about
    two more minutes of the CPU suite's time budget."""
    setup = training(2)
    curves = runs.resume_across_sizes(setup, tmp_path, one_to_two=False)
    diffs = runs.report(curves, 2, setup.steps)
    runs.check_size_changes(curves, diffs, NOISE_BOUND, FLOOR)
    output = setup.fails(1, "--resume", f"{tmp_path / 'two_ranks'}:step{runs.SAVE_AT}")
    assert "saved on 2 data-parallel ranks, this run has 1" in output and "coat_ds.to_universal" in output, \
        output[-3000:]
    output = setup.fails(2, "--resume", f"{tmp_path / 'two_ranks'}:step{runs.SAVE_AT}", "--profile-step", "2")
    assert "--profile-step 2 is not after step 3, where --resume starts" in output, output[-3000:]


@pytest.fixture(scope="module")
def train_ds():
    return load_script(runs.TRAIN_DS, "train_ds")


@pytest.mark.parametrize("argv, message", [
    (["--steps", "6", "--save-dir", "ck", "--save-at", "7"], "--save-at 7 is not one of the steps 1..6"),
    (["--steps", "6", "--save-dir", "ck", "--save-at", "0"], "--save-at 0 is not one of the steps 1..6"),
    (["--save-at", "3"], "--save-at needs --save-dir"),
    (["--universal"], "--universal says how to load --resume"),
    (["--steps", "6", "--profile-step", "7"], "--profile-step 7 is not one of the steps 1..6"),
])
def test_checkpoint_flags_that_cannot_work_fail_at_parsing(train_ds, capsys, argv, message):
    with pytest.raises(SystemExit):
        train_ds.parse_args(["--ds-config", "c.json", *argv])
    assert message in capsys.readouterr().err


def test_save_dir_alone_saves_after_the_last_step(train_ds):
    assert train_ds.parse_args(["--ds-config", "c.json", "--steps", "6", "--save-dir", "ck"]).save_at == 6


def make_checkpoint(directory, tag, ranks=2, universal=False, latest=True):
    """The files DeepSpeed writes, by name (what --resume checks before anything loads)."""
    folder = directory / tag
    folder.mkdir(parents=True)
    if universal:
        (folder / "zero").mkdir()
    else:
        for rank in range(ranks):
            (folder / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
    (folder / "mp_rank_00_model_states.pt").touch()
    if latest:
        (directory / ("latest_universal" if universal else "latest")).write_text(tag)


def test_resume_finds_the_checkpoint_or_says_what_is_wrong(train_ds, tmp_path):
    find = train_ds.checkpoint_to_resume
    make_checkpoint(tmp_path, "step3")
    make_checkpoint(tmp_path, "step3_universal", universal=True)
    assert find(str(tmp_path), False, 2) == (str(tmp_path), "step3")  # DIR/latest names the tag
    assert find(f"{tmp_path}:step3", False, 2) == (str(tmp_path), "step3")
    assert find(str(tmp_path), True, 1) == (str(tmp_path), "step3_universal")  # DIR/latest_universal
    assert find(f"{tmp_path}:step3_universal", True, 3) == (str(tmp_path), "step3_universal")

    def fails(spec, universal, world, *needles):
        with pytest.raises(SystemExit) as error:
            find(spec, universal, world)
        assert all(n in str(error.value) for n in needles), str(error.value)

    fails(str(tmp_path / "missing"), False, 2, "no checkpoint directory", "missing")
    fails(f"{tmp_path}:step4", False, 2, "no checkpoint", "step4", "['step3', 'step3_universal']")
    fails(f"{tmp_path}:step3", False, 1, "saved on 2 data-parallel ranks, this run has 1", "coat_ds.to_universal",
          "step3_universal --universal")
    fails(f"{tmp_path}:step3", True, 1, "not a universal checkpoint", "coat_ds.to_universal", "drop --universal")
    fails(f"{tmp_path}:step3_universal", False, 2, "is a universal checkpoint; add --universal")
    other = tmp_path / "other"
    make_checkpoint(other, "step5", latest=False)
    fails(str(other), False, 2, "latest does not exist", f"--resume {other}:TAG", "['step5']")


def test_corpus_data_is_a_function_of_seed_and_sample_index(train_ds, monkeypatch):
    """--data corpus: windows of consecutive corpus tokens, the same for a sample index whichever rank reads it
    (ranks read slices of the global batch), other windows for another seed; a model vocabulary smaller than the
    corpus's is an error before training."""
    from launch import corpus

    fake = corpus.Corpus(train=np.arange(10_000, dtype=np.uint32), val=np.arange(100, dtype=np.uint32),
                         vocab_size=8192, directory=Path("."), meta={})
    monkeypatch.setattr(corpus, "load", lambda **kwargs: fake)
    data = CorpusData(32000, 16, seed=3)
    batch = data.sequences(10, 4)
    assert batch.shape == (4, 17) and batch.dtype == torch.int64
    assert torch.equal(batch[2:], data.sequences(12, 2))
    assert (batch[:, 1:] - batch[:, :-1] == 1).all()
    assert not torch.equal(CorpusData(32000, 16, seed=4).sequences(10, 4), batch)
    with pytest.raises(SystemExit, match="vocabulary of 8192 tokens, more than the model's 512"):
        CorpusData(512, 16, seed=3)


def test_zero_options_override_the_configs(train_ds, tmp_path):
    config = tmp_path / "c.json"
    config.write_text('{"optimizer": {"type": "CoatFP8AdamW", "params": {}}, "zero_optimization": {"stage": 2}}')
    args = train_ds.parse_args(["--ds-config", str(config), "--zero", "contiguous_gradients=false",
                                "--zero", "reduce_bucket_size=5e7"])
    zero = train_ds.load_config(args, world=1)["zero_optimization"]
    assert zero == {"stage": 2, "contiguous_gradients": False, "reduce_bucket_size": 5e7}


@pytest.mark.parametrize("option, message", [
    ("contiguous_gradients", "is not KEY=VALUE"),
    ("=1", "is not KEY=VALUE"),
    ("stage=3", "the ZeRO stage is set with --zero-stage"),
    ("contiguous_gradients=no", "the value of contiguous_gradients is not JSON"),
])
def test_bad_zero_options_fail_at_parsing(train_ds, capsys, option, message):
    with pytest.raises(SystemExit):
        train_ds.parse_args(["--ds-config", "c.json", "--zero", option])
    assert message in capsys.readouterr().err
