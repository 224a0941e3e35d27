"""CoatFP8Muon's step around Newton-Schulz as Triton kernels.

`MomentumBatch.step`, two launches for a list of matrices: one marks the matrices whose gradient holds NaN/Inf; one,
per row of quantization groups, dequantizes the FP8 momentum, computes m = lerp(m, g, 1 - momentum), writes the
update Newton-Schulz starts from (lerp(g, m, momentum) with Nesterov, else m) rounded to bf16 (Newton-Schulz's first
operation, `update.bfloat16()`) into one buffer for the list, and re-quantizes m with Dynamic Range Expansion in
place, unless the matrix was marked. One pass over the codes and the gradient instead of dequantize, two torch lerps
and quantize, each a pass of its own over fp32 buffers, and two launches however many matrices there are.

`apply_update_`, one launch per matrix: p = p (1 - lr wd) - lr' O with O the orthogonalised update, torch.optim.Muon's
`p.mul_(...)` and `p.add_(O, alpha=-lr')` in one pass (torch's arithmetic: the product rounded to p's dtype, then one
fused multiply-add), writing nothing when the matrix's gradient was not finite.

The lerps are torch's (ATen's `lerp`, a single fused multiply-add after one subtraction, as the CPU's vectorized
kernel and nvcc's contraction of the CUDA kernel compute it): for a weight w below 0.5, fma(w, end - self, self),
else fma(w - 1, end - self, end), with w the weight rounded to fp32. The momentum's (de)quantization is dre_triton's
group decoder and encoder. A matrix whose gradient holds NaN/Inf keeps its codes, its metadata and its parameter:
the whole matrix is skipped, as Newton-Schulz mixes all of it. No host synchronisation.
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from ..portable_math import fma_p, to_bf16_p, to_dtype_p
from ..triton_fp8 import nanmax
from .dre_reference import DREConfig, f32
from .dre_triton import (TILE_GROUPS, _TRITON_DTYPES, _decode_group_tile, _encode_group_tile, _moment_args, _ptr,
                         _row_tile, rows_for)
from .grouping import GroupLayout

# A launch row: (matrix, flat_start, numel, first_group, start in the batch's update buffer).
ROW_COLUMNS: tl.constexpr = tl.constexpr(5)
# Per matrix: gradient, codes and metadata pointers, number of groups.
TABLE_COLUMNS: tl.constexpr = tl.constexpr(4)


@triton.jit
def _lerp(start, end, weight, weight_minus_one, SMALL: tl.constexpr):
    if SMALL:
        return fma_p(weight, end - start, start)
    return fma_p(weight_minus_one, end - start, end)


@triton.jit
def _finite_flags_kernel(rows, table, flags, G_DTYPE: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr):
    """flags[matrix] = 0 where a row of the matrix's gradient holds NaN/Inf (flags start at 1)."""
    row = rows + tl.program_id(0) * ROW_COLUMNS
    t = tl.load(row)
    start, local, mask, gid, gmask = _row_tile(row + 1, GROUP, NG)
    g = tl.load(_ptr(table + t * TABLE_COLUMNS, 0, G_DTYPE, False) + start + local, mask=mask, other=0.0)
    bad = tl.sum(tl.sum((mask & ~(tl.abs(g.to(tl.float32)) < float("inf"))).to(tl.int32), axis=1), axis=0)
    tl.store(flags + t, 0, mask=bad > 0)


