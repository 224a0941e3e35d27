"""Backward formulas of the FP8 blocks against torch autograd (or the matmuls) on the dequantized inputs (what the
blocks save; for the linear block also the output gradient, which it quantizes to E5M2 per tensor), on the torch and
Triton (interpreter) paths. The only error left is the output's conversion to BF16: rounded to nearest (at most half
a BF16 step: 2^-8 relative allowed) on the torch path, truncated by the interpreter (at most one step: 2^-7), plus
fp32 arithmetic in another order (an absolute floor of 1e-6 of the largest value, 1e-5 for the GEMMs' sums)."""
import pytest
import torch
import torch.nn.functional as F

import coat_kernels.act as act
from coat_hf import ActivationConfig
from coat_kernels.act import group_quant as GQ
from coat_kernels.act import norm as N
from coat_kernels.act import swiglu as S
from coat_kernels.formats import E4M3

BF16_RTOL = {False: 2 ** -8, True: 2 ** -7}  # use_triton -> the BF16 conversion's relative error bound


def close(got, expected, rtol, floor=1e-6):
    atol = floor * expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, rtol=rtol, atol=atol)


def inputs(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 2).bfloat16(), torch.randn(rows, cols // 2, generator=g).bfloat16()


@pytest.mark.parametrize("use_triton", [False, True])
def test_swiglu_backward_is_autograd_of_silu_gate_times_up(use_triton):
    x, dy = inputs(8, 96, 0)
    q, e = GQ.group_quantize(x, E4M3, False)
    xd = GQ.group_dequantize(q, e, False, torch.float32).requires_grad_()
    gate, up = xd.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(dy.float())
    dx, _ = S.swiglu_backward(q, e, dy, use_triton)
    assert dx.dtype == torch.bfloat16
    close(dx, xd.grad, BF16_RTOL[use_triton])


@pytest.mark.parametrize("use_triton", [False, True])
def test_rmsnorm_backward_is_autograd_of_rms_norm(use_triton):
    x, _ = inputs(8, 64, 1)
    dy = torch.randn(8, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    w = (1 + 0.2 * torch.randn(64, generator=torch.Generator().manual_seed(3))).bfloat16()
    _, q, e, mean, rstd, _ = N.norm_forward(x, w, None, use_triton, kind="rmsnorm")
    xd = GQ.group_dequantize(q, e, False, torch.float32).requires_grad_()
    weight = w.float().requires_grad_()
    F.rms_norm(xd, (64,), weight, 1e-5).backward(dy.float())
    dx, dw, _ = N.norm_backward(q, e, mean, rstd, w, dy, use_triton)
    assert dx.dtype == torch.bfloat16
    close(dx, xd.grad, BF16_RTOL[use_triton])
    close(dw, weight.grad, 1e-5)  # fp32


def per_tensor_dequantized(t, dtype):
    """t through a per-tensor cast to `dtype` and back: scale amax / max, times the scale's fp32 reciprocal."""
    scale = t.float().abs().amax() / torch.finfo(dtype).max
    return (t.float() * torch.reciprocal(scale)).to(dtype).float() * scale


@pytest.mark.parametrize("use_triton", [False, True])
def test_linear_forward_and_backward_are_the_matmuls_of_the_dequantized_operands(use_triton):
    """y = x8 w8^T, dx = dy8 w8, dw = dy8^T x8 with x, w in E4M3 and dy in E5M2 (64-term fp32 sums in another order:
    a floor of 1e-5 of the largest value)."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(32, 64, generator=g).bfloat16(), (torch.randn(48, 64, generator=g) / 8).bfloat16()
    dy = torch.randn(32, 48, generator=g).bfloat16()
    x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = act.fp8_linear(x_leaf, w_leaf, config=ActivationConfig(backend="triton" if use_triton else "torch"))
    y.backward(dy)
    x8, w8 = per_tensor_dequantized(x, torch.float8_e4m3fn), per_tensor_dequantized(w, torch.float8_e4m3fn)
    dy8 = per_tensor_dequantized(dy, torch.float8_e5m2)
    for got, expected in ((y, x8 @ w8.t()), (x_leaf.grad, dy8 @ w8), (w_leaf.grad, dy8.t() @ x8)):
        assert got.dtype == torch.bfloat16
        close(got, expected, BF16_RTOL[use_triton], floor=1e-5)
