"""Gated GLU on FP8 inputs: x [M, 2F] = [gate | up] (Megatron's `chunk(2, -1)`), y = act(gate) * up, with act one of
`ACTIVATIONS`: `silu` (SwiGLU) or `gelu_tanh` (GeGLU: GELU in its tanh approximation, Hugging Face's
`gelu_pytorch_tanh`). Every kernel takes the activation as a compile-time constant; each has a torch reference.

`swiglu_forward` quantizes gate and up to E4M3 1x16 groups (the only thing saved for backward), computes the
product from the DEQUANTIZED values and writes one partial amax of it per program (stage 1), optionally the BF16
product too. `swiglu_cast` recomputes the product from the FP8 copy and casts it per-tensor (the next GEMM's
input, row-major in forward; transposed in backward for the weight gradient, with the forward's scale), so the
product is never saved ("beyond COAT": recompute the cheap non-linears). `swiglu_backward` reads the FP8 copy and
dy and writes d[gate | up] in BF16 with its partial amax, or casts it straight to per-tensor E5M2 (and transpose).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import E4M3, E5M2
from ..triton_fp8 import nanmax
from .group_quant import SCALE_DTYPE, amax_partials_reference, group_dequantize_reference, group_quantize_reference
from .scaling import ScaleTickets, StageOneAmax, stage_two_args, store_partial
from .tensor_quant import cast_reference
from .tiles import (GROUP, cdiv, group_tile, load_group_tile, pad16, quantize_group_tile, store_cast_groups,
                    tile_amax_of_zero_masked)


@triton.jit
def _pair_tile(pid, M, F, BM: tl.constexpr, G: tl.constexpr):
    """Rows and gate-half 3-D tile of program pid (flat grid, group blocks fastest) of x [M, 2F]; G divides F/16,
    so a tile never crosses from gate into up. The up tile is at offs + F, eoffs + F // 16."""
    n_g = (F // 16) // G
    g0 = (pid % n_g) * G
    rows = ((pid // n_g) * BM + tl.arange(0, BM)).to(tl.int64)
    offs, eoffs, mask = group_tile(rows, g0, M, 2 * F, F // 16, G)
    return rows, g0, offs, eoffs, mask


@triton.jit
def _f_offsets(rows, g0, F, G: tl.constexpr):
    """Offsets [G, BM, 16] of the same groups in an [M, F] tensor (dy, the product)."""
    return (g0 + tl.arange(0, G))[:, None, None] * 16 + rows[None, :, None] * F + tl.arange(0, 16)[None, None, :]


ACTIVATIONS = ("silu", "gelu_tanh")
GELU_C, GELU_K = 0.7978845608028654, 0.044715  # gelu_tanh(g) = g/2 (1 + tanh(GELU_C (g + GELU_K g^3)))


@triton.jit
def _sigmoid(g):
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _tanh(z):
    return 1.0 - 2.0 / (1.0 + tl.exp(2.0 * z))  # +-1 at the extremes (exp -> inf or 0), never NaN


@triton.jit
def _gate(g, ACT: tl.constexpr):
    """act(g)."""
    if ACT == "gelu_tanh":
        a = 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    else:
        a = g * _sigmoid(g)
    return a


@triton.jit
def _gate_and_grad(g, ACT: tl.constexpr):
    """(act(g), act'(g))."""
    if ACT == "gelu_tanh":
        t = _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
    else:
        s = _sigmoid(g)
        a = g * s
        da = s + a * (1.0 - s)
    return a, da


@triton.jit
def _swiglu_fwd_kernel(x_ptr, q_ptr, e_ptr, out_ptr, partial_ptr, M, F, WRITE_OUT: tl.constexpr,
                       BM: tl.constexpr, G: tl.constexpr, ticket_ptr, scale_ptr, NP,
                       FP8_MAX: tl.constexpr, FINAL: tl.constexpr, ACT: tl.constexpr):
    pid = tl.program_id(0)
    rows, g0, offs, eoffs, mask = _pair_tile(pid, M, F, BM, G)
    g = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + offs + F, mask=mask, other=0.0).to(tl.float32)
    gq, ge, gd = quantize_group_tile(g, 448.0, False)
    uq, ue, ud = quantize_group_tile(u, 448.0, False)
    tl.store(q_ptr + offs, gq, mask=mask)
    tl.store(q_ptr + offs + F, uq, mask=mask)
    tl.store(e_ptr + eoffs, ge.to(tl.bfloat16), mask=mask)
    tl.store(e_ptr + eoffs + F // 16, ue.to(tl.bfloat16), mask=mask)
    p = _gate(gd, ACT) * ud
    store_partial(partial_ptr, pid, tile_amax_of_zero_masked(p), NP, ticket_ptr, scale_ptr, FP8_MAX, FINAL)  # masked: 0
    if WRITE_OUT:
        tl.store(out_ptr + _f_offsets(rows, g0, F, G), p.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_cast_kernel(q_ptr, e_ptr, scale_ptr, out_ptr, out_t_ptr, M, F, M_PAD, WRITE_ROW: tl.constexpr,
                        WRITE_T: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, ACT: tl.constexpr):
    pid = tl.program_id(0)
    rows, g0, offs, eoffs, mask = _pair_tile(pid, M, F, BM, G)
    gd = load_group_tile(q_ptr, e_ptr, offs, eoffs, mask)
    ud = load_group_tile(q_ptr, e_ptr, offs + F, eoffs + F // 16, mask)
    p = _gate(gd, ACT) * ud  # masked lanes: 0
    store_cast_groups(p, rows, g0, tl.load(scale_ptr), out_ptr, out_t_ptr, M, F, M_PAD, G, WRITE_ROW, WRITE_T,
                      False, True)


@triton.jit
def _swiglu_bwd_kernel(q_ptr, e_ptr, dy_ptr, dx_ptr, partial_ptr, scale_ptr, out_ptr, out_t_ptr, M, F, M_PAD,
                       CAST: tl.constexpr, WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr,
                       BM: tl.constexpr, G: tl.constexpr, ticket_ptr=None, scale_out_ptr=None,
                       NP=1, FP8_MAX: tl.constexpr = 1.0, FINAL: tl.constexpr = False, p_scale_ptr=None,
                       p_t_ptr=None, PRODUCT_T: tl.constexpr = False, ACT: tl.constexpr = "silu"):
    """CAST: d[gate | up] cast to E5M2 with scale_ptr's scale; else BF16 d[gate | up] (WRITE_ROW) and its partial
    amaxes, and with PRODUCT_T the product's transposed E4M3 copy (p_scale_ptr's scale: fc2's wgrad operand) from the
    same loads."""
    pid = tl.program_id(0)
    rows, g0, offs, eoffs, mask = _pair_tile(pid, M, F, BM, G)
    gd = load_group_tile(q_ptr, e_ptr, offs, eoffs, mask)
    ud = load_group_tile(q_ptr, e_ptr, offs + F, eoffs + F // 16, mask)
    dy = tl.load(dy_ptr + _f_offsets(rows, g0, F, G), mask=mask, other=0.0).to(tl.float32)
    a, da = _gate_and_grad(gd, ACT)
    dg32 = dy * ud * da  # masked lanes: 0 (gate = up = dy = 0)
    du32 = dy * a
    dg = dg32.to(tl.bfloat16)
    du = du32.to(tl.bfloat16)
    if CAST:
        scale = tl.load(scale_ptr)
        store_cast_groups(dg.to(tl.float32), rows, g0, scale, out_ptr, out_t_ptr, M, 2 * F, M_PAD, G,
                          WRITE_ROW, WRITE_T, True, True)
        store_cast_groups(du.to(tl.float32), rows, g0 + F // 16, scale, out_ptr, out_t_ptr, M, 2 * F, M_PAD, G,
                          WRITE_ROW, WRITE_T, True, True)
    else:
        if WRITE_ROW:  # BF16 d[gate | up] (WRITE_ROW=False: partial amaxes only)
            tl.store(dx_ptr + offs, dg.to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dx_ptr + offs + F, du.to(dx_ptr.dtype.element_ty), mask=mask)
        # amax of the BF16 values = the BF16 rounding of the fp32 amax (rounding is monotonic): no round trip
        amax = nanmax(tile_amax_of_zero_masked(dg32), tile_amax_of_zero_masked(du32)).to(tl.bfloat16).to(tl.float32)
        store_partial(partial_ptr, pid, amax, NP, ticket_ptr, scale_out_ptr, FP8_MAX, FINAL)
        if PRODUCT_T:
            store_cast_groups(a * ud, rows, g0, tl.load(p_scale_ptr), None, p_t_ptr, M, F, M_PAD, G, False, True,
                              False, True)


# ------------------------------------------------------------------------------------------- torch references
def _split_deq(q, e):
    xd = group_dequantize_reference(q, e, torch.float32)
    return xd.chunk(2, -1)


def _sigmoid_reference(g):
    return 1.0 / (1.0 + torch.exp(-g))


def _tanh_reference(z):
    return 1.0 - 2.0 / (1.0 + torch.exp(2.0 * z))


def _gate_reference(g, activation):
    """(act(g), act'(g)) in the kernels' arithmetic."""
    if activation == "gelu_tanh":
        t = _tanh_reference(GELU_C * (g + GELU_K * g * g * g))
        return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_K * g * g)
    s = _sigmoid_reference(g)
    a = g * s
    return a, s + a * (1.0 - s)


def swiglu_product_reference(q, e, activation="silu"):
    gd, ud = _split_deq(q, e)
    return _gate_reference(gd, activation)[0] * ud


def swiglu_grad_reference(q, e, dy, activation="silu"):
    """BF16 d[gate | up] from the FP8 copy of x and dy."""
    gd, ud = _split_deq(q, e)
    a, da = _gate_reference(gd, activation)
    dy = dy.float()
    return torch.cat([(dy * ud * da).bfloat16(), (dy * a).bfloat16()], -1)


# ------------------------------------------------------------------------------------------------ public ops
# (rows, groups, warps) per program, one 1x16 group of gate and of up per thread; transposed outputs take taller
# tiles (each program then writes 32-byte runs of every transposed row). From tile sweeps (RESULTS_activations.md).
FWD_TILE, BWD_TILE, ROW_TILE, T_TILE, BWD_CAST_TILE = (8, 16, 4), (8, 32, 8), (4, 32, 4), (32, 8, 8), (32, 8, 8)
BWD_AMAX_T_TILE = (32, 8, 8)  # the amax pass that also writes the product's transposed copy


def _tiles(f, tile):
    """(BM, G, warps): G is cut to a power of two dividing F/16 (tiles never straddle gate and up)."""
    bm, g, w = tile
    while (f // 16) % g:
        g //= 2
    return bm * tile[1] // g, g, w


def _grid(m, f, bm, g):
    return (cdiv(m, bm) * ((f // 16) // g),)


def _cast_outputs(q, width, fmt, write_row, write_t, t_tile):
    """Outputs and launch shape of a per-tensor cast of a [M, width] result recomputed from q [M, 2F]:
    (m, f, m padded to 16, out [M, width] | None, out_t [width, M16] | None, (BM, G, warps), grid)."""
    m, f = q.shape[0], q.shape[1] // 2
    mp = pad16(m)
    out = torch.empty(m, width, dtype=fmt.dtype, device=q.device) if write_row else None
    out_t = torch.empty(width, mp, dtype=fmt.dtype, device=q.device) if write_t else None
    tiles = _tiles(f, t_tile if write_t else ROW_TILE)
    return m, f, mp, out, out_t, tiles, _grid(mp if write_t else m, f, tiles[0], tiles[1])


def _check(x):
    if x.shape[-1] % 32:
        raise ValueError(f"SwiGLU input [..., 2F] needs F to be a multiple of 16, got 2F={x.shape[-1]}")


def check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated-GLU activation must be one of {ACTIVATIONS}, got {activation!r}")


def swiglu_forward(x2d, use_triton: bool, *, activation="silu", write_out=False,
                   tickets: ScaleTickets | None = None):
    """x [M, 2F] -> (codes fp8 [M, 2F], scales bf16 [M, 2F/16], StageOneAmax of the product with its E4M3 scale,
    y [M, F] | None)."""
    _check(x2d)
    check_activation(activation)
    if not use_triton:
        q, e = group_quantize_reference(x2d, E4M3)
        p = swiglu_product_reference(q, e, activation)
        return q, e, StageOneAmax(amax_partials_reference(p)), (p.to(x2d.dtype) if write_out else None)
    m, f2 = x2d.shape
    f = f2 // 2
    x2d = x2d.contiguous()
    q = torch.empty(m, f2, dtype=E4M3.dtype, device=x2d.device)
    e = torch.empty(m, f2 // GROUP, dtype=SCALE_DTYPE, device=x2d.device)
    out = torch.empty(m, f, dtype=x2d.dtype, device=x2d.device) if write_out else None
    bm, g, w = _tiles(f, FWD_TILE)
    grid = _grid(m, f, bm, g)
    partials = (torch.empty if m else torch.zeros)(max(grid[0], 1), dtype=torch.float32, device=x2d.device)
    kwargs, amax = stage_two_args(partials, E4M3 if m else None, tickets)
    if m:
        _swiglu_fwd_kernel[grid](x2d, q, e, out, partials, m, f, WRITE_OUT=write_out, BM=bm, G=g, num_warps=w,
                                 ACT=activation, **kwargs)
    return q, e, amax, out


def swiglu_cast(q, e, scale, use_triton: bool, *, activation="silu", write_row=True, write_t=False):
    """Per-tensor E4M3 of act(gate) * up recomputed from the FP8 copy: (p8 [M, F] | None, p8_t [F, M16] | None)."""
    check_activation(activation)
    if not use_triton:
        return cast_reference(swiglu_product_reference(q, e, activation), scale, E4M3, write_row, write_t)
    if write_row and write_t:  # one launch writing both gave wrong codes on the H100 (Triton 3.6): two launches
        return (swiglu_cast(q, e, scale, True, activation=activation)[0],
                swiglu_cast(q, e, scale, True, activation=activation, write_row=False, write_t=True)[1])
    m, f, mp, out, out_t, (bm, g, w), grid = _cast_outputs(q, q.shape[1] // 2, E4M3, write_row, write_t, T_TILE)
    if grid[0]:
        _swiglu_cast_kernel[grid](q, e, scale, out, out_t, m, f, mp, WRITE_ROW=write_row, WRITE_T=write_t,
                                  BM=bm, G=g, num_warps=w, ACT=activation)
    return out, out_t


def _backward_partials(q, e, dy, dx, activation, tickets, product_scale=None):
    """Launch the backward kernel in its BF16 mode: d[gate | up] into dx (None: not written) and its partial
    amaxes (with the E5M2 scale reduced in the same launch); with product_scale, also the product's transposed E4M3
    copy. -> (StageOneAmax, p8_t | None)."""
    m, f2 = q.shape
    f = f2 // 2
    mp = pad16(m)
    with_t = product_scale is not None
    bm, g, w = _tiles(f, BWD_AMAX_T_TILE if with_t else BWD_TILE)
    grid = _grid(mp if with_t else m, f, bm, g)
    partials = (torch.empty if m else torch.zeros)(max(grid[0], 1), dtype=torch.float32, device=q.device)
    p_t = torch.empty(f, mp, dtype=E4M3.dtype, device=q.device) if with_t else None
    kwargs, amax = stage_two_args(partials, E5M2 if m else None, tickets)
    kwargs["scale_out_ptr"] = kwargs.pop("scale_ptr")  # the kernel's scale_ptr is the cast's input scale
    if m:
        _swiglu_bwd_kernel[grid](q, e, dy.contiguous(), dx, partials, None, None, None, m, f, mp, CAST=False,
                                 WRITE_ROW=dx is not None, WRITE_T=False, BM=bm, G=g, num_warps=w,
                                 p_scale_ptr=product_scale, p_t_ptr=p_t, PRODUCT_T=with_t, ACT=activation, **kwargs)
    elif with_t:
        p_t.zero_()
    return amax, p_t


def swiglu_backward(q, e, dy, use_triton: bool, *, activation="silu", tickets: ScaleTickets | None = None):
    """-> (dx bf16 [M, 2F], StageOneAmax of dx with its E5M2 scale)."""
    check_activation(activation)
    if not use_triton:
        dx = swiglu_grad_reference(q, e, dy, activation)
        return dx, StageOneAmax(amax_partials_reference(dx))
    dx = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    return dx, _backward_partials(q, e, dy, dx, activation, tickets)[0]


def swiglu_backward_amax(q, e, dy, use_triton: bool, *, activation="silu", product_scale=None,
                         tickets: ScaleTickets | None = None):
    """Stage-1 amaxes of d[gate | up] (as BF16 values) without writing it: the first pass of
    `swiglu_backward_cast`, which then recomputes it straight into E5M2. With product_scale (the forward's scale of
    act(gate) * up), the same loads also give the product's transposed E4M3 copy (swiglu_cast's write_t output).
    -> (StageOneAmax, p8_t [F, M16] | None)."""
    check_activation(activation)
    if not use_triton:
        amax = StageOneAmax(amax_partials_reference(swiglu_grad_reference(q, e, dy, activation)))
        if product_scale is None:
            return amax, None
        return amax, swiglu_cast(q, e, product_scale, False, activation=activation, write_row=False, write_t=True)[1]
    return _backward_partials(q, e, dy, None, activation, tickets, product_scale)


def swiglu_backward_cast(q, e, dy, scale, use_triton: bool, *, activation="silu", write_row=True, write_t=True):
    """d[gate | up] recomputed and cast straight to per-tensor E5M2: (dx8 [M, 2F] | None, dx8_t [2F, M16] | None)."""
    check_activation(activation)
    if not use_triton:
        return cast_reference(swiglu_grad_reference(q, e, dy, activation), scale, E5M2, write_row, write_t)
    m, f, mp, out, out_t, (bm, g, w), grid = _cast_outputs(q, q.shape[1], E5M2, write_row, write_t, BWD_CAST_TILE)
    if grid[0]:
        _swiglu_bwd_kernel[grid](q, e, dy.contiguous(), None, None, scale, out, out_t, m, f, mp, CAST=True,
                                 WRITE_ROW=write_row, WRITE_T=write_t, BM=bm, G=g, num_warps=w, ACT=activation)
    return out, out_t