@triton.jit
def _muon_momentum_kernel(rows, table, flags, update_ptr, log2_table, w_m, w_m_minus_one, w_u, w_u_minus_one,
                          G_DTYPE: tl.constexpr, SMALL_M: tl.constexpr, SMALL_U: tl.constexpr,
                          NESTEROV: tl.constexpr, E5M2: tl.constexpr, EXPAND: tl.constexpr, LOG2_MAX: tl.constexpr,
                          NUM: tl.constexpr, INV_EMIN: tl.constexpr, KMAX: tl.constexpr, KEEP_NONZERO: tl.constexpr,
                          MIN_SUB: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr):
    row = rows + tl.program_id(0) * ROW_COLUMNS
    t = tl.load(row)
    tab = table + t * TABLE_COLUMNS
    codes_ptr = _ptr(tab, 1, tl.uint8, False)
    meta = _ptr(tab, 2, tl.float32, False)
    n_groups = tl.load(tab + 3)
    start, local, mask, gid, gmask = _row_tile(row + 1, GROUP, NG)
    g = tl.load(_ptr(tab, 0, G_DTYPE, False) + start + local, mask=mask, other=0.0).to(tl.float32)
    m = _decode_group_tile(tl.load(codes_ptr + start + local, mask=mask, other=0), meta, n_groups, gid, gmask,
                           log2_table, LOG2_MAX)
    m = _lerp(m, g, w_m, w_m_minus_one, SMALL_M)
    if NESTEROV:
        update = _lerp(g, m, w_u, w_u_minus_one, SMALL_U)
    else:
        update = m
    tl.store(update_ptr + tl.load(row + 4) + local, to_bf16_p(update), mask=mask)
    finite = tl.load(flags + t) != 0
    mask = mask & finite
    gmask = gmask & finite
    m_abs = tl.where(mask, tl.abs(m), 0.0)
    big = tl.reduce(m_abs, 1, nanmax)
    _encode_group_tile(m, m_abs, big, mask, codes_ptr + start + local, meta, n_groups, gid, gmask, E5M2, EXPAND,
                       LOG2_MAX, NUM, INV_EMIN, KMAX, KEEP_NONZERO, MIN_SUB)


class MomentumBatch:
    """The momentum step of a fixed list of Muon matrices (their layouts, in order, one group size) on one device:
    two launches for all of them. The rows are built once; the pointer table is rebuilt (and copied without a host
    synchronisation) when a gradient or state tensor moves."""

    def __init__(self, layouts: list[GroupLayout], device: torch.device):
        self.layouts, self.device = list(layouts), torch.device(device)
        if len({layout.group_size for layout in self.layouts}) != 1:
            raise ValueError("one MomentumBatch needs one group_size")
        ends = list(itertools.accumulate(layout.numel for layout in self.layouts))
        self.offsets, self.total = [0] + ends[:-1], ends[-1] if ends else 0
        rows = rows_for(self.layouts, TILE_GROUPS)
        update_start = torch.tensor(self.offsets, dtype=torch.int64)[rows[:, 0]] + rows[:, 1]
        self.rows = torch.cat([rows, update_start[:, None]], dim=1).contiguous().to(self.device)
        self.num_groups = torch.tensor([layout.num_groups for layout in self.layouts], dtype=torch.int32,
                                       device=self.device)
        self._table_key, self._table = None, None

    def _pointer_table(self, grads, codes, metas) -> torch.Tensor:
        key = tuple(t.data_ptr() for column in (grads, codes, metas) for t in column)
        if key != self._table_key:
            n = len(self.layouts)
            columns = [key[:n], key[n:2 * n], key[2 * n:], [layout.num_groups for layout in self.layouts]]
            host = torch.tensor(columns, dtype=torch.int64).t().contiguous()
            if self.device.type == "cuda":
                host = host.pin_memory()
            self._table, self._table_key = host.to(self.device, non_blocking=True), key
        return self._table

    def step(self, grads: list[torch.Tensor], codes: list[torch.Tensor], metas: list[torch.Tensor], momentum: float,
             nesterov: bool, cfg: DREConfig) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(the bf16 updates Newton-Schulz starts from, each shaped like its gradient; flags, uint8 [n]: 0 for a
        matrix whose gradient holds NaN/Inf, whose codes and metadata are then left as they were). Every other
        matrix's FP8 momentum is stepped in place."""
        if len(grads) != len(self.layouts) or any(g.numel() != layout.numel for g, layout in zip(grads, self.layouts)):
            raise ValueError(f"gradients of {[g.numel() for g in grads]} elements for momentum layouts of "
                             f"{[layout.numel for layout in self.layouts]}")
        if len({g.dtype for g in grads}) != 1 or grads[0].dtype not in _TRITON_DTYPES:
            raise TypeError(f"one launch steps gradients of one dtype (float32, bfloat16, float16), got "
                            f"{sorted({str(g.dtype) for g in grads})}")
        grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
        codes = [c.view(torch.uint8) for c in codes]
        flags = torch.ones(len(grads), dtype=torch.uint8, device=self.device)
        update = torch.empty(self.total, dtype=torch.bfloat16, device=self.device)
        if len(self.rows):
            table = self._pointer_table(grads, codes, metas)
            grid, g_dtype, group = (len(self.rows),), _TRITON_DTYPES[grads[0].dtype], self.layouts[0].group_size
            _finite_flags_kernel[grid](self.rows, table, flags, G_DTYPE=g_dtype, GROUP=group, NG=TILE_GROUPS)
            w_m, w_u = f32(1 - momentum), f32(momentum)
            _muon_momentum_kernel[grid](
                self.rows, table, flags, update, cfg.fmt.log2_table(self.device), w_m, f32(w_m - 1), w_u,
                f32(w_u - 1), G_DTYPE=g_dtype, SMALL_M=abs(w_m) < 0.5, SMALL_U=abs(w_u) < 0.5, NESTEROV=nesterov,
                GROUP=group, NG=TILE_GROUPS, enable_fp_fusion=False, **_moment_args(cfg))
        updates = [update[o:o + g.numel()].view(g.shape) for o, g in zip(self.offsets, grads)]
        return updates, flags

    def skipped(self, flags: torch.Tensor) -> torch.Tensor:
        """The groups of the matrices `flags` marks non-finite (int32, 0-dim, on the device)."""
        return ((1 - flags.int()) * self.num_groups).sum(dtype=torch.int32)


