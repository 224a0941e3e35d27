"""launch/ds_optimizer_recipes.py: DeepSpeed 0.19.8 reads each recipe's ds_config as the recipe says (bf16 optimizer
states need its bf16 master weights), and one recipe run on the CPU through train_ds.py gives the report its row, the
recipes not run listed as such."""
import pytest

from launch import ds_optimizer_recipes as recipes


def test_deepspeed_reads_each_recipe_as_described():
    from deepspeed.runtime.config import DeepSpeedConfig

    expected = {"adamw_fp32": (False, "adamw"), "adamw_bf16_states": (True, "adamw"),
                "coat": (False, "CoatFP8AdamW"), "coat_remainders": (True, "CoatFP8AdamW")}
    for recipe, (bf16_states, optimizer) in expected.items():
        config = dict(recipes.ds_config(recipe), train_batch_size=2, train_micro_batch_size_per_gpu=2)
        parsed = DeepSpeedConfig(config)
        assert parsed.bfloat16_config.bf16_optimizer_states is bf16_states, recipe
        assert parsed.bfloat16_config.bf16_master_weights_and_grads is bf16_states, recipe
        assert parsed.optimizer_name == optimizer and parsed.zero_optimization_stage == 2, recipe
    assert recipes.ds_config("coat_remainders")["optimizer"]["params"]["master_remainders"] is True
    with pytest.raises(ValueError, match="unknown recipe"):
        recipes.ds_config("adam8bit")


def test_a_recipe_run_on_the_cpu_reports_its_state_bytes(tmp_path):
    code = recipes.run(["adamw_bf16_states", "--out", str(tmp_path), "--model", "tiny", "--steps", "2",
                        "--seq-len", "32", "--global-batch", "2", "--data", "bigram", "--port", "29671"])
    assert code == 0, (tmp_path / "adamw_bf16_states.log").read_text()[-3000:]
    text = recipes.report(str(tmp_path))
    row = next(line for line in text.splitlines() if line.startswith("| torch AdamW, bf16_optimizer_states"))
    assert "| 4.00 |" in row  # bf16 exp_avg and exp_avg_sq: 2 + 2 bytes per parameter, from DeepSpeed's tensors
    summary = recipes.summaries(str(tmp_path))["adamw_bf16_states"]
    assert f"| {summary['mean_loss_last10']:.4f} |" in row
    assert f"no SUMMARY in {tmp_path}/coat.log (not run or failed)" in text
    assert (tmp_path / "results.md").read_text().strip() == text.strip()
