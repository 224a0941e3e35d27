"""Attention core for the COAT spec: COAT keeps attention in BF16, so this picks an existing implementation.

"auto" (the default): torch SDPA, cuDNN's fused attention first on CUDA (then torch's flash / efficient kernels;
the math kernel on the CPU); with it the COAT layer runs its fused attention path (coat_megatron.self_attention:
RoPE fused with the q/k/v split, no BF16 copies around the core). "sdpa": the same as "auto". "te":
TransformerEngine's DotProductAttention (needed for context parallelism). "megatron": Megatron's own
DotProductAttention, which materialises the full score matrix and runs an unfused softmax (CUDA only: it allocates
its softmax buffer there). "te" and "megatron" run Megatron's own SelfAttention forward around the core.
"""
from __future__ import annotations

import contextlib

import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch.nn.attention import SDPBackend, sdpa_kernel

ATTENTION_BACKENDS = ("auto", "te", "megatron", "sdpa")
# SDPA's kernel order on CUDA: cuDNN's fused attention first (on Hopper it is faster than the flash kernels torch
# picks by default; BENCHMARKS.md), then torch's own order.
CUDA_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.MATH]


def sdpa_backends(device):
    """The context that orders SDPA's kernels for tensors on `device` (nothing to order on the CPU)."""
    if device.type == "cuda":
        return sdpa_kernel(CUDA_SDPA_BACKENDS, set_priority=True)
    return contextlib.nullcontext()


def sdpa(q, k, v, *, causal: bool, mask=None, dropout: float = 0.0, scale=None):
    """Attention of q [b, Hq, s, d] over k, v [b, Hkv, s, d] (grouped-query attention when Hkv < Hq); mask: SDPA's
    boolean mask (True = attend) or None. Returns [b, Hq, s, d]."""
    with sdpa_backends(q.device):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout,
                                              scale=scale, enable_gqa=k.shape[1] != q.shape[1])


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
        mask = None
        if not causal and attention_mask is not None:
            mask = ~attention_mask  # Megatron: True = masked out; SDPA: True = attend
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        ctx = sdpa(q, k, v, causal=causal, mask=mask, dropout=self.dropout if self.training else 0.0,
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
