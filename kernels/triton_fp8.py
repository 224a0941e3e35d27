"""Triton device helpers shared by every COAT kernel: fp32 -> FP8, nearest even, saturating, NaN kept.

On the GPU `to_e4m3` / `to_e5m2` are the hardware conversion (cvt.rn.satfinite: round to nearest even like
torch's cast, saturating out-of-range values and infinities to +-max like a clamp before it, NaN kept). Under
TRITON_INTERPRET they first round to the FP8 grid with plain fp32 arithmetic (`round_to_fp8_grid`),
because the interpreter's own fp32->fp8 cast mis-rounds values whose mantissa carries into the exponent
(-127.76 -> -64); its NaN -> e4m3 gives 384 instead of NaN. Both paths give torch's codes for finite inputs.
"""
import triton
import triton.language as tl

INTERPRET = bool(triton.knobs.runtime.interpret)  # TRITON_INTERPRET=1, as Triton itself reads it
_INTERPRET: tl.constexpr = tl.constexpr(INTERPRET)


@triton.jit
def round_to_fp8_grid(y, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, FP8_MAX: tl.constexpr):
    """Nearest-even FP8 value of fp32 `y`, clamped to +-FP8_MAX; NaN stays NaN. Result is still fp32."""
    a = tl.abs(y)
    exp = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exp, MIN_NORMAL_EXP) - MANTISSA_BITS  # spacing of the FP8 grid around a
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)
    # adding and subtracting 1.5 * 2**23 rounds |t| < 2**22 to an integer, ties to even
    r = ((a * inv_step + 12582912.0) - 12582912.0) * step
    r = tl.minimum(r, FP8_MAX)
    r = tl.where(a != a, a, r)  # keep NaN
    # y's sign bit on the magnitude: a negative value that rounds to zero gives -0, as the hardware cast does
    return (r.to(tl.int32, bitcast=True) | (y.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(y):
    if _INTERPRET:
        return round_to_fp8_grid(y, 3, -6, 448.0).to(tl.float8e4nv)
    else:
        return y.to(tl.float8e4nv)


@triton.jit
def to_e5m2(y):
    if _INTERPRET:
        return round_to_fp8_grid(y, 2, -14, 57344.0).to(tl.float8e5)
    else:
        return y.to(tl.float8e5)


def require_triton_device(t, what: str) -> None:
    """Raise a clear error when `t` is on a device the Triton kernels cannot run on (a CPU tensor without the
    interpreter): what the user asked for, and what to use instead."""
    if t.is_cuda or INTERPRET:
        return
    raise RuntimeError(f"{what}(backend='triton') runs the Triton kernels, which need CUDA tensors; this tensor is on "
                       f"{t.device}. On a CPU use backend='auto' (CPU tensors then take the bit-exact CPU path) or "
                       f"'torch'; to run the Triton kernels themselves on a CPU (slowly, for tests), set "
                       f"TRITON_INTERPRET=1 before the first import")


@triton.jit
def nanmax(a, b):
    """max that propagates NaN (the combine function of amax reductions: a NaN or Inf anywhere stays visible)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
