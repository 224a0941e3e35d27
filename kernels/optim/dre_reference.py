"""PyTorch reference of COAT's FP8 group quantization with Dynamic Range Expansion, and of the fused AdamW step.

Per group X: M = max|X|, m = min of the nonzero |X|, R = M/m,
k = floor(E*log2(Q^2/2)/log2 R)/E clamped to [1/E, k_max] (k < 1 compresses groups wider than the format) (k = 1 when
log2 R <= 2^-19), center c = sqrt(M m),
scale s = (M/c)^k / Q, code = fp8(sign(x) |x/c|^k / s), x = sign(q) |q s|^(1/k) c. All-zero groups give zero codes.

Everything is evaluated in the log domain with portable_math's log2/exp2: per group the metadata is
(k, log2 c, log2 (M/c)^k) = (k, log2 c, log2(s Q)), fp32 [3, n_groups]; then
code = exp2(k log2|x| - (log2(sQ) - log2 Q + k log2 c)) and x = exp2((log2|q| + log2(sQ) - log2 Q) / k + log2 c).
This is the CPU path and the oracle of the Triton kernels (`dre_triton.py`), which evaluate the same fp32
operations in the same order (IEEE division and square root, fused multiply-adds only where `pm.fma` is written):
both give the same codes, on the GPU and under TRITON_INTERPRET. Per group it costs one division and two
logarithms, no square roots. Magnitudes below fp32's smallest normal (2^-126) count as zero.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from .. import portable_math as pm
from ..formats import FP8Format, get_format
from . import master_remainders
from .grouping import GroupLayout

LOG2_RATIO_EPS = 2.0 ** -19  # log2 R at or below this counts as constant magnitude: k = 1


def f32(x: float) -> float:
    """Round a Python float to the nearest fp32 value, so host scalars are identical in torch and Triton."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class DREConfig:
    fmt: FP8Format
    expand: bool = True
    expand_min: int = 16
    k_max: float = 16.0
    # Magnitudes >= 2^-126 never round to code 0 (at least the smallest subnormal code): for second moments, where
    # a zero next to a nonzero first moment would turn m / (sqrt(v) + eps) into m / eps.
    keep_nonzero: bool = False

    def __post_init__(self):
        object.__setattr__(self, "fmt", get_format(self.fmt))
        if self.expand_min < 1:
            raise ValueError(f"expand_min must be >= 1, got {self.expand_min}")
        if not self.k_max >= 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")

    @property
    def log2_max(self) -> float:
        return self.fmt.log2_max

    @property
    def inv_expand_min(self) -> float:
        return f32(1.0 / self.expand_min)

    @property
    def expand_numerator(self) -> float:
        """E * log2(Q^2 / 2), the numerator of k before the floor."""
        return f32(self.expand_min * math.log2(self.fmt.max ** 2 / 2))


META_ROWS = ("k", "log2_center", "log2_scale_q")  # rows of the fp32 [3, n_groups] metadata; scale_q = s * Q


