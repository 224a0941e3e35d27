"""launch.megatron_optimizer_report on logs written the way megatron.training (timers at --timing-log-level 1 with
--timing-log-option max, validation lines) and coat_megatron.pretrain_gpt print them."""
from launch import megatron_optimizer_report as R


def write_log(path, validation, optimizer_ms, state=("MegatronCoatFP8AdamW", 4.192), iters=40):
    lines = ["------------------------ arguments ------------------------",
             f"  micro_batch_size {'.' * 32} 8", f"  seq_length {'.' * 38} 512",
             f"  data_parallel_size {'.' * 30} 1", f"  train_iters {'.' * 37} {iters}"]
    for it in range(10, iters + 1, 10):
        lines.append(f" [2026-11-25 10:00:00.000000] iteration {it:8d}/{iters:8d} | consumed samples: {it * 8:12d} |"
                     f" elapsed time per iteration (ms): 50.0 | learning rate: 6.000000E-04 | global batch size: "
                     f"    8 | lm loss: 5.000000E+00 | loss scale: 1.0 | grad norm: 1.000 |")
        lines += ["max time across ranks (ms):",
                  f"    {'forward-backward '.ljust(48, '.')}: 40.00",
                  f"    {'optimizer '.ljust(48, '.')}: {optimizer_ms + it / 100:.2f}"]
        if it % 20 == 0:
            lines.append(f" validation loss at iteration {it} | lm loss value: "
                         f"{validation + 1 - it / iters:.6E} | lm loss PPL: 1.0E+01 | ")
    # after training, megatron.training evaluates again on other batches of each split: not the arm's result
    lines += [f" validation loss at iteration {iters} on validation set | lm loss value: 9.0E+00 | lm loss PPL: 1 | ",
              f" validation loss at iteration {iters} on test set | lm loss value: 8.0E+00 | lm loss PPL: 1 | "]
    lines += [f"[coat_megatron] rank 0 optimizer state: {state[0]} 100.0 MiB for 1.00M elements "
              f"({state[1]:.3f} B/element)", "[coat_megatron] rank 0 peak memory allocated: 3.50 GiB",
              "[coat_megatron] rank 0 memory allocated after training: 1.25 GiB of 80.00 GiB"]
    path.write_text("\n".join(lines) + "\n")


def test_optimizer_time_validation_and_seed_spread(tmp_path, capsys):
    write_log(tmp_path / "bf16_s0.log", 3.20, 9.0, ("Adam", 12.0))
    write_log(tmp_path / "bf16_s1.log", 3.21, 9.0, ("Adam", 12.0))
    write_log(tmp_path / "coat.log", 3.208, 4.0)
    runs = {r["arm"]: r for r in R.report(str(tmp_path), skip=20)["runs"]}
    assert runs["coat"]["final_validation_loss"] == 3.208 and runs["coat"]["state_bytes_per_element"] == 4.192
    assert runs["coat"]["optimizer_ms"] == {"optimizer": 4.35}  # median of iterations 30 and 40
    assert runs["bf16_s0"]["held_gib"] == 1.25 and runs["bf16_s0"]["peak_gib"] == 3.5
    table = (tmp_path / "results.md").read_text()
    assert "| coat | MegatronCoatFP8AdamW | 4.192 | 3.50 | 1.25 | 4.35 |" in table and "+0.250%" in table
    assert "BF16 seed spread (max - min over 2 seeds): 0.312% of bf16_s0" in table
