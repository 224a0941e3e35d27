"""The FP8 GEMM on CPU (coat_kernels.act.gemm.cpu_scaled_mm): torch's own CPU emulation of `_scaled_mm`, bit for
bit, whatever the CPU. torch hands same-dtype FP8 GEMMs to oneDNN on CPUs with AMX; with oneDNN switched off it takes
the emulation on every CPU, which is the oracle here."""
import itertools
import warnings

import pytest
import torch

from coat_kernels.act.gemm import fp8_gemm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def torch_cpu_emulation(a, b_rows, scale_a, scale_b, out_dtype, bias):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the flags context warns about TF32 on Intel GPUs
        with torch.backends.mkldnn.flags(enabled=False):
            return torch._scaled_mm(a, b_rows.t(), scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)


@pytest.mark.parametrize("dtypes,out_dtype,with_bias", list(itertools.product(
    [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)], [torch.bfloat16, torch.float32], [False, True])))
def test_cpu_gemm_is_torchs_cpu_emulation_bit_for_bit(dtypes, out_dtype, with_bias):
    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((64, 256, 48), (33, 128, 80)):
        a = (torch.randn(m, k, generator=gen) * 3).to(dtypes[0])
        b_rows = torch.randn(n, k, generator=gen).to(dtypes[1])
        scale_a, scale_b = torch.rand((), generator=gen) / 10, torch.rand((), generator=gen) * 5
        bias = torch.randn(n, generator=gen).to(out_dtype) if with_bias else None
        expected = torch_cpu_emulation(a, b_rows, scale_a, scale_b, out_dtype, bias)
        got = fp8_gemm(a, b_rows, scale_a, scale_b, out_dtype, bias)
        assert got.dtype == out_dtype and torch.equal(got, expected)


def test_cpu_gemm_propagates_nan_scales_and_handles_empty_inputs():
    a = torch.ones(4, 16).to(E4M3)
    b_rows = torch.ones(32, 16).to(E4M3)
    out = fp8_gemm(a, b_rows, torch.tensor(float("nan")), torch.tensor(1.0))
    assert out.shape == (4, 32) and out.isnan().all()
    assert fp8_gemm(a[:0], b_rows, torch.tensor(1.0), torch.tensor(1.0)).shape == (0, 32)
