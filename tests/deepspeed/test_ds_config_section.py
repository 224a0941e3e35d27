"""The ds_config's "coat" section is found or refused, never silently missed: DeepSpeed ignores top-level keys it
does not know, so a misspelt section name ("COAT", "coat_fp8", ...) would train the model in BF16 without a word.
coat_ds checks the names when the engine is built (coat_ds.engine_hooks) and answers "did you mean 'coat'"."""
import os
import subprocess
import sys

import pytest

from coat_ds.ds_config import parse_section

NEAR_MISSES = ["COAT", "Coat", "coat_fp8", "coat-fp8", "COAT_FP8", "coatfp8", "coat_config", "coats", "caot", "cot",
               "Coat FP8"]
DEEPSPEED_KEYS = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
                  "scheduler", "zero_optimization", "bf16", "fp16", "gradient_clipping", "checkpoint", "compile",
                  "comms_logger", "flops_profiler", "activation_checkpointing", "data_types", "steps_per_print",
                  "wall_clock_breakdown", "tensorboard", "aio", "elasticity", "communication_data_type"]


@pytest.mark.parametrize("key", NEAR_MISSES)
def test_near_miss_section_names_are_errors_with_the_right_name(key):
    with pytest.raises(ValueError, match=f"top-level key\\(s\\) \\['{key}'\\].*did you mean 'coat'"):
        parse_section({"train_micro_batch_size_per_gpu": 1, key: {"fp8_activations": True}})


def test_a_near_miss_beside_the_real_section_is_an_error_too():
    with pytest.raises(ValueError, match="did you mean 'coat'"):
        parse_section({"coat": {"fp8_activations": True}, "Coat": {"fp8_activations": False}})


def test_deepspeed_keys_pass_and_a_config_without_the_section_has_none():
    assert parse_section({key: {} for key in DEEPSPEED_KEYS}) is None
    section = parse_section({**{key: {} for key in DEEPSPEED_KEYS}, "coat": {"fp8_activations": True}})
    assert section.fp8_activations


