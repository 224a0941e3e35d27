"""Attention core for the COAT spec: COAT keeps attention in BF16, so this picks an existing implementation.

"auto" (the default): torch SDPA, whose flash / cuDNN kernels on CUDA (math kernel on the CPU) measured faster inside
the COAT layer than TransformerEngine's DotProductAttention (BENCHMARKS.md). "te": TransformerEngine's core (needed for
context parallelism). "megatron": Megatron's own DotProductAttention, which materialises the full score matrix and
runs an unfused softmax (CUDA only: it allocates its softmax buffer there). "sdpa": the same as "auto".
"""
from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

ATTENTION_BACKENDS = ("auto", "te", "megatron", "sdpa")


class SDPACoreAttention(MegatronModule):
    """torch scaled_dot_product_attention with DotProductAttention's constructor and call signature."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise NotImplementedError("SDPACoreAttention does not support context parallelism")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: packed sequences and attention bias are not supported")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != q.shape[1]:  # grouped-query attention
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        mask = None
        if not causal and attention_mask is not None:
            mask = ~attention_mask  # Megatron: True = masked out; SDPA: True = attend
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             dropout_p=self.dropout if self.training else 0.0,
                                             scale=self.softmax_scale)
        s, b = query.shape[0], query.shape[1]
        return ctx.permute(2, 0, 1, 3).reshape(s, b, -1)


def core_attention_class(backend: str = "auto"):
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "te":
        try:
            from megatron.core.extensions.transformer_engine import HAVE_TE, TEDotProductAttention
        except ImportError:
            HAVE_TE = False
        if HAVE_TE:
            return TEDotProductAttention
        raise ImportError("attention backend 'te' asked for, but TransformerEngine is not importable")
    if backend == "megatron":
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return DotProductAttention
    return SDPACoreAttention
