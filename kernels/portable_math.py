"""log2 and exp2 built from plain fp32 multiply/add and bit operations, identical in torch and in Triton.

Library transcendentals differ between torch (CPU SLEEF, CUDA exp2f/log2f), Triton's fast MUFU instructions and
the interpreter's numpy, so codes computed with them cannot match bit for bit. These polynomials evaluate the
same IEEE fp32 operations in the same order everywhere (the Triton kernels run with FMA contraction off), and are
cheaper than libdevice's. Accuracy: |log2 error| < 3e-5, exp2 relative error < 4e-6.
Domain: log2 of x >= 0 (log2(0) = -inf); exp2 of y returns 0 below -126 and is meant for y < 128 (NaN in gives a
finite value out). Integer <-> float conversions go through magic-number additions instead of F2I/I2F/FRND, which
run at a fraction of the FMA rate on Hopper.
"""
import torch
import triton
import triton.language as tl

# log2(1 + f) = f * P(f) for f in [sqrt(1/2) - 1, sqrt(2) - 1]; least-squares fit on Chebyshev nodes.
# Degree 4 each: accurate far beyond FP8 resolution (the power |x|^k with k <= 16 amplifies log2 errors 11x).
LOG2_COEFFS = (1.4426476, -0.720541, 0.48521447, -0.39112714, 0.25566962)
# 2^f for f in [-1/2, 1/2].
EXP2_COEFFS = (1.0000001, 0.693121, 0.24022107, 0.055922076, 0.009676042)
SQRT2_BITS = 0x3FB504F3  # bits of fp32 sqrt(2): mantissas above it fold down by one octave


def _horner(coeffs, x):
    r = torch.full_like(x, coeffs[-1])
    for c in coeffs[-2::-1]:
        r = r * x + c
    return r


def log2(x: torch.Tensor) -> torch.Tensor:
    """Portable log2 of a non-negative fp32 tensor."""
    x = x.float()
    tiny = x < 2.0 ** -126
    x = torch.where(tiny, x * 2.0 ** 23, x)
    bits = x.view(torch.int32)
    mant_bits = (bits & 0x7FFFFF) | 0x3F800000
    fold = mant_bits > SQRT2_BITS
    mant_bits = torch.where(fold, mant_bits - 0x00800000, mant_bits)
    exponent = ((bits >> 23) & 0xFF) + fold.int() - torch.where(tiny, 23, 0).int()  # biased by 127
    exponent = (exponent + (0x4B000000 + 129)).view(torch.float32) - 8388864.0  # int -> float: 2^23 + e + 256
    f = mant_bits.view(torch.float32) - 1.0
    r = f * _horner(LOG2_COEFFS, f) + exponent
    return torch.where(x > 0, r, float("-inf"))


def exp2(y: torch.Tensor) -> torch.Tensor:
    """Portable exp2 of an fp32 tensor (0 below -126)."""
    y = y.float()
    yc = y.clamp(-127.0, 127.0)
    t = yc + 12582912.0  # 1.5 * 2^23: rounds yc to the nearest integer n, held in t's low mantissa bits
    n = t.view(torch.int32) - 0x4B400000
    f = yc - (t - 12582912.0)
    two_n = ((n + 127) << 23).view(torch.float32)
    return torch.where(y < -126.0, 0.0, _horner(EXP2_COEFFS, f) * two_n)


@triton.jit
def log2_p(x):
    tiny = x < 1.1754943508222875e-38
    x = tl.where(tiny, x * 8388608.0, x)
    bits = x.to(tl.int32, bitcast=True)
    mant_bits = (bits & 0x7FFFFF) | 0x3F800000
    fold = mant_bits > 0x3FB504F3
    mant_bits = tl.where(fold, mant_bits - 0x00800000, mant_bits)
    exponent = ((bits >> 23) & 0xFF) + fold.to(tl.int32) - tl.where(tiny, 23, 0)
    exponent = (exponent + (0x4B000000 + 129)).to(tl.float32, bitcast=True) - 8388864.0
    f = mant_bits.to(tl.float32, bitcast=True) - 1.0
    p = f * 0.25566962 + -0.39112714
    p = p * f + 0.48521447
    p = p * f + -0.720541
    p = p * f + 1.4426476
    r = f * p + exponent
    return tl.where(x > 0, r, float("-inf"))


@triton.jit
def exp2_p(y):
    yc = tl.minimum(tl.maximum(y, -127.0), 127.0)
    t = yc + 12582912.0
    n = t.to(tl.int32, bitcast=True) - 0x4B400000
    f = yc - (t - 12582912.0)
    two_n = ((n + 127) << 23).to(tl.float32, bitcast=True)
    p = f * 0.009676042 + 0.055922076
    p = p * f + 0.24022107
    p = p * f + 0.693121
    p = p * f + 1.0000001
    return tl.where(y < -126.0, 0.0, p * two_n)
