"""log2, exp2 and fused multiply-add, identical in torch and in Triton (GPU, Gluon and TRITON_INTERPRET).

Library transcendentals differ between torch (CPU SLEEF, CUDA exp2f/log2f), Triton's fast MUFU instructions and
the interpreter's numpy, so codes computed with them cannot match bit for bit. These polynomials evaluate the
same IEEE fp32 operations in the same order everywhere: the kernels compile with FMA contraction off and fuse
only where `fma` is written, which torch emulates exactly (`fma` below). Accuracy: |log2 error| < 3e-5, exp2
relative error < 4e-6 (degree 4); the coarse degree-3 pair: 1.2e-4 and 7.7e-5.
Domain: log2 of x >= 0; inputs below fp32's smallest normal (2^-126: zero and subnormals) give -inf, so
subnormal magnitudes quantize to zero. exp2 of y returns 0 below -126 and saturates at fp32's largest finite value
(y up to 128: the decoder's results stay finite for every finite fp32 moment); the coarse exp2 (the encoder's, whose
results stay below the FP8 maximum) is meant for y < 127.5. Integer <-> float conversions go through magic-number
additions instead of F2I/I2F/FRND, which
run at a fraction of the FMA rate on Hopper.
"""
import torch
import triton
import triton.language as tl

from .triton_fp8 import _INTERPRET

# log2(1 + f) = f * P(f) for f in [sqrt(1/2) - 1, sqrt(2) - 1]; least-squares fit on Chebyshev nodes.
# Degree 4 each: accurate far beyond FP8 resolution (the power |x|^k with k <= 16 amplifies log2 errors 11x).
LOG2_COEFFS = (1.4426476, -0.720541, 0.48521447, -0.39112714, 0.25566962)
# 2^f for f in [-1/2, 1/2].
EXP2_COEFFS = (1.0000001, 0.693121, 0.24022107, 0.055922076, 0.009676042)
# Degree 3, for the encoder's power |x|^k (`coarse=True`): errors 1.2e-4 (log2) and 7.7e-5 (exp2) put codes at most
# 0.2% of a value from where exact math would, against E4M3's 6% half-spacing; one multiply-add less each.
LOG2_COEFFS_3 = (1.4416474, -0.7249528, 0.51862043, -0.33007723)
EXP2_COEFFS_3 = (0.99992895, 0.6932762, 0.24260405, 0.055088684)
SQRT2_BITS = 0x3FB504F3  # bits of fp32 sqrt(2): mantissas above it fold down by one octave
MIN_NORMAL = 2.0 ** -126
FLOAT32_MAX = 3.4028234663852886e38


def fma(a, b, c) -> torch.Tensor:
    """fp32 a * b + c with one rounding, as the GPU's FFMA computes it.

    The product of two fp32 values is exact in double, so rounding the double sum s to fp32 is correct unless s
    landed exactly on a midpoint between fp32 neighbours (or in fp32's subnormal range): only those elements are
    redone with the sum rounded to odd (TwoSum's error nudges an even s one ulp toward the exact value), and
    round-to-odd at 53 bits followed by rounding to 24 bits is correctly rounded.
    """
    device = next(t.device for t in (a, b, c) if torch.is_tensor(t))
    a, b, c = (torch.as_tensor(t, dtype=torch.float32, device=device).double() for t in (a, b, c))
    prod = a * b
    s = prod + c
    out = s.float()
    bits = s.view(torch.int64)
    hazard = ((bits & 0x1FFFFFFF) == 0x10000000) | ((s.abs() < MIN_NORMAL) & (s != 0))
    if hazard.any():
        prod, c = torch.broadcast_tensors(prod, c)
        idx = hazard.nonzero(as_tuple=True)
        out[idx] = _round_to_odd_sum(prod[idx], c[idx]).float()
    return out


def _round_to_odd_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    s = x + y
    s_y = s - x
    err = (x - (s - s_y)) + (y - s_y)
    bits = s.view(torch.int64)
    to_odd = (err != 0) & ((bits & 1) == 0) & torch.isfinite(s)
    return (bits + torch.where(to_odd, torch.where((err > 0) == (s > 0), 1, -1), 0)).view(torch.float64)


def _horner(coeffs, x):
    r = torch.full_like(x, coeffs[-1])
    for c in coeffs[-2::-1]:
        r = fma(r, x, c)
    return r


def log2(x: torch.Tensor, coarse: bool = False) -> torch.Tensor:
    """Portable log2 of a non-negative fp32 tensor (-inf below 2^-126)."""
    x = x.float()
    bits = x.view(torch.int32)
    mant_bits = (bits & 0x7FFFFF) | 0x3F800000
    fold = mant_bits > SQRT2_BITS
    mant_bits = torch.where(fold, mant_bits - 0x00800000, mant_bits)
    exponent = (bits >> 23) + fold.int()  # biased by 127 (x >= 0: no sign bit)
    exponent = (exponent + (0x4B000000 + 129)).view(torch.float32) - 8388864.0  # int -> float: 2^23 + e + 256
    f = mant_bits.view(torch.float32) - 1.0
    r = fma(f, _horner(LOG2_COEFFS_3 if coarse else LOG2_COEFFS, f), exponent)
    return torch.where(x >= MIN_NORMAL, r, float("-inf"))


