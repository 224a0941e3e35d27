"""launch/megatron_compare.sh's arms for any number of GPUs, checked by the commands it would run (DRY_RUN=1): X_tpN_sp
is arm X_tp1 at TP=N + sequence parallelism on N GPUs, X_dpN arm X_tp1 on N data-parallel ranks (global batch N x the
micro-batch), X_tpT_dpD both; arms needing more GPUs than visible are skipped; malformed arm names, iteration counts
Megatron's LR scheduler would assert on, and layouts that do not fit the model or the GPUs are errors before any
run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def dry_run(tmp_path, arms, gpus=4, iters="30", **settings):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DRY_RUN": "1",
           "DATA": "mock", "NGPUS": str(gpus), "MICROS": "4", "ARMS": arms, **settings}
    return subprocess.run(["bash", "launch/megatron_compare.sh", str(tmp_path / "out"), iters], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def command_of(stdout, run):
    lines = [line for line in stdout.splitlines() if line.startswith(f"== {run}: ")]
    assert len(lines) == 1, stdout
    return lines[0]


def test_n_gpu_arms_get_their_ranks_layout_and_global_batch(tmp_path):
    out = dry_run(tmp_path, "coat_tp4_sp te_fp8_delayed_dp2 coat_tp1 te_bf16_dp8")
    assert out.returncode == 0, out.stderr
    tp4 = command_of(out.stdout, "coat_tp4_sp_mb4")
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nproc_per_node 4" in tp4
    assert tp4.endswith("--micro-batch-size 4 --global-batch-size 4 --train-iters 30 --no-bias-swiglu-fusion "
                        "--transformer-impl coat --coat-optimizer --tensor-model-parallel-size 4 --sequence-parallel")
    dp2 = command_of(out.stdout, "te_fp8_delayed_dp2_mb4")
    assert "CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node 2" in dp2
    assert "--global-batch-size 8 " in dp2 and "--fp8-recipe delayed" in dp2 and "--tensor-model" not in dp2
    assert "CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node 1" in command_of(out.stdout, "coat_tp1_mb4")
    assert "== te_bf16_dp8 skipped: needs 8 GPUs, 4 visible" in out.stdout


def test_malformed_arm_names_fail_before_any_run(tmp_path):
    for arm in ("coat_tp1_sp", "bogus_dp2", "coat_tp2", "coat_tp1_dp2", "coat_tp2_dp1", "te_memstack_tp2_dp"):
        out = dry_run(tmp_path, f"coat_tp1 {arm}")
        assert out.returncode != 0 and "unknown arm" in out.stderr, (arm, out.stdout, out.stderr)
        assert "== coat_tp1_mb4" not in out.stdout


def test_tp_times_dp_layout_and_the_blockwise_memory_stack_and_precision_aware_arms(tmp_path):
    out = dry_run(tmp_path, "te_memstack_tp2_dp2 coat_pa_tp2_dp2 te_fp8_blockwise_tp1")
    assert out.returncode == 0, out.stderr
    stack = command_of(out.stdout, "te_memstack_tp2_dp2_mb4")
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nproc_per_node 4" in stack
    assert "--global-batch-size 8 " in stack  # 2 data-parallel ranks x 4
    for flag in ("--fp8-format e4m3 --fp8-recipe blockwise", "--fp8-param-gather", "--use-precision-aware-optimizer",
                 "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --main-grads-dtype bf16",
                 "--activation-func-fp8-input-store", "--recompute-granularity selective --recompute-modules layernorm",
                 "--tensor-model-parallel-size 2 --sequence-parallel"):
        assert flag in stack, flag
    assert "--no-bias-swiglu-fusion" not in stack  # the FP8 input store needs Megatron's fused SwiGLU
    pa = command_of(out.stdout, "coat_pa_tp2_dp2_mb4")
    assert pa.endswith("--no-bias-swiglu-fusion --transformer-impl coat --coat-optimizer "
                       "--use-precision-aware-optimizer --main-grads-dtype bf16 --tensor-model-parallel-size 2 "
                       "--sequence-parallel")
    blockwise = command_of(out.stdout, "te_fp8_blockwise_tp1_mb4")
    assert blockwise.endswith("--transformer-impl transformer_engine --fp8-format e4m3 --fp8-recipe blockwise")
    assert "--lr-warmup-iters 20 " in out.stdout  # the common flags are printed once


@pytest.mark.parametrize("iters, settings, message", [
    ("20", {}, "TRAIN_ITERS=20: Megatron's LR scheduler asserts --lr-warmup-iters < --train-iters"),
    ("30", {"MICROS": "4 max", "MAX_ITERS": "15"}, "MAX_ITERS=15: Megatron's LR scheduler"),
    ("10", {"LR_WARMUP_ITERS": "10"}, "here 10 < 10"),
    ("ten", {}, "TRAIN_ITERS=ten is not a number"),
    ("30", {"MICROS": "4 big"}, "MICROS: big is not a micro-batch size"),
])
def test_iteration_counts_megatron_would_assert_on_fail_before_any_run(tmp_path, iters, settings, message):
    out = dry_run(tmp_path, "coat_tp1", iters=iters, **settings)
    assert out.returncode == 2 and message in out.stderr, (out.stdout, out.stderr)
    assert "torchrun" not in out.stdout and not (tmp_path / "out").exists()


def test_fewer_iterations_pass_with_a_shorter_warm_up(tmp_path):
    out = dry_run(tmp_path, "coat_tp1", iters="15", LR_WARMUP_ITERS="5", MICROS="4 max", MAX_ITERS="12")
    assert out.returncode == 0, out.stderr
    assert "--lr-warmup-iters 5 " in out.stdout and "--train-iters 15 " in command_of(out.stdout, "coat_tp1_mb4")


@pytest.mark.parametrize("arms, gpus, message", [
    ("coat_tp1 coat_tp3_sp", 4, "coat_tp3_sp: TP=3 does not divide MODEL=gpt370m's 16 attention heads"),
    ("coat_tp1 coat_dp3", 4, "coat_dp3: its 3 GPUs (TP=1 x DP=3) do not divide the 4 GPUs visible"),
    ("coat_tp2_dp3", 8, "coat_tp2_dp3: its 6 GPUs (TP=2 x DP=3) do not divide the 8 GPUs visible"),
])
def test_layouts_that_do_not_fit_the_model_or_the_gpus_fail_before_any_run(tmp_path, arms, gpus, message):
    out = dry_run(tmp_path, arms, gpus=gpus)
    assert out.returncode == 2 and message in out.stderr, (out.stdout, out.stderr)
    assert "torchrun" not in out.stdout


def test_resume_keeps_runs_that_finished_and_runs_the_rest(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "coat_tp1_mb4.log").write_text("...\n[coat_megatron] rank 0 memory allocated after training: "
                                              "10.00 GiB of 80.00 GiB\n")
    (out_dir / "coat_tp1_mb8.log").write_text("iteration 5/30 | ...\n")  # stopped before its end
    out = dry_run(tmp_path, "coat_tp1", RESUME="1", MICROS="4 8")
    assert out.returncode == 0, out.stderr
    assert "== coat_tp1_mb4: kept (RESUME=1)" in out.stdout
    assert "--micro-batch-size 8 " in command_of(out.stdout, "coat_tp1_mb8")
    again = dry_run(tmp_path, "coat_tp1", MICROS="4 8")  # without RESUME every run is run again
    assert "--micro-batch-size 4 " in command_of(again.stdout, "coat_tp1_mb4")


FAKE_TRAINING = r'''#!/usr/bin/env bash
# python3 for megatron_compare.sh: a training run writes a log as coat_megatron.pretrain_gpt would, with a peak of
# 20 + 1.5 x micro GiB on a 100 GiB card (held between iterations: 24 GiB), and above 50 dies the way NCCL does when
# the card is full; anything else goes to the real interpreter.
if [[ "$1 $2" == "-m torch.distributed.run" ]]; then
  micro=$(echo "$*" | sed -E 's/.*--micro-batch-size ([0-9]+).*/\1/')
  iters=$(echo "$*" | sed -E 's/.*--train-iters ([0-9]+).*/\1/')
  echo "  micro_batch_size ................................ $micro"
  echo "  seq_length ...................................... 2048"
  echo "  train_iters ..................................... $iters"
  if (( micro > 50 )); then echo "[rank0]: Failed to CUDA calloc async 4 bytes"; exit 1; fi
  echo " [t] iteration $iters/ $iters | elapsed time per iteration (ms): 100.0 | lm loss: 1.0E+00 |"
  echo "[coat_megatron] rank 0 peak memory allocated: $(( 20 + 3 * micro / 2 )).00 GiB"
  echo "[coat_megatron] rank 0 memory allocated after training: 24.00 GiB of 100.00 GiB"
  exit 0
fi
exec "$REAL_PYTHON" "$@"
'''


def search(tmp_path, micros):
    """megatron_compare.sh's coat_tp1 at MICROS=micros over FAKE_TRAINING: (its output, the sizes "max" tried)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_TRAINING)
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "REAL_PYTHON": sys.executable, "DATA": "mock",
           "NGPUS": "1", "MICROS": micros, "ARMS": "coat_tp1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(["bash", "launch/megatron_compare.sh", str(tmp_path / "out"), "30"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out, [line.split("--micro-batch-size ")[1].split()[0] for line in out.stdout.splitlines()
                 if line.startswith("== coat_tp1_mbmax: CUDA")]


def test_largest_micro_batch_search_predicts_from_two_sizes(tmp_path):
    out, sizes = search(tmp_path, "4 16 max")
    # peaks 26 at 4 and 44 at 16: 1.5 GiB per sample -> 16 + (0.88 * 100 - 44) / 1.5 = 45 fits at once (from 4
    # alone, 0.5 GiB per sample over 24 held, it would predict 128)
    assert sizes == ["45"], out.stdout
    assert "| coat_tp1 | 45 |" in (tmp_path / "out" / "results.md").read_text()


def test_largest_micro_batch_search_lowers_the_size_after_an_nccl_allocation_failure(tmp_path):
    out, sizes = search(tmp_path, "max:64")
    assert sizes == ["64", "56", "49"], out.stdout  # lowered by 1/8 while NCCL fails to allocate
    assert sorted(p.name for p in (tmp_path / "out").glob("*_oom.log")) == ["coat_tp1_mb56_oom.log",
                                                                            "coat_tp1_mb64_oom.log"]
