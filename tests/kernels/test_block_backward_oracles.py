"""Backward formulas of the FP8 blocks against torch autograd on the dequantized inputs (what the blocks save), on the
torch and Triton (interpreter) paths. The only error left is the output's conversion: dx in BF16, rounded to nearest
(at most half a BF16 step: 2^-8 relative allowed) on the torch path, truncated by the interpreter (at most one step:
2^-7), plus fp32 arithmetic in another order (an absolute floor of 1e-6 of the largest value)."""
import pytest
import torch
import torch.nn.functional as F

from coat_kernels.act import group_quant as GQ
from coat_kernels.act import norm as N
from coat_kernels.act import swiglu as S
from coat_kernels.formats import E4M3

BF16_RTOL = {False: 2 ** -8, True: 2 ** -7}  # use_triton -> the BF16 conversion's relative error bound


def close(got, expected, rtol):
    atol = 1e-6 * expected.abs().max().item()
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
