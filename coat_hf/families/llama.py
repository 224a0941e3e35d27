"""Llama, Mistral and Qwen2 decoder layers (Mistral and Qwen2 pass their attention a sliding window): q/k/v projections
(Qwen2's with biases), RoPE in the rotate-half form, grouped-query attention. RoPE runs fused with the q/k/v split of
the QKV GEMM output (coat_kernels.act.rope), on the cos/sin tables Hugging Face's rotary embedding computed for the
batch (any RoPE scaling variant)."""
from __future__ import annotations

from coat_kernels.act.rope import rope_split

from .base import Family, config_sliding_window, layer_sliding_window


def rotary(attn, qkv, b, s, position_embeddings, state):
    cfg = attn.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    cos, sin = position_embeddings
    # [1 or b, s, d] (cat(freqs, freqs)) -> [s or b*s, d/2]: token t of the flat batch uses row t % rows. The tables
    # stay in Hugging Face's dtype (the RoPE kernel reads them as fp32): a conversion here would let torch.compile
    # fuse it with the tables' computation and skip their rounding to that dtype, which eager applies
    tables = [t[..., : d // 2].reshape(-1, d // 2).contiguous() for t in (cos, sin)]
    q, k, v = rope_split(qkv, *tables, d, hkv, state.config.use_triton(qkv), handoff=state.runtime.handoff,
                         tickets=state.runtime.tickets)
    q = q.view(b, s, hq, d).transpose(1, 2)
    k, v = (t.view(b, s, hkv, d).transpose(1, 2) for t in (k, v))
    return q, k, v


FAMILY = Family("llama", rotary)
MISTRAL = Family("mistral", rotary, attention_kwargs=config_sliding_window)
QWEN2 = Family("qwen2", rotary, attention_kwargs=layer_sliding_window)