def test_misspelt_section_fails_deepspeed_initialize_with_the_hint():
    """A real engine: deepspeed.initialize with "COAT" instead of "coat" raises before anything is built."""
    code = ("import os, sys, importlib, torch, deepspeed\n"
            "importlib.import_module('deepspeed.comm.torch')\n"
            "sys.modules['deepspeed.comm.torch'].build_shm_op = lambda: None\n"
            "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29617', RANK='0', LOCAL_RANK='0',\n"
            "                  WORLD_SIZE='1')\n"
            "cfg = {'train_micro_batch_size_per_gpu': 1,\n"
            "       'optimizer': {'type': 'CoatFP8AdamW', 'params': {'lr': 1e-3}},\n"
            "       'COAT': {'fp8_activations': True}}\n"
            "try:\n"
            "    deepspeed.initialize(model=torch.nn.Linear(16, 16), config=cfg)\n"
            "    print('built without the section')\n"
            "except ValueError as exc:\n"
            "    print('hint' if \"did you mean 'coat'\" in str(exc) else repr(exc))\n"
            "sys.stdout.flush()\n"
            "os._exit(0)  # a built engine's process-group teardown can hang at interpreter exit\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "hint", proc.stdout + proc.stderr


@pytest.mark.parametrize("stage", [2, 3])
def test_cuda_graphs_under_zero3_are_named_as_having_no_effect(stage, caplog):
    """Under ZeRO-3 a graph replay would bypass the hooks that gather the parameters, so the layers run eagerly: the
    engine says so when the section asks for graphs, rather than leaving the user to find out from the speed."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from coat_ds.engine_hooks import convert_for_section

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    config_class = SimpleNamespace(zero_optimization_stage=stage, gradient_accumulation_steps=1)
    with caplog.at_level("WARNING", logger="coat_ds"):
        assert convert_for_section(model, {"coat": {"fp8_activations": True, "cuda_graphs": True}}, config_class)
    named = [r for r in caplog.records if "cuda_graphs" in r.getMessage() and "ZeRO-3" in r.getMessage()]
    assert len(named) == (1 if stage == 3 else 0)
    assert model.model.layers[0].coat.config.cuda_graphs


# A value other than the default for every ActivationConfig option the section hands on
ACTIVATION_VALUES = {"backend": "torch", "fprop_fast_accum": True, "transposed_weights": "backward",
                     "cuda_graphs": True, "cuda_graph_pad_multiple": 64, "cuda_graph_shapes": 8}


def test_every_activation_config_option_reaches_the_activation_config():
    """The section keeps fp8_activations, cache_weights and chunked_loss; each other ActivationConfig field is a key
    of the section, handed to ActivationConfig as given."""
    import dataclasses

    from coat_kernels.act import ActivationConfig

    fields = {f.name for f in dataclasses.fields(ActivationConfig)} - {"cache_weights"}
    assert set(ACTIVATION_VALUES) == fields, "give the new ActivationConfig field a non-default value here"
    default = ActivationConfig()
    for name, value in ACTIVATION_VALUES.items():
        assert getattr(default, name) != value
        section = parse_section({"coat": {"fp8_activations": True, name: value}})
        config = section.activation_config(zero_stage=2, gradient_accumulation_steps=1)
        assert config == default.replace(**{name: value}, cache_weights=False), name
    section = parse_section({"coat": {"fp8_activations": True, "cache_weights": True, **ACTIVATION_VALUES}})
    assert section.activation_config(3, 1) == ActivationConfig(**ACTIVATION_VALUES, cache_weights=True)


def test_an_unknown_key_is_an_error_naming_every_valid_key():
    import dataclasses

    from coat_kernels.act import ActivationConfig

    with pytest.raises(ValueError, match=r"unknown ds_config \"coat\" key\(s\) \['cuda_graph'\]") as caught:
        parse_section({"coat": {"fp8_activations": True, "cuda_graph": True}})
    valid = str(caught.value).split("valid: ")[1].split(", ")
    assert valid[:3] == ["fp8_activations", "cache_weights", "chunked_loss"]
    assert set(valid) == {"fp8_activations", "chunked_loss"} | {f.name for f in dataclasses.fields(ActivationConfig)}
    assert "did you mean 'cuda_graph' -> 'cuda_graphs'" in str(caught.value)


@pytest.mark.parametrize("key, value, error", [
    ("fp8_activations", "true", TypeError), ("chunked_loss", 1, TypeError), ("cache_weights", "yes", TypeError),
    ("fprop_fast_accum", "false", TypeError), ("cuda_graph_shapes", 8.0, TypeError), ("cuda_graphs", 1, TypeError),
    ("backend", "cuda", ValueError), ("transposed_weights", "later", ValueError),
    ("cuda_graph_pad_multiple", 0, ValueError)])
def test_a_wrong_value_is_an_error_naming_the_section_and_the_key(key, value, error):
    with pytest.raises(error, match=f'^ds_config "coat": {key} must be .*{value!r}'):
        parse_section({"coat": {"fp8_activations": True, key: value}})


def test_a_refused_param_group_leaves_the_model_parameter_table_in_group_order():
    import torch

    from coat_ds.optimizer import CoatFP8AdamW

    a, b, c = (torch.nn.Parameter(torch.zeros(32)) for _ in range(3))
    opt = CoatFP8AdamW([a])
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [b, a]})
    opt.add_param_group({"params": [c]})
    assert [len(ps) for ps in opt._model_params] == [1, 1] and opt._model_params[1][0] is c
    assert opt.param_segments(c, 1) is None  # group 1's own parameter, found where it belongs


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2))


def classes_and_attributes(model):
    return [(name, type(m), sorted(k for k in vars(m) if k.startswith("coat"))) for name, m in model.named_modules()]


def test_a_refused_engine_leaves_the_model_unconverted():
    """DeepSpeed's own checks run inside the engine's __init__, after the section converted the model: when they
    refuse the config, the model is put back as it was (classes, attributes), so the caller can fix the config and
    build again."""
    from types import SimpleNamespace

    from coat_ds.engine_hooks import _engine_init_with_coat

    def refusing_init(self, *args, **kwargs):
        assert type(kwargs["model"].model.layers[0]).__name__.startswith("Coat")  # converted before DeepSpeed ran
        raise ValueError("DeepSpeed refused the config")

    model = tiny_llama()
    before = classes_and_attributes(model)
    config_class = SimpleNamespace(zero_optimization_stage=2, gradient_accumulation_steps=1, optimizer_name=None)
    with pytest.raises(ValueError, match="DeepSpeed refused"):
        _engine_init_with_coat(refusing_init)(object(), model=model, config={"coat": {"fp8_activations": True}},
                                              config_class=config_class)
    assert classes_and_attributes(model) == before


def test_triton_backend_without_cuda_is_refused_when_the_engine_is_built(monkeypatch):
    from types import SimpleNamespace

    import torch

    from coat_ds.engine_hooks import convert_for_section
    from coat_kernels import triton_fp8

    monkeypatch.setattr(triton_fp8, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = tiny_llama()
    before = classes_and_attributes(model)
    config_class = SimpleNamespace(zero_optimization_stage=2, gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match=r'ds_config "coat": "backend": "triton".*CUDA.*"auto"'):
        convert_for_section(model, {"coat": {"fp8_activations": True, "backend": "triton"}}, config_class)
    assert classes_and_attributes(model) == before