def _full(like: torch.Tensor, value: float) -> torch.Tensor:
    """A tensor operand for divisions: torch divides by a Python scalar through its reciprocal on CUDA."""
    return torch.full_like(like, value)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (torch's CPU fp32 sqrt is not; the double one is, and rounds back exactly)."""
    return torch.sqrt(x.double()).float()


def group_params(big: torch.Tensor, small: torch.Tensor, cfg: DREConfig) -> torch.Tensor:
    """Metadata [3, n] (k, log2 c, log2(sQ)) of groups with max |x| `big` and min |x| >= 2^-126 `small` (inf if
    none)."""
    one = torch.ones_like(big)
    nonzero = big >= pm.MIN_NORMAL
    log2_big = pm.log2(torch.where(nonzero, big, one))
    log2_small = pm.log2(torch.where(nonzero, small, one))
    if cfg.expand:
        log2_ratio = log2_big - log2_small
        k = torch.floor(_full(big, cfg.expand_numerator) / log2_ratio) * cfg.inv_expand_min
        k = torch.where(log2_ratio <= LOG2_RATIO_EPS, one, k.clamp(cfg.inv_expand_min, f32(cfg.k_max)))
        log2_center = (log2_big + log2_small) * 0.5
    else:
        k, log2_center = one, torch.zeros_like(big)
    return torch.stack([k, log2_center, k * (log2_big - log2_center)])


def encode(x: torch.Tensor, meta: torch.Tensor, cfg: DREConfig) -> torch.Tensor:
    """FP8 codes of x [n, G] with its groups' metadata [3, n]."""
    k, log2_center, log2_scale_q = (r[:, None] for r in meta)
    offset = log2_scale_q - cfg.log2_max + k * log2_center
    y = pm.exp2(pm.fma(k, pm.log2(x.abs(), coarse=True), -offset), coarse=True)
    if cfg.keep_nonzero:
        y = torch.where(x.abs() >= pm.MIN_NORMAL, y.clamp(min=cfg.fmt.min_subnormal), y)
    return cfg.fmt.quantize(torch.where(x < 0, 0.0 - y, y))  # 0 - y, as Triton negates: a zero stays +0


def decode(codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """fp32 values of FP8 codes [n, G] with their groups' metadata [3, n]."""
    fmt = get_format(codes.dtype)
    k, log2_center, log2_scale_q = meta
    inv_k = torch.ones_like(k) / k
    bias = (log2_scale_q - fmt.log2_max) * inv_k + log2_center
    raw = codes.view(torch.uint8).long()
    xa = pm.exp2(pm.fma(fmt.log2_table(codes.device)[raw], inv_k[:, None], bias[:, None]))
    return torch.where(raw >= 128, 0.0 - xa, xa)  # 0 - xa, as Triton negates


def _quantize_rows(x: torch.Tensor, mask: torch.Tensor, cfg: DREConfig):
    """x fp32 [n, G] (masked positions ignored) -> codes fp8 [n, G], meta fp32 [3, n]."""
    ax = x.abs().masked_fill(~mask, 0.0)
    meta = group_params(ax.amax(dim=1), torch.where(ax >= pm.MIN_NORMAL, ax, torch.inf).amin(dim=1), cfg)
    return encode(x, meta, cfg), meta


def _group_index(layout: GroupLayout, device):
    starts, lengths = layout.group_bounds(device)
    cols = torch.arange(layout.group_size, device=device)
    mask = cols[None, :] < lengths[:, None]
    index = (starts[:, None] + cols[None, :]).clamp(max=max(layout.numel - 1, 0))
    return index, mask


def _take(codes: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """codes[index] for FP8 tensors (CPU indexing kernels lack FP8)."""
    return codes.view(torch.uint8)[index].view(codes.dtype)


def quantize(x: torch.Tensor, layout: GroupLayout, cfg: DREConfig):
    """Flat fp32 x -> (codes fp8 [numel], meta fp32 [3, n_groups]); elements outside groups get code 0."""
    index, mask = _group_index(layout, x.device)
    codes2d, meta = _quantize_rows(x.reshape(-1).float()[index], mask, cfg)
    codes = torch.zeros(layout.numel, dtype=cfg.fmt.dtype, device=x.device)
    codes.view(torch.uint8)[index[mask]] = codes2d.view(torch.uint8)[mask]
    return codes, meta


def dequantize(codes: torch.Tensor, meta: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    index, mask = _group_index(layout, codes.device)
    out = torch.zeros(layout.numel, dtype=torch.float32, device=codes.device)
    out[index[mask]] = decode(_take(codes, index), meta)[mask]
    return out


@dataclass(frozen=True)
class AdamWScalars:
    """Per-tensor fp32 constants of one AdamW step (torch.optim.AdamW's formulas, t counted from 1)."""
    decay: float  # 1 - lr * weight_decay
    step_size: float  # lr / (1 - beta1^t)
    inv_bias_correction2_sqrt: float  # 1 / sqrt(1 - beta2^t)
    eps: float
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float

    @classmethod
    def make(cls, lr, beta1, beta2, eps, weight_decay, step):
        return cls(*(f32(v) for v in (1 - lr * weight_decay, lr / (1 - beta1 ** step),
                                      1 / math.sqrt(1 - beta2 ** step), eps, beta1, 1 - beta1, beta2, 1 - beta2)))


def adamw_update(p, g, m, v, h: AdamWScalars):
    """One AdamW step on fp32 tensors (any shape). Returns (new p, new m, new v); the same op order as the kernel."""
    m = pm.fma(m, h.beta1, g * h.one_minus_beta1)
    v = pm.fma(v, h.beta2, (g * g) * h.one_minus_beta2)
    denom = pm.fma(_sqrt(v), h.inv_bias_correction2_sqrt, h.eps)
    p = pm.fma(-h.step_size, m / denom, p * h.decay)
    return p, m, v


def fused_adamw_step(param, grad, m_codes, m_meta, v_codes, v_meta, layout: GroupLayout, h: AdamWScalars,
                     m_cfg: DREConfig, v_cfg: DREConfig, skip_nonfinite: bool = True,
                     remainder: torch.Tensor | None = None) -> torch.Tensor:
    """In place: dequantize moments, AdamW, re-quantize; only elements inside groups change.

    remainder: for a bf16 param, its master remainder (int16, numel elements): the step then reads and writes the
    fp32 master (param, remainder) of coat_kernels.optim.master_remainders.

    Groups whose new second moment is not finite (a NaN/Inf gradient, or one whose square overflows fp32) keep
    their parameters, codes and metadata when skip_nonfinite. Returns the number of skipped groups (0-dim int64
    tensor, on param's device).
    """
    index, mask = _group_index(layout, param.device)
    p_flat, g_flat = param.view(-1), grad.reshape(-1)
    r_flat = None if remainder is None else remainder.view(-1)
    p = p_flat[index].float() if r_flat is None else master_remainders.join(p_flat[index], r_flat[index])
    g = g_flat[index].float().masked_fill(~mask, 0.0)
    m = decode(_take(m_codes, index), m_meta)
    v = decode(_take(v_codes, index), v_meta)
    p, m, v = adamw_update(p, g, m, v, h)
    mq, new_m_meta = _quantize_rows(m, mask, m_cfg)
    vq, new_v_meta = _quantize_rows(v, mask, v_cfg)
    bad = (~torch.isfinite(v) & mask).any(dim=1) if skip_nonfinite else torch.zeros(len(g), dtype=torch.bool,
                                                                                   device=g.device)
    write = mask & ~bad[:, None]
    idx = index[write]
    if r_flat is None:
        p_flat[idx] = p[write].to(p_flat.dtype)
    else:
        p_flat[idx], r_flat[idx] = master_remainders.split(p[write])
    m_codes.view(torch.uint8)[idx] = mq.view(torch.uint8)[write]
    v_codes.view(torch.uint8)[idx] = vq.view(torch.uint8)[write]
    keep = bad[None, :]
    m_meta.copy_(torch.where(keep, m_meta, new_m_meta))
    v_meta.copy_(torch.where(keep, v_meta, new_v_meta))
    return bad.sum()
