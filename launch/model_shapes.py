"""The models launch/train_ds.py trains (`--model`): causal LMs built from a `transformers` config with random
weights, no downloads, each with its own model class (Llama, OLMo-2, Gemma 3), and the labels train_ds prints for
them."""
from __future__ import annotations

import collections
from typing import NamedTuple

import torch


class ModelShape(NamedTuple):
    """A causal LM built from a `transformers` config, no downloads: the architecture (which config and model classes,
    ARCHITECTURES) and the config's fields (the sequence length, attention backend and use_cache are train_ds's)."""
    architecture: str
    fields: dict


# architecture -> (config class, causal LM class) in transformers; each is converted by the ds_config's "coat" section
# through its coat_hf family
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def llama(**fields) -> ModelShape:
    return ModelShape("llama", dict(rms_norm_eps=1e-5, tie_word_embeddings=False, **fields))


def olmo2(**fields) -> ModelShape:
    return ModelShape("olmo2", dict(rms_norm_eps=1e-6, tie_word_embeddings=False, **fields))


def gemma3(**fields) -> ModelShape:
    """Gemma 3 text: GeGLU (gelu_pytorch_tanh), query_pre_attn_scalar = head_dim, RoPE bases 10,000 on sliding-window
    layers and 1,000,000 on full ones, five sliding-window layers to one full one (Gemma3TextConfig's defaults unless
    `fields` give layer_types), tied embeddings."""
    return ModelShape("gemma3", dict(rms_norm_eps=1e-6, tie_word_embeddings=True, **fields))


MODELS = {
    # TinyLlama 1.1B shape
    "tinyllama-1b": llama(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                          num_attention_heads=32, num_key_value_heads=4),
    # ~3B: Llama hidden 3072 (e.g. Llama-3.2-3B's width), 26 layers, GQA 24/8
    "llama-3b": llama(vocab_size=32000, hidden_size=3072, intermediate_size=8192, num_hidden_layers=26,
                      num_attention_heads=24, num_key_value_heads=8),
    # Llama-2-7B shape (32 layers, hidden 4096, 32 heads, MHA, SwiGLU 11008)
    "llama2-7b": llama(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32),
    # Llama-2-13B shape (40 layers, hidden 5120, 40 heads, MHA, SwiGLU 13824): 13.0 B parameters
    "llama2-13b": llama(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=40),
    # OLMo-2-0425-1B's shape (16 layers, hidden 2048, 16 heads, MHA, SwiGLU 8192, its vocabulary of 100352, RoPE base
    # 500,000): 1.48 B parameters
    "olmo2-1b": olmo2(vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=16, rope_theta=500000.0, pad_token_id=100277,
                      eos_token_id=100257),
    # Gemma-3-1B's text shape (26 layers, hidden 1152, 4 query heads and 1 key/value head of 256, GeGLU 6912, sliding
    # window 512 on five layers of six) with the Llama shapes' vocabulary of 32000 instead of Gemma's 262144 (the
    # synthetic data take the model's vocabulary; --data corpus needs 8192): 0.73 B parameters instead of 1.0 B
    "gemma3-1b": gemma3(vocab_size=32000, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                        sliding_window=512),
    # small enough to save and convert checkpoints often on a GPU; widths FP8 activations can run
    "small": llama(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4),
    "tiny": llama(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    # tiny with an MLP width FP8 activations can run (multiples of 16): "coat": {"fp8_activations": true} on CPU
    "tiny-fp8": llama(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2),
    # tiny-fp8's widths in the other two architectures; Gemma 3 with one sliding-window layer (window 16) and one full
    "tiny-olmo2": olmo2(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, eos_token_id=None),
    "tiny-gemma3": gemma3(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                          sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
}


def build_model(name: str, seq_len: int, device: torch.device, seed: int):
    """MODELS[name] with random weights (the same on every rank), built on `device` in fp32."""
    import transformers

    shape = MODELS[name]
    config_class, model_class = (getattr(transformers, n) for n in ARCHITECTURES[shape.architecture])
    cfg = config_class(**shape.fields, max_position_embeddings=seq_len, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(seed)  # same initial weights on every rank
    with torch.device(device):
        return model_class(cfg)


def decoder_layer_classes(model) -> dict[str, int]:
    """How many of the model's decoder layers are of each class."""
    return dict(collections.Counter(type(layer).__name__ for layer in model.model.layers))


def params_label(n: int) -> str:
    """A parameter count in the unit that shows it: 53.2 K, 12.3 M, 1.10 B."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} B params"
    if n >= 1e6:
        return f"{n / 1e6:.1f} M params"
    return f"{n / 1e3:.1f} K params"
