"""Gemma 3 text decoder layers (`Gemma3DecoderLayer`, model_type gemma3_text): GeGLU MLP (`gelu_pytorch_tanh`, read
from the config's `hidden_activation`), RMSNorms that multiply by (1 + weight) and name their epsilon `eps`,
per-head RMSNorms of q and k before RoPE, attention scaled by `query_pre_attn_scalar` (the module's `scaling`), and
sandwich norms: the attention output and the MLP output are normed before their residual adds. Sliding-window layers
get their own window (the module's `sliding_window`), mask and RoPE tables from the model, which hands each layer the
position embeddings of its layer type. Its layer forward on the FP8 blocks:

    h = x + post_attention_norm(o_proj(attention(rope(q_norm(q), k_norm(k)), v))),  [q | k | v] = qkv(norm1(x))
    y = h + post_feedforward_norm(down(gelu_tanh(gate) * up)),  [gate | up] = fc1(pre_feedforward_norm(h))

- norm1 + q/k/v: one `fp8_norm_linear` (residual_out: x's two gradients meet inside the norm backward);
- q_norm, k_norm and RoPE as Qwen3's (`qwen3.rotary`), in BF16 through the model's modules;
- attention: the model's backend through coat_hf.attention, with the layer's sliding window;
- o_proj: `fp8_linear`; post_attention_layernorm in BF16 through the model's module;
- the residual add + pre_feedforward_layernorm + gate/up + GeGLU + down: one `fp8_norm_swiglu_mlp` node;
- post_feedforward_layernorm in BF16 through the model's module.
The two post norms in BF16 keep their input and normalized input in fp32 for backward (8 bytes per element of the
attention and MLP outputs); the per-head q/k norms the same per element of q and k.
"""
from __future__ import annotations

from coat_kernels.act import fp8_norm_swiglu_mlp

from .. import graphed_calls
from ..attention_block import attention_block
from . import qwen3
from .base import Family, layer_sliding_window


def layer_forward(layer, state, x, position_embeddings, mask=None, kv_cache=None, kwargs=None, rows=None):
    """One Gemma 3 decoder layer of x [b, s, h] on the FP8 blocks (see the module docstring); the arguments are
    coat_hf.decoder.decoder_layer's."""
    family = state.family
    attn, mlp = layer.self_attn, layer.mlp
    norm2 = layer.pre_feedforward_layernorm
    kw = dict(config=state.config, runtime=state.runtime)
    b, s, h = x.shape
    a, residual = attention_block(layer, state, x, layer.input_layernorm, position_embeddings, mask, kv_cache, kwargs,
                                  rows)
    y, hsum = fp8_norm_swiglu_mlp(layer.post_attention_layernorm(a), norm2.weight, None,
                                  (mlp.gate_proj.weight, mlp.up_proj.weight), mlp.down_proj.weight,
                                  fc2_bias=mlp.down_proj.bias, residual=residual, eps=family.norm_eps(norm2),
                                  zero_centered_gamma=family.norm_offset, activation=family.activation(layer),
                                  fc1_cache=state.fc1_cache, fc2_cache=state.fc2_cache, **kw)
    out = hsum + layer.post_feedforward_layernorm(y)
    if rows is not None and (attn.o_proj.bias is not None or mlp.down_proj.bias is not None):
        graphed_calls.zero_padded_rows(out, rows, s)
    return out.view(b, s, h)


FAMILY = Family("gemma3_text", qwen3.rotary, norm_offset=True, attention_kwargs=layer_sliding_window,
                activation_key="hidden_activation", layer_forward=layer_forward)
