"""The per-tensor amax each producer hands to the next GEMM's scale (stage 1 partials), on the torch and Triton
(interpreter) paths, against `x.abs().amax()` of the tensor that GEMM quantizes, computed here from the producer's
own output with torch ops: a tensor no kernel produced, group quantization, the norm's normalized output, the
SwiGLU product and the SwiGLU gradient."""
import pytest
import torch
import torch.nn.functional as F

from coat_kernels.act import group_quant as GQ
from coat_kernels.act import norm as N
from coat_kernels.act import swiglu as S
from coat_kernels.act import tensor_quant as TQ
from coat_kernels.formats import E4M3

BACKENDS = [False, True]  # use_triton


def tensor(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))).bfloat16()


def amax_of(stage_one):
    return stage_one.partials.max()


def dequantized(codes, scales):
    """fp32 values of 1 x 16 E4M3 groups: codes times their group's scale."""
    groups = codes.float().reshape(*codes.shape[:-1], -1, 16) * scales.float()[..., None]
    return groups.reshape(codes.shape)


@pytest.mark.parametrize("use_triton", BACKENDS)
def test_amax_of_a_plain_tensor(use_triton):
    x = tensor(8, 96, 0)
    assert torch.equal(amax_of(TQ.amax_partials(x, use_triton)), x.float().abs().amax())
    _, _, partials = GQ.group_quantize(x, E4M3, use_triton, partial_amax=True)
    assert torch.equal(partials.max(), x.float().abs().amax())


def test_a_tensor_holding_inf_has_a_nan_amax():
    x = tensor(4, 32, 1)
    x[2, 5] = float("inf")
    assert torch.isnan(amax_of(TQ.amax_partials(x, False)))


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("use_triton", BACKENDS)
def test_amax_of_the_normalized_output(use_triton, kind):
    x, w = tensor(8, 64, 2), (1 + 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(3))).bfloat16()
    _, q, e, _, _, stage_one = N.norm_forward(x, w, None, use_triton, kind=kind)
    xd = dequantized(q, e)  # the norm normalizes its FP8 copy, which backward reads too
    y = (F.rms_norm(xd, (64,), w.float(), 1e-5) if kind == "rmsnorm"
         else F.layer_norm(xd, (64,), w.float(), None, 1e-5))
    torch.testing.assert_close(amax_of(stage_one), y.abs().amax(), rtol=2e-6, atol=0)


@pytest.mark.parametrize("use_triton", BACKENDS)
def test_amax_of_the_swiglu_product_and_of_its_gradient(use_triton):
    x, dy = tensor(8, 96, 4), tensor(8, 48, 5)
    q, e, stage_one, _ = S.swiglu_forward(x, use_triton)
    gate, up = dequantized(q, e).chunk(2, dim=-1)
    torch.testing.assert_close(amax_of(stage_one), (F.silu(gate) * up).abs().amax(), rtol=2e-6, atol=0)
    dx, stage_one = S.swiglu_backward(q, e, dy, use_triton)
    assert torch.equal(amax_of(stage_one), dx.float().abs().amax())  # of the BF16 gradient the GEMM reads
