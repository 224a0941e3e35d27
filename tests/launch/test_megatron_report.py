"""launch.megatron_report on logs written the way megatron.training and coat_megatron.pretrain_gpt print them."""
import json
import subprocess
import sys

import pytest

from launch import megatron_report as R


def write_log(path, micro, ms, losses, iters=30, peak=40.0, held=10.0, card=80.0, finished=True, dp=1):
    lines = ["------------------------ arguments ------------------------",
             f"  micro_batch_size {'.' * 32} {micro}", f"  seq_length {'.' * 38} 2048",
             f"  data_parallel_size {'.' * 30} {dp}", f"  train_iters {'.' * 37} {iters}"]
    last = iters if finished else iters - 10
    for it, loss in zip(range(5, last + 1, 5), losses):
        lines.append(f" [2026-11-25 10:00:00.000000] iteration {it:8d}/{iters:8d} | consumed samples: "
                     f"{it * micro:12d} |"
                     f" elapsed time per iteration (ms): {ms if it > 10 else 10 * ms:.1f} | throughput per GPU "
                     f"(TFLOP/s/GPU): 100.0 | learning rate: 3.000000E-04 | global batch size: {micro:5d} | "
                     f"lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: 1.000 |")
    if finished:
        lines += ["[coat_megatron] rank 0 optimizer state: MegatronCoatFP8AdamW 100.0 MiB for 1.00M elements "
                  "(2.188 B/element)", f"[coat_megatron] rank 0 peak memory allocated: {peak:.2f} GiB",
                  f"[coat_megatron] rank 0 memory allocated after training: {held:.2f} GiB of {card:.2f} GiB"]
    path.write_text("\n".join(lines) + "\n")


