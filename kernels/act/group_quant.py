"""1x16 group quantization: what non-linear layers consume and save.

One scale per 16 consecutive elements of the last dim, computed in fp32 as amax / FP8_MAX, rounded to the nearest
bf16 value (ties to even) and stored as bf16; where that rounds down, the group's largest element saturates to
FP8_MAX (an error below bf16's half step, smaller than rounding the scale up: benchmarks/bench_act_scale_dtype.py).
A group holding Inf/NaN gets a NaN scale and dequantizes to NaN (only that group). Each op has a torch reference (the
CPU path and the test oracle) and a Triton kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import E5M2, get_format
from .tiles import GROUP, cdiv, check_group_dim, group_tile, load_group_tile, quantize_group_tile, tile_amax

SCALE_DTYPE = torch.bfloat16  # storage of the 1x16 group scales


@triton.jit
def _group_quantize_kernel(x_ptr, codes_ptr, scales_ptr, partial_ptr, M, K, FP8_MAX: tl.constexpr,
                           E5M2_OUT: tl.constexpr, WRITE_PARTIAL: tl.constexpr, BM: tl.constexpr, G: tl.constexpr):
    pid = tl.program_id(0)  # flat grid, column blocks fastest: neighbouring programs read neighbouring bytes
    n_g = tl.cdiv(K // 16, G)
    rows = ((pid // n_g) * BM + tl.arange(0, BM)).to(tl.int64)
    offs, scale_offs, mask = group_tile(rows, (pid % n_g) * G, M, K, K // 16, G)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    codes, scales, _ = quantize_group_tile(x, FP8_MAX, E5M2_OUT)
    tl.store(codes_ptr + offs, codes, mask=mask)
    tl.store(scales_ptr + scale_offs, scales.to(tl.bfloat16), mask=mask)
    if WRITE_PARTIAL:
        tl.store(partial_ptr + pid, tile_amax(x, mask))


@triton.jit
def _group_dequantize_kernel(codes_ptr, scales_ptr, y_ptr, M, K, BM: tl.constexpr, G: tl.constexpr):
    pid = tl.program_id(0)
    n_g = tl.cdiv(K // 16, G)
    rows = ((pid // n_g) * BM + tl.arange(0, BM)).to(tl.int64)
    offs, scale_offs, mask = group_tile(rows, (pid % n_g) * G, M, K, K // 16, G)
    y = load_group_tile(codes_ptr, scales_ptr, offs, scale_offs, mask)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------- torch references
def encode_group_scale_reference(amax: torch.Tensor, nonfinite: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """bf16 scales nearest to amax / fp8_max (ties to even, at least the smallest normal fp32); 1 for all-zero
    groups; NaN for groups holding Inf/NaN."""
    scale = (amax.float() / fp8_max).clamp(min=torch.finfo(torch.float32).tiny).to(SCALE_DTYPE).float()
    scale = torch.where(amax == 0, 1.0, scale)
    return torch.where(nonfinite, float("nan"), scale).to(SCALE_DTYPE)


def group_quantize_reference(x, fmt="e4m3"):
    """x [..., K] -> (codes [..., K], bf16 scales [..., K/16])."""
    fmt = get_format(fmt)
    k = x.shape[-1]
    check_group_dim(k)
    x3 = x.float().reshape(*x.shape[:-1], k // GROUP, GROUP)
    amax = x3.abs().amax(-1)  # Inf or NaN (amax propagates NaN) exactly where the group holds Inf/NaN
    nonfinite = ~torch.isfinite(amax)
    amax = amax.nan_to_num(0.0, 0.0, 0.0)  # those groups' scales are NaN whatever their amax
    scales = encode_group_scale_reference(amax, nonfinite, fmt.max)
    codes = fmt.quantize(x3 / scales.float()[..., None])
    return codes.reshape(x.shape), scales


def group_dequantize_reference(codes, scales, dtype=torch.bfloat16):
    k = codes.shape[-1]
    c3 = get_format(codes.dtype).decode(codes).reshape(*codes.shape[:-1], k // GROUP, GROUP)
    return (c3 * scales.float()[..., None]).reshape(codes.shape).to(dtype)


def amax_partials_reference(x) -> torch.Tensor:
    """The partials of a tensor as one block: fp32 [1], NaN if x holds Inf/NaN."""
    xf = x.float()
    amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)  # Inf/NaN when x holds one
    return torch.where(torch.isfinite(amax), amax, torch.full_like(amax, float("nan"))).reshape(1)


# ------------------------------------------------------------------------------------------------ public ops
# One 1x16 group per thread (BM * G = 32 * WARPS) keeps every thread's loads in flight at once (with two groups per
# thread ptxas issued the second group's loads only after the first group's math).
BM, G, WARPS = 4, 32, 4


def _grid(m, k):
    return (cdiv(m, BM) * cdiv(k // GROUP, G),)


def group_quantize(x, fmt, use_triton: bool, *, partial_amax=False):
    """x [..., K] -> (codes [..., K], bf16 scales [..., K/16][, fp32 partial amaxes of x])."""
    fmt = get_format(fmt)
    if not use_triton:
        codes, scales = group_quantize_reference(x, fmt)
        return (codes, scales, amax_partials_reference(x)) if partial_amax else (codes, scales)
    k = x.shape[-1]
    check_group_dim(k)
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    codes = torch.empty(x2.shape, dtype=fmt.dtype, device=x.device)
    scales = torch.empty(m, k // GROUP, dtype=SCALE_DTYPE, device=x.device)
    grid = _grid(m, k)
    partials = (torch.empty if m else torch.zeros)(max(grid[0], 1), dtype=torch.float32, device=x.device)
    if m:
        _group_quantize_kernel[grid](x2, codes, scales, partials, m, k, FP8_MAX=fmt.max, E5M2_OUT=fmt is E5M2,
                                     WRITE_PARTIAL=partial_amax, BM=BM, G=G, num_warps=WARPS)
    codes, scales = codes.reshape(x.shape), scales.reshape(*x.shape[:-1], k // GROUP)
    return (codes, scales, partials) if partial_amax else (codes, scales)


def group_dequantize(codes, scales, use_triton: bool, dtype=torch.bfloat16):
    if not use_triton:
        return group_dequantize_reference(codes, scales, dtype)
    k = codes.shape[-1]
    c2 = codes.reshape(-1, k)
    y = torch.empty(c2.shape, dtype=dtype, device=codes.device)
    if c2.shape[0]:
        _group_dequantize_kernel[_grid(c2.shape[0], k)](c2, scales.reshape(-1, k // GROUP), y, c2.shape[0], k,
                                                        BM=BM, G=G, num_warps=WARPS)
    return y.reshape(codes.shape)
