"""`Family`: what a converted decoder layer (coat_hf.decoder) needs to know about one model family.

The shared composition, which every family runs unless it brings its own layer forward:

    h = x + o_proj(attention(rotary(qkv(norm1(x)))));  y = h + down(act(gate) * up), [gate | up] = fc1(norm2(h))

A family owns everything the composition reads from a model: how its layer's q/k/v become rotated attention inputs
(`rotary`), its MLP activation (`activation`, read from the config key `activation_key`), its norms' epsilon
(`norm_eps`: the module's `variance_epsilon` or `eps`) and scale form (`norm_offset`: weight + 1, Gemma-style), what
its attention module passes the attention function besides the arguments every family passes (`attention_kwargs`:
Mistral's and Qwen's sliding window), which of its layers the FP8 blocks cannot run (`unsupported`), and, for a
family whose layer is not that composition, its own whole-layer forward (`layer_forward`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import attention

# rotary(attn, qkv [b*s, (hq + 2 hkv) d], b, s, (cos, sin), state) -> q [b, hq, s, d], k and v [b, hkv, s, d]
Rotary = Callable[..., tuple]
# layer_forward(layer, state, x [b, s, h], (cos, sin), mask, kv_cache, kwargs, rows) -> [b, s, h]: the arguments of
# coat_hf.decoder.decoder_layer
LayerForward = Callable[..., torch.Tensor]

# Hugging Face activation names (the config's value, a key of transformers' ACT2FN) -> the activation of the FP8
# gated-GLU MLP block
GATED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def no_attention_kwargs(attn: torch.nn.Module) -> dict:
    return {}


def config_sliding_window(attn: torch.nn.Module) -> dict:
    """Mistral: the config's window for every layer."""
    return {"sliding_window": getattr(attn.config, "sliding_window", None)}


def layer_sliding_window(attn: torch.nn.Module) -> dict:
    """Qwen2 / Qwen3 / Gemma 3: each attention module's own window (None on full-attention layers)."""
    return {"sliding_window": getattr(attn, "sliding_window", None)}


@dataclass(frozen=True)
class Family:
    name: str
    rotary: Rotary
    norm_offset: bool = False
    extra_check: Optional[Callable[[torch.nn.Module], Optional[str]]] = None
    attention_kwargs: Callable[[torch.nn.Module], dict] = no_attention_kwargs
    activation_key: str = "hidden_act"
    layer_forward: Optional[LayerForward] = None

    def hf_activation(self, layer: torch.nn.Module) -> str:
        """The MLP activation's Hugging Face name, from the layer's config."""
        return getattr(layer.self_attn.config, self.activation_key, "silu")

    def activation(self, layer: torch.nn.Module) -> str:
        """The activation of the FP8 gated-GLU MLP block for this layer (`unsupported` refuses layers without one)."""
        return GATED_ACTIVATIONS[self.hf_activation(layer)]

    @staticmethod
    def norm_eps(norm: torch.nn.Module) -> float:
        """An RMSNorm module's epsilon: `variance_epsilon` (Llama, Qwen, OLMo) or `eps` (Gemma)."""
        eps = getattr(norm, "variance_epsilon", None)
        return norm.eps if eps is None else eps

    def unsupported(self, layer: torch.nn.Module) -> str | None:
        """Why `layer` cannot run on COAT's FP8 blocks (None: it can)."""
        attn, mlp = layer.self_attn, layer.mlp
        cfg = attn.config
        act = self.hf_activation(layer)
        if act not in GATED_ACTIVATIONS:
            return f"activation {act}; the FP8 MLP block is gated by {', '.join(sorted(GATED_ACTIVATIONS))}"
        if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj")):
            return "MLP biases on gate/up"
        widths = (cfg.hidden_size, cfg.intermediate_size, attn.head_dim * cfg.num_attention_heads,
                  attn.head_dim * cfg.num_key_value_heads)
        if any(w % 16 for w in widths) or attn.head_dim % 2:
            return f"widths {widths} not multiples of 16"
        problem = attention.unsupported(attn)
        if problem:
            return problem
        return self.extra_check(layer) if self.extra_check else None
