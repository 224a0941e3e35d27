"""Per-tensor scales by Group Scaling: stage 1 (partial amaxes written by the kernel that produces a tensor) and
stage 2 (their max turned into the scale), in the producing launch when it can.

A producing kernel writes one partial amax per program (`store_partial`). With FINAL it also folds its value into a
running max (an integer atomic max on the bit pattern: order-preserving for non-negative IEEE values, NaN above Inf)
and takes a ticket; the program with the last ticket turns the max into the scale and resets both words to 0 for the
next launch. The op returns a `StageOneAmax` holding the partials and, when the launch finished stage 2, the scale
and the FP8 format it is for: `finalize_scale` then returns that scale without a launch, or reduces the partials.

Scales are dequantization scales: amax / FP8_MAX in fp32; 1 when amax = 0; NaN when the tensor holds Inf/NaN (so
the GEMM that consumes it returns NaN and the step's overflow check sees it).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..formats import FP8Format, get_format
from ..triton_fp8 import nanmax
from .tiles import cdiv, next_power_of_2


class StageOneAmax(NamedTuple):
    """Partial amaxes of one tensor (fp32 [n]; NaN where a block held Inf/NaN), and the scale a launch already
    reduced them to (fp32 0-dim, for the format whose max is `fp8_max`), or None."""
    partials: torch.Tensor
    scale: torch.Tensor | None = None
    fp8_max: float | None = None


class ScaleTickets:
    """Zeroed [ticket, running max] int32 word pairs, per device, for launches that finish stage 2 themselves.
    Every such launch leaves its pair at zero again, so pairs are handed out in turn (stream order keeps a pair's
    reuse behind its reset; also across CUDA-graph replays). Rows of 4 words keep each pair 16-byte aligned, so
    Triton compiles one variant, not one per alignment. The views are made once (slicing costs host time)."""

    def __init__(self, pairs: int = 64):
        self.pairs = pairs
        self._pools: dict = {}  # device -> [words, views, next index]

    def take(self, device) -> torch.Tensor:
        pool = self._pools.get(device)
        if pool is None:
            words = torch.zeros(self.pairs, 4, dtype=torch.int32, device=device)
            pool = self._pools[device] = [words, [words[i, :2] for i in range(self.pairs)], 0]
        ticket = pool[1][pool[2] % self.pairs]
        pool[2] += 1
        return ticket


def stage_two_args(partials: torch.Tensor, fmt, tickets: ScaleTickets | None):
    """Keyword arguments for a kernel writing partials through `store_partial`, and the StageOneAmax it returns.
    fmt None: partials only; else stage 2 in the same launch for that format (tickets None: a fresh zeroed pair)."""
    n = partials.numel()
    if fmt is None:
        return dict(ticket_ptr=None, scale_ptr=None, NP=n, FP8_MAX=1.0, FINAL=False), StageOneAmax(partials)
    fmt = get_format(fmt)
    device = partials.device
    ticket = tickets.take(device) if tickets is not None else torch.zeros(4, dtype=torch.int32, device=device)[:2]
    scale = torch.empty((), dtype=torch.float32, device=device)
    return (dict(ticket_ptr=ticket, scale_ptr=scale, NP=n, FP8_MAX=fmt.max, FINAL=True),
            StageOneAmax(partials, scale, fmt.max))


@triton.jit
def store_partial(partial_ptr, idx, value, n, ticket_ptr, scale_ptr, FP8_MAX: tl.constexpr, FINAL: tl.constexpr):
    """Stage 1: this program's partial amax (value >= 0 or NaN; n = number of programs). FINAL: stage 2 in the same
    launch (see the module docstring)."""
    tl.store(partial_ptr + idx, value)
    if FINAL:
        tl.atomic_max(ticket_ptr + 1, value.to(tl.int32, bitcast=True) & 0x7FFFFFFF, sem="relaxed")
        if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == n - 1:
            mx = tl.atomic_xchg(ticket_ptr + 1, 0, sem="acq_rel").to(tl.float32, bitcast=True)
            tl.store(scale_ptr, tl.where(mx != mx, float("nan"), tl.where(mx > 0, mx / FP8_MAX, 1.0)))
            tl.atomic_xchg(ticket_ptr, 0)


@triton.jit
def reduce_scale(partial_ptr, n, FP8_MAX: tl.constexpr, NB: tl.constexpr):
    """Stage 2: fp32 scale from the n <= NB * 2048 partial amaxes (1 when all zero, NaN when any partial is NaN).
    NB is a compile-time count (the interpreter cannot loop to a run-time bound); the loop is kept rolled, so the
    tail of the kernel that hosts it stays small."""
    m = tl.zeros((2048,), tl.float32)
    for b in tl.range(NB, loop_unroll_factor=1):
        offs = b * 2048 + tl.arange(0, 2048)
        m = nanmax(m, tl.load(partial_ptr + offs, mask=offs < n, other=0.0, volatile=True))
    mx = tl.reduce(m, 0, nanmax)
    return tl.where(mx != mx, float("nan"), tl.where(mx > 0, mx / FP8_MAX, 1.0))


@triton.jit
def _finalize_scale_kernel(partial_ptr, n, scale_ptr, FP8_MAX: tl.constexpr, NB: tl.constexpr):
    tl.store(scale_ptr, reduce_scale(partial_ptr, n, FP8_MAX, NB))


def reduce_blocks(n: int) -> int:
    """NB of reduce_scale for n partials (a power of two, so few compiled variants)."""
    return next_power_of_2(cdiv(max(n, 1), 2048))


def scale_of_amax_reference(amax: torch.Tensor, nonfinite: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    scale = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))
    return torch.where(nonfinite, torch.full_like(scale, float("nan")), scale)


def finalize_scale(amax: StageOneAmax, fmt, use_triton: bool) -> torch.Tensor:
    """Stage 2: the per-tensor dequantization scale (fp32 0-dim, on the partials' device)."""
    fmt = get_format(fmt)
    if amax.scale is not None and amax.fp8_max == fmt.max:
        return amax.scale
    partials = amax.partials
    if not use_triton:
        return scale_of_amax_reference(partials.nan_to_num(0.0, 0.0, 0.0).amax(), partials.isnan().any(), fmt)
    scale = torch.empty((), dtype=torch.float32, device=partials.device)
    _finalize_scale_kernel[(1,)](partials, partials.numel(), scale, FP8_MAX=fmt.max,
                                 NB=reduce_blocks(partials.numel()), num_warps=8)
    return scale
