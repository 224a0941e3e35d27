"""Qwen3 decoder layers: Llama's, plus a per-head RMSNorm of q and k before RoPE (`q_norm`, `k_norm`). Those norms
and RoPE run in BF16 through Hugging Face's own modules and `apply_rotary_pos_emb`."""
from __future__ import annotations

from .base import Family, layer_sliding_window


def rotary(attn, qkv, b, s, position_embeddings, state):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    cfg = attn.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    cos, sin = position_embeddings
    q, k, v = qkv.view(b, s, hq + 2 * hkv, d).split((hq, hkv, hkv), 2)
    q, k = apply_rotary_pos_emb(attn.q_norm(q).transpose(1, 2), attn.k_norm(k).transpose(1, 2), cos, sin)
    return q, k, v.transpose(1, 2)


FAMILY = Family("qwen3", rotary, attention_kwargs=layer_sliding_window)
