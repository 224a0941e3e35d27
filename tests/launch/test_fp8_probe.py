"""launch/fp8_probe.py: the per-tensor E4M3 statistics of a GEMM input against formulas written here, and a probe of
a converted tiny Llama against its own weights unconverted (CPU path: losses close, errors per hidden state, every
decoder Linear's input described); train_ds's --probe-step is checked at parsing."""
import copy
from pathlib import Path

import pytest
import torch

from launch import fp8_probe
from launch.model_shapes import build_model
from script_modules import load_script

REPO = Path(__file__).resolve().parents[2]


def test_e4m3_statistics_of_a_tensor_with_one_outlier():
    x = torch.full((4, 8), 1.5)
    x[2, 5] = -448.0 * 1024.0          # amax: the per-tensor scale makes 1.0 into 2^-10, half E4M3's least subnormal
    x[1, 0] = 0.0                      # zeros are not counted
    x[0, 0] = 1.0                      # exactly half of 2^-9: the tie rounds to the even neighbour, zero
    x[0, 1] = 0.25                     # 2^-12: zero
    x[3, :] = 2.0 ** 5                 # 2^-5 after scaling: a normal number
    stats = fp8_probe.e4m3_input_stats(x, real_rows=torch.tensor([True, True, True, False]),
                                       token_ids=[7, 8, 9, 10])
    scaled = x.abs()[x != 0] / 1024.0  # 1.5 -> 0.75 * 2^-9: rounds up to 2^-9, kept
    assert stats["amax"] == 448.0 * 1024.0
    assert stats["flushed_to_zero"] == pytest.approx(float((scaled <= 2 ** -10).float().mean()))
    assert stats["flushed_to_zero"] == pytest.approx(2 / 31)
    # below the least normal (2^-6): every element of rows 0-2 but the zero and the outlier
    assert stats["below_normal"] == pytest.approx(float((scaled < 2 ** -6).float().mean()))
    assert stats["below_normal"] == pytest.approx(22 / 31)
    assert stats["amax_row"] == 2 and stats["amax_row_is_padding"] is False and stats["amax_token"] == 9
    y = torch.ones(1000, 1000)
    y[3, 4] = 500.0
    assert fp8_probe.e4m3_input_stats(y)["amax_over_p999"] == 500.0


def test_a_converted_model_probed_against_its_own_weights_unconverted():
    from coat_hf import ActivationConfig, convert_to_coat

    build = lambda: build_model("tiny-fp8", 64, torch.device("cpu"), 0)  # noqa: E731
    model = convert_to_coat(build().to(torch.bfloat16), ActivationConfig())
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    before = copy.deepcopy(model.state_dict())
    reference = fp8_probe.reference_model(model, build)
    assert type(reference).__name__ == "LlamaForCausalLM" and next(reference.parameters()).dtype == torch.bfloat16
    result = fp8_probe.probe_batch(model, reference, batch)
    assert result["real_tokens"] == 104 and result["tokens"] == 128
    assert abs(result["loss"] - result["reference_loss"]) < 0.05 * result["reference_loss"]
    assert len(result["hidden_error"]) == 3 and result["hidden_error"][0] == 0.0  # the embeddings are not FP8
    assert all(0 < e < 0.2 for e in result["hidden_error"][1:])
    names = set(result["gemm_inputs"])
    assert {f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.q_proj", "self_attn.o_proj",
                                                               "mlp.gate_proj", "mlp.down_proj")} <= names
    assert not any("lm_head" in n for n in names)
    assert all(model.state_dict()[k].equal(v) for k, v in before.items())  # the probe leaves the weights alone
    assert model.training


def test_probe_steps_are_checked_at_parsing(capsys):
    train_ds = load_script(REPO / "launch" / "train_ds.py", "train_ds_for_probe")
    assert train_ds.parse_args(["--ds-config", "c.json", "--steps", "20", "--probe-step", "18",
                                "--probe-step", "3"]).probe_step == [18, 3]
    with pytest.raises(SystemExit):
        train_ds.parse_args(["--ds-config", "c.json", "--steps", "20", "--probe-step", "21"])
    assert "--probe-step 21 is not one of the steps 1..20" in capsys.readouterr().err
