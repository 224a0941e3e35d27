"""FP8 GEMMs through `torch._scaled_mm` (per-tensor scales, fp32 accumulation).

Hopper's FP8 GEMM takes A row-major and B column-major ("TN"): `fp8_gemm(a, b_rows, ...)` computes
a [M, K] @ b_rows[N, K].T, passing `b_rows.t()` (a free view) as B; the quantizers write each operand
already in that layout (row-major copy for forward/dgrad, transposed copy for wgrad), so no GEMM needs a copy.
Scales are fp32 0-dim dequantization scales. E5M2 x E5M2 is not supported by the hardware and never needed here:
dgrad is E5M2 (grad) x E4M3 (weight), wgrad E5M2 (grad^T) x E4M3 (input^T).
On CPU the GEMM is torch's own CPU emulation of `_scaled_mm`, written out (`cpu_scaled_mm`): each operand dequantized
to fp32 and multiplied by its scale, one fp32 matmul, the bias added in fp32, one rounding to out_dtype. torch's
`_scaled_mm` itself takes that path only on CPUs without AMX; with AMX (Intel Sapphire Rapids and later) it hands
the GEMM to oneDNN, which has no FP8 kernel there and runs several hundred times slower, with other rounding.
"""
from __future__ import annotations

import torch

from ..formats import get_format


def check_gemm_dims(k: int, n: int, what: str):
    if k % 16 or n % 16:
        raise ValueError(f"{what}: FP8 GEMMs need in_features and out_features to be multiples of 16, "
                         f"got in_features={k}, out_features={n}")


def fp8_gemm(a: torch.Tensor, b_rows: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             out_dtype=torch.bfloat16, bias: torch.Tensor | None = None, *, fast_accum: bool = False) -> torch.Tensor:
    """a [M, K] fp8 row-major, b_rows [N, K] fp8 row-major -> a @ b_rows.T * scale_a * scale_b (+ bias), [M, N].
    fast_accum: Hopper's fast FP8 accumulation (forward GEMMs only, when the config asks for it)."""
    if a.shape[0] == 0:
        return torch.zeros(0, b_rows.shape[0], dtype=out_dtype, device=a.device)
    if bias is not None and bias.dtype != out_dtype:
        bias = bias.to(out_dtype)
    if a.device.type == "cpu":
        return cpu_scaled_mm(a, b_rows, scale_a, scale_b, out_dtype, bias)
    return torch._scaled_mm(a, b_rows.t(), scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def cpu_scaled_mm(a: torch.Tensor, b_rows: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """torch's CPU emulation of `_scaled_mm(a, b_rows.t(), ...)` (the path it takes without AMX), bit for bit."""
    out = (get_format(a.dtype).decode(a) * scale_a) @ (get_format(b_rows.dtype).decode(b_rows) * scale_b).t()
    if bias is not None:
        out += bias
    return out.to(out_dtype)
