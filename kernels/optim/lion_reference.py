"""PyTorch reference of the fused COAT Lion step: the FP8 momentum dequantized, Lion, re-quantized with Dynamic Range
Expansion (coat_kernels.optim.dre_reference's quantizer).

Lion (Chen et al., 2023), decoupled weight decay: c = beta1 m + (1 - beta1) g, p = p (1 - lr wd) - lr sign(c),
m = beta2 m + (1 - beta2) g. The fp32 operations and their order are those of the C++ step (cpu_lion.cpp) and the
Triton kernel (lion_triton.py), which give the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import portable_math as pm
from .dre_reference import DREConfig, _group_index, _quantize_rows, _take, decode, f32
from .grouping import GroupLayout


@dataclass(frozen=True)
class LionScalars:
    """Per-tensor fp32 constants of one Lion step."""
    decay: float  # 1 - lr * weight_decay
    lr: float
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float

    @classmethod
    def make(cls, lr, beta1, beta2, weight_decay):
        return cls(*(f32(v) for v in (1 - lr * weight_decay, lr, beta1, 1 - beta1, beta2, 1 - beta2)))


def sign(x: torch.Tensor) -> torch.Tensor:
    """+1, -1 or +0 (a zero of either sign gives +0)."""
    return torch.where(x > 0, 1.0, torch.where(x < 0, -1.0, 0.0)).to(torch.float32)


def lion_update(p, g, m, h: LionScalars):
    """One Lion step on fp32 tensors (any shape). Returns (new p, new m); the kernels' operation order."""
    direction = sign(pm.fma(m, h.beta1, g * h.one_minus_beta1))
    p = pm.fma(-h.lr, direction, p * h.decay)
    m = pm.fma(m, h.beta2, g * h.one_minus_beta2)
    return p, m


def fused_lion_step(param, grad, codes, meta, layout: GroupLayout, h: LionScalars, cfg: DREConfig) -> torch.Tensor:
    """In place: dequantize the momentum, Lion, re-quantize; only elements inside groups change. Groups whose new
    momentum is not finite (a NaN/Inf gradient) keep their parameters, codes and metadata. Returns the number of
    skipped groups (0-dim int64 tensor, on param's device)."""
    index, mask = _group_index(layout, param.device)
    p_flat, g_flat = param.view(-1), grad.reshape(-1)
    p = p_flat[index].float()
    g = g_flat[index].float().masked_fill(~mask, 0.0)
    m = decode(_take(codes, index), meta)
    p, m = lion_update(p, g, m, h)
    mq, new_meta = _quantize_rows(m, mask, cfg)
    bad = (~torch.isfinite(m) & mask).any(dim=1)
    write = mask & ~bad[:, None]
    idx = index[write]
    p_flat[idx] = p[write].to(p_flat.dtype)
    codes.view(torch.uint8)[idx] = mq.view(torch.uint8)[write]
    meta.copy_(torch.where(bad[None, :], meta, new_meta))
    return bad.sum()
