"""How each optimizer of launch/optimizer_arms.py stores AdamW's moments, as a round trip fp32 -> stored -> fp32 of
one tensor's (exp_avg, exp_avg_sq), and the error that storage puts into the update direction
m_hat / (sqrt(v_hat) + eps) (bias-corrected, as the step uses it) against the fp32 moments.

  coat / coat_noexp  CoatFP8AdamW's quantizers (coat_kernels.optim: E4M3 codes, groups of 128 along the flat tensor,
                     with / without Dynamic Range Expansion; a nonzero second moment never rounds to 0)
  torchao_fp8        torchao.optim's OptimStateFp8: blocks of 256, scale = absmax / 448, codes = E4M3(x / scale);
                     tensors under 4,096 elements or not a multiple of 256 stay fp32 (AdamWFp8's rule)
  flashoptim         FlashOptim 0.1.4's state: groups of 32 (the last one short), each divided by its fp32 absmax;
                     exp_avg through softsign 2x / (1 + |x|) into int8 (x 127), exp_avg_sq as sqrt(v) into uint8
                     (x 255), rounding floor(y + 0.5); the absmax kept in fp16 (what dequantization multiplies by)
  bf16               bf16 moments, rounded to nearest even
Used by launch/optimizer_parity.py on the fp32 arm's real moments during training (`--moment-error-every`) and by
benchmarks/moment_quantization_error.py on synthetic ones.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from coat_kernels.optim import OptimizerConfig
from coat_kernels.optim import dre_reference
from coat_kernels.optim.grouping import build_layout
from coat_kernels.optim.state import quantize_moment

COAT_GROUP = OptimizerConfig().group_size
TORCHAO_BLOCK, TORCHAO_MIN_NUMEL = 256, 4096
FLASHOPTIM_GROUP = 32


def _coat(expand: bool) -> Callable:
    m_cfg, v_cfg = OptimizerConfig(expand_exp_avg=expand, expand_exp_avg_sq=expand).moment_configs()

    def roundtrip(m, v):
        layout = build_layout(None, m.numel(), COAT_GROUP)
        use_kernel = m.is_cuda
        out = []
        for x, cfg in ((m, m_cfg), (v, v_cfg)):
            codes, meta = quantize_moment(x, layout, cfg, use_kernel)
            out.append(dre_reference.dequantize(codes, meta, layout).view_as(x))
        return tuple(out)
    return roundtrip


def _torchao_fp8_one(x):
    if x.numel() < TORCHAO_MIN_NUMEL or x.numel() % TORCHAO_BLOCK:
        return x.float()
    blocks = x.float().reshape(-1, TORCHAO_BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True).clip(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return ((blocks / scale).to(torch.float8_e4m3fn).float() * scale).view_as(x)


def torchao_fp8(m, v):
    return _torchao_fp8_one(m), _torchao_fp8_one(v)


def _groups(x, size):
    flat = x.float().reshape(-1)
    return torch.nn.functional.pad(flat, (0, -flat.numel() % size)).view(-1, size)


def flashoptim(m, v):
    groups = _groups(m, FLASHOPTIM_GROUP)
    absmax = groups.abs().amax(1, keepdim=True).clamp(min=1e-12)
    normalized = groups / absmax
    codes = torch.floor(2 * normalized / (1 + normalized.abs()) * 127 + 0.5)  # int8 codes
    y = codes / 127
    m_hat = (y / (2 - y.abs())) * absmax.half().float()
    roots = _groups(v, FLASHOPTIM_GROUP).sqrt()
    absmax = roots.amax(1, keepdim=True).clamp(min=1e-12)
    codes = torch.floor(roots / absmax * 255 + 0.5)  # uint8 codes
    v_hat = (codes / 255 * absmax.half().float()) ** 2
    return (m_hat.reshape(-1)[:m.numel()].view_as(m), v_hat.reshape(-1)[:v.numel()].view_as(v))


def bf16(m, v):
    return m.bfloat16().float(), v.bfloat16().float()


SCHEMES = {"coat": _coat(True), "coat_noexp": _coat(False), "torchao_fp8": torchao_fp8, "flashoptim": flashoptim,
           "bf16": bf16}


def update_direction(m, v, step: int, betas: tuple[float, float], eps: float):
    """AdamW's m_hat / (sqrt(v_hat) + eps) at step t (t from 1), in fp32."""
    return (m / (1 - betas[0] ** step)) / ((v / (1 - betas[1] ** step)).sqrt() + eps)


def relative_errors(moments: Iterable[tuple[torch.Tensor, torch.Tensor]], step: int, betas, eps,
                    schemes=tuple(SCHEMES), far: float = 0.1) -> dict:
    """Over all tensors together, u the update direction of the fp32 moments and u_s that of the moments after
    scheme s's round trip: {"relative_l2": {s: ||u_s - u|| / ||u||}, "share_far": {s: the share of elements with
    |u_s - u| > far |u|}}. The norm is dominated by the elements a scheme damages most (a second moment flushed to
    zero under a nonzero first moment gives m / eps), the share counts how many it damages."""
    squared_error = dict.fromkeys(schemes, 0.0)
    far_count = dict.fromkeys(schemes, 0)
    squared_norm, numel = 0.0, 0
    for m, v in moments:
        m, v = m.detach().float(), v.detach().float()
        exact = update_direction(m, v, step, betas, eps)
        squared_norm += exact.square().sum().item()
        numel += exact.numel()
        for name in schemes:
            error = update_direction(*SCHEMES[name](m, v), step, betas, eps) - exact
            squared_error[name] += error.square().sum().item()
            far_count[name] += int((error.abs() > far * exact.abs()).sum())
    return dict(relative_l2={s: (e / squared_norm) ** 0.5 if squared_norm > 0 else 0.0
                             for s, e in squared_error.items()},
                share_far={s: c / max(numel, 1) for s, c in far_count.items()})
