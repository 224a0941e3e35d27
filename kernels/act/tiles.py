"""Triton device helpers shared by the activation kernels: 1x16 group tiles, their quantization, amax reductions and
per-tensor casts of tiles (row-major and transposed stores).

Tiles of 1x16 groups are 3-D, [groups, rows, 16], with one group per thread: each thread issues its loads together
(with several groups per thread ptxas serialized them) and the codes and their scales land in the same thread
layout (with rows first, the compiler moved the codes through shared memory to meet the scales).
"""
import triton
import triton.language as tl

from ..triton_fp8 import nanmax, round_to_fp8_grid, to_e4m3, to_e5m2

GROUP = 16  # elements per 1x16 scaling group


@triton.jit
def fp8_cast(y, E5M2_OUT: tl.constexpr):
    if E5M2_OUT:
        return to_e5m2(y)
    else:
        return to_e4m3(y)


@triton.jit
def encode_group_scale(amax, FP8_MAX: tl.constexpr):
    """fp32 scale: amax / FP8_MAX rounded to the nearest bf16 value, ties to even (stored exactly as bf16; the
    group's largest element may then saturate to FP8_MAX); 1 for an all-zero group, NaN for a group holding Inf/NaN
    (amax Inf or NaN: the amax reductions propagate NaN)."""
    bits = tl.maximum((amax / FP8_MAX).to(tl.int32, bitcast=True), 0x00800000)  # >= the smallest normal fp32
    scale = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    scale = tl.where(amax == 0, 1.0, scale)
    return tl.where((amax != amax) | (amax == float("inf")), float("nan"), scale)


@triton.jit
def quantize_group_tile(x, FP8_MAX: tl.constexpr, E5M2_OUT: tl.constexpr):
    """x fp32 [G, BM, 16] (one 1x16 group per [g, i, :]) -> (FP8 codes [G, BM, 16], fp32 scales [G, BM, 1]
    (bf16-exact), the dequantized values fp32 [G, BM, 16]). The dequantized values come from rounding to the FP8
    grid in fp32 (the same values as the codes; converting the in-register codes back gave NaN with Triton 3.6)."""
    scale = encode_group_scale(tl.reduce(tl.abs(x), 2, nanmax, keep_dims=True), FP8_MAX)
    y = tl.math.div_rn(x, scale)  # IEEE, as the reference: x / scale often lands exactly on an FP8 midpoint
    codes = fp8_cast(y, E5M2_OUT)
    if E5M2_OUT:
        values = round_to_fp8_grid(y, 2, -14, 57344.0)
    else:
        values = round_to_fp8_grid(y, 3, -6, 448.0)
    return codes, scale, values * scale


@triton.jit
def group_tile(rows, g0, M, K, NG, G: tl.constexpr):
    """3-D tile of G 1x16 groups (starting at group g0, valid below NG) of `rows` (int64) of a row-major [M, K]
    tensor: (element offsets [G, BM, 16], scale offsets [G, BM, 1], mask [G, BM, 1])."""
    g = g0 + tl.arange(0, G)
    offs = g[:, None, None] * 16 + rows[None, :, None] * K + tl.arange(0, 16)[None, None, :]
    scale_offs = g[:, None, None] + rows[None, :, None] * (K // 16)
    return offs, scale_offs, (g[:, None, None] < NG) & (rows[None, :, None] < M)


@triton.jit
def load_group_tile(codes_ptr, scales_ptr, offs, scale_offs, mask):
    """Dequantized fp32 [G, BM, 16] of a 1x16 FP8 copy (codes converted right after the load, no reshape)."""
    codes = tl.load(codes_ptr + offs, mask=mask, other=0.0)
    scales = tl.load(scales_ptr + scale_offs, mask=mask, other=1.0)
    return codes.to(tl.float32) * scales.to(tl.float32)


@triton.jit
def tile_amax(y, mask):
    """max |y| over the masked tile; NaN if any element is Inf/NaN (stage 1 of group scaling)."""
    return tile_amax_of_zero_masked(tl.where(mask, y, 0.0))


@triton.jit
def tile_amax_of_zero_masked(y):
    """tile_amax of a tile whose masked-off elements are already zero."""
    m = tl.reduce(tl.abs(y), None, nanmax)
    return tl.where(m == float("inf"), float("nan"), m)


@triton.jit
def store_cast(y, rows, cols, scale, out_ptr, out_t_ptr, M, N, M_PAD,
               WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr, E5M2_OUT: tl.constexpr):
    """Cast a 2-D tile y [BM, BN] (rows >= M already zero) with a per-tensor scale; write out [M, N] and/or the
    transposed out_t [N, M_PAD]."""
    inv = tl.math.div_rn(1.0, scale)  # y * (1 / scale), the reference's rounding (cast_reference)
    if WRITE_ROW:
        q = fp8_cast(y * inv, E5M2_OUT)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], q, mask=(rows[:, None] < M) & (cols[None, :] < N))
    if WRITE_T:
        qt = fp8_cast(tl.trans(y) * inv, E5M2_OUT)  # transpose fp32, then cast (fp8 transposes miscompiled)
        tl.store(out_t_ptr + cols[:, None] * M_PAD + rows[None, :], qt,
                 mask=(cols[:, None] < N) & (rows[None, :] < M_PAD))


@triton.jit
def store_cast_groups(y, rows, g0, scale, out_ptr, out_t_ptr, M, N, M_PAD, G: tl.constexpr,
                      WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr, E5M2_OUT: tl.constexpr,
                      TRANSPOSE_BY_PERMUTE: tl.constexpr):
    """store_cast for a 3-D group tile y [G, BM, 16] (groups g0.. of rows; rows >= M already zero): out [M, N]
    and/or out_t [N, M_PAD]. The transposed copy is transposed in fp32, then cast (FP8 transposes miscompiled):
    TRANSPOSE_BY_PERMUTE permutes to [G, 16, BM] and reshapes to [G * 16, BM]; otherwise the tile is reshaped to
    [BM, G * 16] and transposed with tl.trans (which is faster depends on the kernel: see the callers' tables)."""
    j = tl.arange(0, 16)
    g = g0 + tl.arange(0, G)
    inv = tl.math.div_rn(1.0, scale)  # y * (1 / scale), the reference's rounding (cast_reference)
    if WRITE_ROW:
        q = fp8_cast(y * inv, E5M2_OUT)
        cols = g[:, None, None] * 16 + j[None, None, :]
        tl.store(out_ptr + rows[None, :, None] * N + cols, q, mask=(rows[None, :, None] < M) & (cols < N))
    if WRITE_T:
        if TRANSPOSE_BY_PERMUTE:
            yt = tl.reshape(tl.permute(y, (0, 2, 1)), (G * 16, y.shape[1]))
        else:
            yt = tl.trans(tl.reshape(tl.permute(y, (1, 0, 2)), (y.shape[1], G * 16)))
        c = g0 * 16 + tl.arange(0, G * 16)
        tl.store(out_t_ptr + c[:, None] * M_PAD + rows[None, :], fp8_cast(yt * inv, E5M2_OUT),
                 mask=(c[:, None] < N) & (rows[None, :] < M_PAD))


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host, for grids and buffer sizes (triton.cdiv is a constexpr function: a host call to it
    goes through Triton's constexpr unwrapping, many times the cost of the division, on every launch)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 on the host without Triton's constexpr-function call (0 for n <= 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def check_group_dim(k: int, what: str = "last dim"):
    if k % GROUP:
        raise ValueError(f"FP8 1x{GROUP} groups need the {what} to be a multiple of {GROUP}, got {k}")
