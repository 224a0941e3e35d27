"""OLMo-2 decoder layers (`Olmo2DecoderLayer`): no input norms; the attention output and the MLP output are
RMS-normed before their residual adds (`post_attention_layernorm`, `post_feedforward_layernorm`), and q and k are
RMS-normed over their whole projection widths (`q_norm`, `k_norm`) before RoPE. Not the shared composition, so the
family brings its own layer forward on the FP8 blocks:

    h = x + post_attention_norm(o_proj(attention(rope(q_norm(q), k_norm(k)), v))),  [q | k | v] = qkv(x)
    y = h + post_feedforward_norm(down(silu(gate) * up)),  [gate | up] = fc1(h)

- q/k/v: one `fp8_linear` over the three weights (x saved as E4M3, 1 byte per element);
- q_norm, k_norm, RoPE (`apply_rotary_pos_emb`) and the two post norms in BF16 through the model's own modules: each
  Olmo2RMSNorm keeps its input and its normalized input in fp32 for backward, 8 bytes per element of q, k, the
  attention output and the MLP output (a Llama layer keeps its two norm inputs as E4M3 1x16, 1.125 bytes each);
- attention: the model's backend through coat_hf.attention, as in every family;
- o_proj: `fp8_linear`, reusing the attention output where the attention kernel keeps it;
- gate/up: `fp8_linear` over the two weights (h saved as E4M3); down: `fp8_swiglu_linear` (gate/up saved as E4M3
  1x16, the product recomputed in backward).
"""
from __future__ import annotations

import torch

from coat_kernels.act import fp8_linear, fp8_swiglu_linear

from .. import attention, graphed_calls
from .base import Family


def rotary(attn, qkv, b, s, position_embeddings, state):
    """q_norm and k_norm over the whole q and k widths, then RoPE, in BF16 through the model's own modules."""
    from transformers.models.olmo2.modeling_olmo2 import apply_rotary_pos_emb

    cfg = attn.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), -1)
    q = attn.q_norm(q).view(b, s, hq, d).transpose(1, 2)
    k = attn.k_norm(k).view(b, s, hkv, d).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
    return q, k, v.reshape(b, s, hkv, d).transpose(1, 2)


def layer_forward(layer, state, x, position_embeddings, mask=None, kv_cache=None, kwargs=None, rows=None):
    """One OLMo-2 decoder layer of x [b, s, h] on the FP8 blocks (see the module docstring); the arguments are
    coat_hf.decoder.decoder_layer's."""
    attn, mlp = layer.self_attn, layer.mlp
    kw = dict(config=state.config, runtime=state.runtime)
    b, s, h = x.shape
    x2 = x.reshape(b * s, h)
    qkv_bias = None
    if attn.q_proj.bias is not None:
        qkv_bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    qkv = fp8_linear(x2, (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight), qkv_bias,
                     weight_cache=state.qkv_cache, **kw)
    q, k, v = state.family.rotary(attn, qkv, b, s, position_embeddings, state)
    if kv_cache is not None:
        k, v = kv_cache.update(k, v, attn.layer_idx)
    o, kept = attention.attend(attn, q, k, v, mask, state.family.attention_kwargs(attn), kwargs or {})
    if rows is not None:
        graphed_calls.zero_padded_rows(o, rows, s)
    a = fp8_linear(o, attn.o_proj.weight, attn.o_proj.bias, reuse_input=kept, weight_cache=state.o_cache, **kw)
    hsum = x2 + layer.post_attention_layernorm(a)
    gate_up = fp8_linear(hsum, (mlp.gate_proj.weight, mlp.up_proj.weight), weight_cache=state.fc1_cache, **kw)
    y = fp8_swiglu_linear(gate_up, mlp.down_proj.weight, mlp.down_proj.bias, activation=state.family.activation(layer),
                          weight_cache=state.fc2_cache, **kw)
    out = hsum + layer.post_feedforward_layernorm(y)
    if rows is not None and (attn.o_proj.bias is not None or mlp.down_proj.bias is not None):
        graphed_calls.zero_padded_rows(out, rows, s)
    return out.view(b, s, h)


FAMILY = Family("olmo2", rotary, layer_forward=layer_forward)