@triton.jit
def _apply_update_kernel(p_ptr, u_ptr, finite_ptr, rows, cols, sp0, sp1, su0, su1, decay, alpha,
                         P_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)[None, :]
    mask = (r < rows) & (c < cols) & (tl.load(finite_ptr) != 0)
    p = tl.load(p_ptr + r * sp0 + c * sp1, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * su0 + c * su1, mask=mask, other=0.0).to(tl.float32)
    decayed = to_dtype_p(p * decay, P_DTYPE).to(tl.float32)
    tl.store(p_ptr + r * sp0 + c * sp1, to_dtype_p(fma_p(alpha, u, decayed), P_DTYPE), mask=mask)


APPLY_BLOCK = 64  # rows and columns per program of apply_update_


def apply_update_(p: torch.Tensor, orthogonal: torch.Tensor, decay: float, lr: float, finite: torch.Tensor) -> None:
    """p = p * decay - lr * orthogonal in place (2-D, any strides; orthogonal in bf16, as Newton-Schulz returns it),
    as `p.mul_(decay).add_(orthogonal, alpha=-lr)` computes it, unless `finite` (0-dim bool or uint8 on the
    device) is False / 0."""
    if p.dim() != 2 or orthogonal.shape != p.shape:
        raise ValueError(f"update of shape {tuple(orthogonal.shape)} for a parameter of shape {tuple(p.shape)}")
    if p.dtype not in _TRITON_DTYPES:
        raise TypeError(f"parameters in {p.dtype} are not supported (float32, bfloat16, float16)")
    rows, cols = p.shape
    if not rows or not cols:
        return
    grid = (-(-rows // APPLY_BLOCK), -(-cols // APPLY_BLOCK))
    _apply_update_kernel[grid](p, orthogonal, finite.reshape(1).view(torch.uint8), rows, cols, *p.stride(),
                               *orthogonal.stride(), f32(decay), f32(-lr), P_DTYPE=_TRITON_DTYPES[p.dtype],
                               BLOCK_R=APPLY_BLOCK, BLOCK_C=APPLY_BLOCK, enable_fp_fusion=False)
