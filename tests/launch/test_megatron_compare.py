"""launch/megatron_compare.sh's arms for any number of GPUs, checked by the commands it would run (DRY_RUN=1): X_tpN_sp
is arm X_tp1 at TP=N + sequence parallelism on N GPUs, X_dpN arm X_tp1 on N data-parallel ranks (global batch N x the
micro-batch); arms needing more GPUs than visible are skipped; a malformed arm name is an error before any run."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def dry_run(tmp_path, arms, gpus=4):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DRY_RUN": "1",
           "DATA": "mock", "NGPUS": str(gpus), "MICROS": "4", "ARMS": arms}
    return subprocess.run(["bash", "launch/megatron_compare.sh", str(tmp_path / "out"), "10"], cwd=ROOT, env=env,
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
    assert tp4.endswith("--micro-batch-size 4 --global-batch-size 4 --train-iters 10 --transformer-impl coat "
                        "--coat-optimizer --tensor-model-parallel-size 4 --sequence-parallel")
    dp2 = command_of(out.stdout, "te_fp8_delayed_dp2_mb4")
    assert "CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node 2" in dp2
    assert "--global-batch-size 8 " in dp2 and "--fp8-recipe delayed" in dp2 and "--tensor-model" not in dp2
    assert "CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node 1" in command_of(out.stdout, "coat_tp1_mb4")
    assert "== te_bf16_dp8 skipped: needs 8 GPUs, 4 visible" in out.stdout


def test_malformed_arm_names_fail_before_any_run(tmp_path):
    for arm in ("coat_tp1_sp", "bogus_dp2", "coat_tp2"):
        out = dry_run(tmp_path, f"coat_tp1 {arm}")
        assert out.returncode != 0 and "unknown arm" in out.stderr, (arm, out.stdout, out.stderr)
        assert "== coat_tp1_mb4" not in out.stdout
