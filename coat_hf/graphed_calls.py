"""Which calls of a converted decoder layer replay per-layer CUDA graphs, and the inputs those graphs share.

A graphed call pads the sequence to its bucket, a multiple of `ActivationConfig.cuda_graph_pad_multiple`, inside the
layer: x [b, n, h] becomes [b, S, h] with zero rows, and every layer of the step reads the same padded position tables
(cos, sin [1 or b, S, d], zero rows), the padded mask (Hugging Face's [b, 1, n, n] in the top-left corner; padded
keys masked for real queries; padded queries attend causally, so no row is fully masked) and the number of real
positions n. Causal attention keeps the real positions from seeing the padded ones, and the layer zeroes the padded
rows of its attention output (`rows` of decoder_layer), so padded rows stay zero through the layer, their gradients
are zero, and every per-tensor FP8 scale is the one of the unpadded batch.
"""
from __future__ import annotations

import functools

import torch

from coat_kernels.act.graph_pool import SharedInputs

from . import attention

# Attention backends whose calls can be captured in a CUDA graph as they are: no host synchronisation, and every input
# a tensor of a fixed shape (flex attention's BlockMask and the flash kernels' sequence boundaries are not).
GRAPHABLE_ATTENTION = ("sdpa", "eager")
# Keyword arguments of packed batches for the flash kernels (sequence boundaries): data-dependent shapes
VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def refusal(layer, x) -> tuple | None:
    """(topic, message) of a standing reason why a training call with cuda_graphs on never replays graphs, to warn
    about once per model; None where there is none."""
    if not (layer.training and torch.is_grad_enabled()):
        return None
    if getattr(layer, "gradient_checkpointing", False):
        return ("checkpointing", "coat-fp8: cuda_graphs is not used with gradient checkpointing: the decoder layers "
                "run eagerly (graphs keep every layer's saved activations allocated, which checkpointing exists to "
                "drop, and its recomputation runs outside them); turn one of the two off")
    if not x.is_cuda:
        return ("device", f"coat-fp8: cuda_graphs has no effect on {x.device.type} tensors: the decoder layers run "
                "eagerly (CUDA graphs exist on CUDA devices only)")
    return None


def graphable(layer, x, mask, kv_cache, kwargs) -> bool:
    """Whether this call of a converted layer may replay CUDA graphs: asked for by the config; a CUDA training step
    (grad enabled, no KV cache, no dropout) outside another capture and outside torch.compile; an attention backend
    in GRAPHABLE_ATTENTION with a square 4-D mask or none; no activation checkpointing, no module hooks (ZeRO-3's
    parameter gathering, offloading hooks) around the layer and no saved-tensor hooks (activation offloading, memory
    measurements), which a replay would bypass."""
    n = x.shape[1]
    return (layer.coat.config.cuda_graphs and x.is_cuda and x.dim() == 3 and torch.is_grad_enabled()
            and kv_cache is None and not (layer.training and layer.self_attn.attention_dropout > 0)
            and attention.implementation(layer.self_attn) in GRAPHABLE_ATTENTION
            and (mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 4
                                  and tuple(mask.shape[2:]) == (n, n)))
            and not any(kwargs.get(name) is not None for name in VARLEN_KWARGS)
            and not getattr(layer, "gradient_checkpointing", False)
            and not (layer._forward_pre_hooks or layer._forward_hooks)
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
            and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing())


def bucket_length(n: int, multiple: int) -> int:
    """The padded length of a bucket: n rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def shared_inputs(cos, sin, mask, length: int) -> SharedInputs:
    """The shared inputs of a graphed decoder layer's call: (cos, sin, mask) padded to `length`, then the number of
    real positions (an int64 0-dim tensor)."""
    mask_kind = None if mask is None else (tuple(mask.shape[:2]), mask.dtype)
    key = (length, tuple(cos.shape[:-2]), cos.shape[-1], cos.dtype, mask_kind)
    return SharedInputs(key, (cos, sin, mask), functools.partial(pad_shared, length))


def pad_shared(length: int, sources, n: int, out=None) -> list:
    """[cos, sin, mask, n] padded to `length` (see the module docstring), written into `out` or into new tensors."""
    cos, sin, mask = sources
    if out is None:
        out = [cos.new_zeros(*cos.shape[:-2], length, cos.shape[-1]),
               sin.new_zeros(*sin.shape[:-2], length, sin.shape[-1]),
               None if mask is None else mask.new_empty(*mask.shape[:2], length, length),
               torch.empty((), dtype=torch.int64, device=cos.device)]
    cos_p, sin_p, mask_p, valid = out
    for padded, table in ((cos_p, cos), (sin_p, sin)):
        padded[..., :n, :].copy_(table)
        padded[..., n:, :].zero_()
    if mask is not None:
        causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril_()
        if mask_p.dtype == torch.bool:
            mask_p.copy_(causal.expand_as(mask_p))
        else:  # additive: 0 where attended, the dtype's minimum elsewhere
            mask_p.copy_(torch.zeros(length, length, dtype=mask_p.dtype, device=mask.device).masked_fill_(
                ~causal, torch.finfo(mask_p.dtype).min).expand_as(mask_p))
        mask_p[..., :n, :n].copy_(mask)
    valid.fill_(n)
    return out


def zero_padded_rows(t: torch.Tensor, valid: torch.Tensor, length: int) -> None:
    """Zero the rows at positions >= valid of t [b*length, f] in place, outside autograd's view: used on tensors whose
    padded rows no gradient reads (their incoming gradients are zero), so the version counters of the tensors that
    autograd saved are left as they are."""
    rows = t.data.view(-1, length, t.shape[-1])
    padded = torch.arange(length, device=t.device) >= valid
    rows.masked_fill_(padded.view(1, length, 1), 0)
