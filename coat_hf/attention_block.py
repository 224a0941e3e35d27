"""The attention half of a converted decoder layer, shared by the common composition (coat_hf.decoder) and the
families whose layer differs only after it (Gemma 3): norm + q/k/v in one FP8 GEMM (the input kept as the residual
stream), the family's rotary, the model's attention function, o_proj on the FP8 blocks."""
from __future__ import annotations

import torch

from coat_kernels.act import fp8_linear, fp8_norm_linear

from . import attention, graphed_calls


def attention_block(layer, state, x, norm, position_embeddings, mask, kv_cache, kwargs, rows):
    """-> (o_proj's output [b*s, h], the residual stream x as [b*s, h]) for x [b, s, h]; the arguments are
    coat_hf.decoder.decoder_layer's, `norm` the layer's norm before attention."""
    family, attn = state.family, layer.self_attn
    kw = dict(config=state.config, runtime=state.runtime)
    b, s, h = x.shape
    qkv_bias = None
    if attn.q_proj.bias is not None:
        qkv_bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    qkv, residual = fp8_norm_linear(x.reshape(b * s, h), norm.weight, None,
                                    (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight), qkv_bias,
                                    eps=family.norm_eps(norm), zero_centered_gamma=family.norm_offset,
                                    residual_out=True, weight_cache=state.qkv_cache, **kw)
    q, k, v = family.rotary(attn, qkv, b, s, position_embeddings, state)
    if kv_cache is not None:
        k, v = kv_cache.update(k, v, attn.layer_idx)
    o, kept = attention.attend(attn, q, k, v, mask, family.attention_kwargs(attn), kwargs or {})
    if rows is not None:
        graphed_calls.zero_padded_rows(o, rows, s)
    a = fp8_linear(o, attn.o_proj.weight, attn.o_proj.bias, reuse_input=kept, weight_cache=state.o_cache, **kw)
    return a, residual
