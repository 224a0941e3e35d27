"""The model families convert_to_coat knows: what differs between their decoder layers, one module per family.

`FAMILIES` maps a `transformers` config's `model_type` to the class name of its decoder layer and its `Family`.
A new family is one module defining a `Family` plus one line here (docs/hf.md says how).
"""
from __future__ import annotations

from . import gemma3, llama, olmo2, qwen3
from .base import Family

FAMILIES: dict[str, tuple[str, Family]] = {
    "llama": ("LlamaDecoderLayer", llama.FAMILY),
    "mistral": ("MistralDecoderLayer", llama.MISTRAL),
    "qwen2": ("Qwen2DecoderLayer", llama.QWEN2),
    "qwen3": ("Qwen3DecoderLayer", qwen3.FAMILY),
    "olmo2": ("Olmo2DecoderLayer", olmo2.FAMILY),
    "gemma3_text": ("Gemma3DecoderLayer", gemma3.FAMILY),
}

__all__ = ["FAMILIES", "Family"]
