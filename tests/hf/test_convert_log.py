"""The line convert_to_coat logs: INFO for a conversion of every decoder layer, naming the dtype the embeddings, final
norm and LM head stay in (the model's, BF16 or fp32); a WARNING when some layers stay unconverted, naming them."""
import logging

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from coat_hf import ActivationConfig, convert_to_coat


def llama(dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    return LlamaForCausalLM(cfg).to(dtype)


def conversion_records(model, caplog):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="coat_hf"):
        convert_to_coat(model, ActivationConfig(backend="torch"))
    return [r for r in caplog.records if r.name == "coat_hf"]


def test_a_full_conversion_is_info_and_names_the_models_dtype(caplog):
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        record, = conversion_records(llama(dtype), caplog)
        assert record.levelno == logging.INFO
        assert "2 decoder layers of CoatLlamaForCausalLM on FP8 activations" in record.getMessage()
        assert f"embeddings, final norm and LM head stay in {name}" in record.getMessage()
        assert "BF16" not in record.getMessage() and "not converted" not in record.getMessage()


def test_layers_left_unconverted_are_a_warning_that_names_them(caplog):
    model = llama(torch.bfloat16)
    gate = model.model.layers[1].mlp.gate_proj
    gate.bias = torch.nn.Parameter(torch.zeros(gate.out_features, dtype=torch.bfloat16))
    record, = conversion_records(model, caplog)
    assert record.levelno == logging.WARNING
    assert "1 decoder layers" in record.getMessage()
    assert "not converted: model.layers.1 (MLP biases on gate/up)" in record.getMessage()