def test_tables_ratios_and_best_batch(tmp_path):
    write_log(tmp_path / "te_bf16_tp1_mb4.log", 4, 200.0, [9, 8, 7, 6, 5, 4])
    write_log(tmp_path / "te_bf16_tp1_mbmax.log", 12, 500.0, [9, 8, 7, 6, 5, 4])
    write_log(tmp_path / "coat_tp1_mb4.log", 4, 100.0, [9, 8, 7, 6, 5, 4.1])
    write_log(tmp_path / "coat_tp1_mbmax.log", 24, 400.0, [9, 8, 7, 6, 5, 4])
    write_log(tmp_path / "coat_tp1_mb28_oom.log", 28, 1.0, [], finished=False)  # a failed try: left out
    write_log(tmp_path / "local_bf16_tp1_mb4.log", 4, 300.0, [9, 8, 7], finished=False)
    res = R.report(str(tmp_path), skip=10)
    runs = {(r["arm"], r["micro"]): r for r in res["runs"]}
    assert runs[("coat_tp1", 4)]["tokens_per_s"] == pytest.approx(4 * 2048 / 0.1)  # warm-up intervals left out
    assert runs[("coat_tp1", 4)]["final_loss"] == pytest.approx(4.1)
    table = (tmp_path / "results.md").read_text()
    assert "| coat_tp1 | 4 | 100.0 | 81,920 | 2.00x |  |" in table
    assert "| local_bf16_tp1 | 4 | did not finish |" in table
    # best: coat at 24 (122,880 tokens/s) over TE BF16 at 12 (49,152 tokens/s)
    assert "| coat_tp1 | 24 | 122,880 | 2.50x | 40.00 |" in table
    assert json.loads((tmp_path / "results.json").read_text())["skip"] == 10
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_two_gpu_arms_are_compared_with_te_bf16_of_their_layout_and_of_one_gpu(tmp_path):
    write_log(tmp_path / "te_bf16_tp1_mb4.log", 4, 200.0, [9, 8, 7, 6, 5, 4])
    write_log(tmp_path / "te_bf16_tp2_sp_mb4.log", 4, 125.0, [9, 8, 7, 6, 5, 4])
    write_log(tmp_path / "coat_tp2_sp_mb4.log", 4, 100.0, [9, 8, 7, 6, 5, 4])
    write_log(tmp_path / "coat_dp2_mb4.log", 4, 100.0, [9, 8, 7, 6, 5, 4])  # no TE BF16 at DP=2 ran
    R.report(str(tmp_path), skip=10)
    table = (tmp_path / "results.md").read_text()
    assert "| coat_tp2_sp | 4 | 100.0 | 81,920 | 1.25x | 2.00x |" in table
    assert "| coat_dp2 | 4 | 100.0 | 81,920 |  | 2.00x |" in table
    assert "| te_bf16_tp2_sp | 4 | 125.0 | 65,536 | 1.00x | 1.60x |" in table
    assert "| coat_tp2_sp | 4 | 81,920 | 1.25x |" in table and "| coat_dp2 | 4 | 81,920 |  |" in table
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_largest_micro_batch_prediction_from_one_size(tmp_path):
    log = tmp_path / "coat_tp1_mb4.log"
    write_log(log, 4, 100.0, [9, 8, 7, 6, 5, 4], peak=30.0, held=10.0, card=80.0)
    # 5 GiB per sample over 10 GiB held: (0.88 * 80 - 10) / 5 = 12.08
    assert R.predict_max([str(log)]) == 12
    out = subprocess.run([sys.executable, "-m", "launch.megatron_report", "--predict-max", str(log)],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "12"
    write_log(log, 4, 100.0, [9, 8], finished=False)
    with pytest.raises(SystemExit, match="did not finish"):
        R.predict_max([str(log)])


def test_largest_micro_batch_prediction_from_two_sizes_uses_their_slope(tmp_path):
    # TE's memory stack on one H200 (139.80 GiB): 31.15 GiB peak at 4 over 28.13 held, 107.14 at 48. From 4 alone:
    # 0.755 GiB per sample -> 125, which ran out of memory; the slope between 4 and 48 is 1.727 GiB per sample:
    # 48 + (0.88 * 139.80 - 107.14) / 1.727 = 57.2
    small, large = tmp_path / "te_memstack_tp1_mb4.log", tmp_path / "te_memstack_tp1_mb48.log"
    write_log(small, 4, 175.2, [9, 8, 7, 6, 5, 4], peak=31.15, held=28.13, card=139.80)
    write_log(large, 48, 1662.9, [9, 8, 7, 6, 5, 4], peak=107.14, held=28.13, card=139.80)
    assert R.predict_max([str(small)]) == 125
    assert R.predict_max([str(large), str(small)]) == 57
    out = subprocess.run([sys.executable, "-m", "launch.megatron_report", "--predict-max", str(small), str(large)],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "57"
    write_log(large, 48, 1662.9, [9, 8, 7, 6, 5, 4], peak=30.0, held=28.13, card=139.80)
    with pytest.raises(SystemExit, match="not above"):
        R.predict_max([str(small), str(large)])


def test_nccl_failing_to_allocate_counts_as_out_of_memory(tmp_path):
    log = tmp_path / "coat_tp1_mb71.log"
    write_log(log, 71, 1.0, [], finished=False)
    assert not R.parse_log(str(log))["oom"]
    with open(log, "a") as f:
        f.write("[rank0]: ncclUnhandledCudaError: Call to CUDA function failed.\n[rank0]: Last error:\n"
                "[rank0]: Failed to CUDA calloc async 4 bytes\n")
    assert R.parse_log(str(log))["oom"]


def test_blockwise_ratios_largest_micro_batch_against_the_fastest_te_arm_and_the_loss_plot_arms(tmp_path):
    # one GPU: TE blockwise 4 -> 160 ms, 30 GiB; its largest 8 -> 300 ms; the memory stack's largest 16 -> 560 ms
    write_log(tmp_path / "te_fp8_blockwise_tp1_mb4.log", 4, 160.0, [9, 8, 7, 6, 5, 4], peak=30.0)
    write_log(tmp_path / "te_fp8_blockwise_tp1_mbmax.log", 8, 300.0, [9, 8, 7, 6, 5, 4], peak=60.0)
    write_log(tmp_path / "te_memstack_tp1_mb4.log", 4, 200.0, [9, 8, 7, 6, 5, 4], peak=20.0)
    write_log(tmp_path / "te_memstack_tp1_mbmax.log", 16, 560.0, [9, 8, 7, 6, 5, 4], peak=66.0)
    write_log(tmp_path / "te_bf16_tp1_mb4.log", 4, 200.0, [9, 8, 7, 6, 5, 4], peak=36.0)
    write_log(tmp_path / "coat_tp1_mb4.log", 4, 128.0, [9, 8, 7, 6, 5, 4], peak=21.0)
    write_log(tmp_path / "coat_tp1_mbmax.log", 32, 800.0, [9, 8, 7, 6, 5, 4], peak=68.0)
    write_log(tmp_path / "coat_pa_tp1_mb4.log", 4, 128.0, [9, 8, 7, 6, 5, 4], peak=18.0)
    write_log(tmp_path / "local_bf16_tp1_mb4.log", 4, 400.0, [9, 8, 7, 6, 5, 4])
    res = R.report(str(tmp_path), skip=10)
    table = (tmp_path / "results.md").read_text()
    # COAT at 4: 160 / 128 = 1.25x TE blockwise's tokens/s at 21 / 30 = 0.70x its peak
    assert "| coat_tp1 | 4 | 128.0 | 64,000 | 1.56x |  | 21.00 |" in table
    assert table.split("| coat_tp1 | 4 | 128.0 |")[1].split("\n")[0].endswith("| 1.25x | 0.70x |")
    assert table.split("| te_fp8_blockwise_tp1 | 4 |")[1].split("\n")[0].endswith("| 1.00x | 1.00x |")
    # largest: TE blockwise 8 x 2048 / 0.3 = 54,613; the memory stack 16 x 2048 / 0.56 = 58,514 (the fastest TE
    # arm at its largest); COAT 32 x 2048 / 0.8 = 81,920 = 1.40x of it
    largest = {row["arm"]: row for row in res["largest"]}
    assert largest["coat_tp1"]["micro"] == 32 and largest["coat_tp1"]["best_te_arm"] == "te_memstack_tp1"
    assert largest["coat_tp1"]["x_best_te"] == "1.40x"
    assert "| coat_tp1 | 32 | 81,920 | 68.00 | te_memstack_tp1 (16) | 1.40x |" in table
    assert res["loss_plot_arms"] == ["coat_tp1", "te_bf16_tp1", "te_fp8_blockwise_tp1"]  # at their smallest
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_tp_times_dp_layouts_have_their_own_references_and_dp_scaling(tmp_path):
    write_log(tmp_path / "coat_tp1_mb4.log", 4, 100.0, [9, 8, 7, 6, 5, 4])
    write_log(tmp_path / "coat_dp4_mb4.log", 4, 110.0, [9, 8, 7, 6, 5, 4], dp=4)
    write_log(tmp_path / "te_fp8_blockwise_tp2_dp2_mb4.log", 4, 150.0, [9, 8, 7, 6, 5, 4], peak=50.0, dp=2)
    write_log(tmp_path / "coat_tp2_dp2_mb4.log", 4, 120.0, [9, 8, 7, 6, 5, 4], peak=25.0, dp=2)
    res = R.report(str(tmp_path), skip=10)
    runs = {r["arm"]: r for r in res["runs"]}
    assert runs["coat_tp2_dp2"]["tokens_per_s"] == pytest.approx(2 * 4 * 2048 / 0.12)
    table = (tmp_path / "results.md").read_text()
    assert table.split("| coat_tp2_dp2 | 4 |")[1].split("\n")[0].endswith("| 1.25x | 0.50x |")
    # four ranks at 110 ms against one at 100 ms: 100 / 110 = 90.9%
    assert res["dp_scaling"] == [{"arm": "coat_dp4", "micro": 4, "efficiency": pytest.approx(100 / 110)}]
    assert "| coat_dp4 | 4 | 297,891 | 81,920 | 90.9% |" in table
    assert R.layout_of("te_memstack_tp2_dp2") == "tp2_dp2" and R.family_of("te_memstack_tp2_dp2") == "te_memstack"


def test_prediction_from_a_missing_log_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no such log"):
        R.predict_max([str(tmp_path / "coat_tp1_mb4.log")])