def exp2(y: torch.Tensor, coarse: bool = False) -> torch.Tensor:
    """Portable exp2 of an fp32 tensor (0 below -126; the fine one saturates at fp32's maximum)."""
    y = y.float()
    t = y + 12582912.0  # 1.5 * 2^23: rounds y to the nearest integer n, held in t's low mantissa bits
    n = t.view(torch.int32) - 0x4B400000
    f = y - (t - 12582912.0)
    if coarse:
        two_n = ((n + 127) << 23).view(torch.float32)
        return torch.where(y < -126.0, 0.0, _horner(EXP2_COEFFS_3, f) * two_n)
    # 2^n as 2^min(n, 127) times 1 or 2: 2^128 is not an fp32 value (the product by 1 changes no bit)
    two_n = ((n.clamp(max=127) + 127) << 23).view(torch.float32)
    r = (_horner(EXP2_COEFFS, f) * two_n) * torch.where(n > 127, 2.0, 1.0)
    return torch.where(y < -126.0, 0.0, r.clamp(max=FLOAT32_MAX))


@triton.jit
def _fma_emulated(a, b, c):
    """`fma` above in float64 Triton ops, for the interpreter (whose tl.fma rounds twice)."""
    c = tl.cast(c, tl.float64)
    prod = tl.cast(a, tl.float64) * tl.cast(b, tl.float64)
    s = prod + c
    s_c = s - prod
    err = (prod - (s - s_c)) + (c - s_c)
    bits = s.to(tl.int64, bitcast=True)
    to_odd = (err != 0) & ((bits & 1) == 0) & (tl.abs(s) < float("inf"))
    bits = bits + tl.where(to_odd, tl.where((err > 0) == (s > 0), 1, -1), 0)
    return bits.to(tl.float64, bitcast=True).to(tl.float32)


@triton.jit
def fma_p(a, b, c):
    if _INTERPRET:
        return _fma_emulated(a, b, c)
    else:
        return tl.fma(a, b, c)


@triton.jit
def log2_p(x, COARSE: tl.constexpr = False):
    bits = x.to(tl.int32, bitcast=True)
    mant_bits = (bits & 0x7FFFFF) | 0x3F800000
    fold = mant_bits > 0x3FB504F3
    mant_bits = tl.where(fold, mant_bits - 0x00800000, mant_bits)
    exponent = (bits >> 23) + fold.to(tl.int32)
    exponent = (exponent + (0x4B000000 + 129)).to(tl.float32, bitcast=True) - 8388864.0
    f = mant_bits.to(tl.float32, bitcast=True) - 1.0
    if COARSE:  # LOG2_COEFFS_3
        p = fma_p(f, -0.33007723, 0.51862043)
        p = fma_p(p, f, -0.7249528)
        p = fma_p(p, f, 1.4416474)
    else:  # LOG2_COEFFS
        p = fma_p(f, 0.25566962, -0.39112714)
        p = fma_p(p, f, 0.48521447)
        p = fma_p(p, f, -0.720541)
        p = fma_p(p, f, 1.4426476)
    r = fma_p(f, p, exponent)
    return tl.where(x >= 1.1754943508222875e-38, r, float("-inf"))


@triton.jit
def exp2_p(y, COARSE: tl.constexpr = False):
    t = y + 12582912.0
    n = t.to(tl.int32, bitcast=True) - 0x4B400000
    f = y - (t - 12582912.0)
    if COARSE:  # EXP2_COEFFS_3
        two_n = ((n + 127) << 23).to(tl.float32, bitcast=True)
        p = fma_p(f, 0.055088684, 0.24260405)
        p = fma_p(p, f, 0.6932762)
        p = fma_p(p, f, 0.99992895)
        r = p * two_n
    else:  # EXP2_COEFFS; 2^n as 2^min(n, 127) times 1 or 2, saturated at fp32's maximum
        two_n = ((tl.minimum(n, 127) + 127) << 23).to(tl.float32, bitcast=True)
        p = fma_p(f, 0.009676042, 0.055922076)
        p = fma_p(p, f, 0.24022107)
        p = fma_p(p, f, 0.693121)
        p = fma_p(p, f, 1.0000001)
        r = tl.minimum((p * two_n) * tl.where(n > 127, 2.0, 1.0), 3.4028234663852886e38)
    return tl.where(y < -126.0, 0.0, r)


@triton.jit
def to_bf16_p(x):
    """fp32 -> bf16 rounded to nearest even, as torch's `.bfloat16()` and the GPU's cvt.rn round (the interpreter's
    cast truncates): the carry of the 16 dropped bits added to the kept ones. NaN stays a (quiet) NaN; overflow
    rounds to infinity."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = tl.where(x != x, bits | 0x400000, rounded)
    return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def to_dtype_p(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE (fp32, bf16 or fp16) to nearest even, on the GPU and under the interpreter alike."""
    if DTYPE == tl.bfloat16:
        return to_bf16_p(x)
    else:
        return x.to(DTYPE)
