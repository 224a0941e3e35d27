"""One FP8 moment of many tensors dequantized and re-quantized in one call each: `MomentBatch`.

An optimizer whose update is not elementwise (Muon: Newton-Schulz over the whole matrix) cannot fuse the
(de)quantization into its step kernel; it dequantizes the momenta, updates them in torch and quantizes them back.
Done per tensor, that costs two Triton launches per tensor, or two calls of the torch reference (hundreds of small
operations each) on the CPU. A MomentBatch lays the tensors' codes and metadata end to end on their concatenated
layout (coat_kernels.optim.grouping.concat_layouts: every group stays the group it was, so the bits are those of
per-tensor calls) and runs one call over them; the kernel rows of that layout live on the device, made once, so a
step enqueues its work without waiting on the host. `batches` splits a list of layouts into runs of at most
`MAX_BATCH_NUMEL` elements, which bounds the fp32 buffers a batch holds at once.
"""
from __future__ import annotations

import torch

from . import dre_reference
from .dre_reference import DREConfig
from .grouping import GroupLayout, concat_layouts

MAX_BATCH_NUMEL = 1 << 24  # elements per batch: 64 MiB per fp32 buffer


def batches(layouts: list[GroupLayout], max_numel: int | None = None) -> list[range]:
    """Consecutive index ranges of `layouts` holding at most `max_numel` (default MAX_BATCH_NUMEL) elements each (a
    larger tensor alone)."""
    max_numel = MAX_BATCH_NUMEL if max_numel is None else max_numel
    out, start, numel = [], 0, 0
    for i, layout in enumerate(layouts):
        if i > start and numel + layout.numel > max_numel:
            out.append(range(start, i))
            start, numel = i, 0
        numel += layout.numel
    if layouts:
        out.append(range(start, len(layouts)))
    return out


class MomentBatch:
    """The (de)quantization of one moment of a fixed list of tensors (their layouts, in order) on one device, on the
    Triton kernels (`use_triton`) or the torch reference."""

    def __init__(self, layouts: list[GroupLayout], device: torch.device, use_triton: bool):
        self.layouts, self.device, self.use_triton = list(layouts), torch.device(device), use_triton
        self.layout = concat_layouts(self.layouts)
        self.rows = None
        if use_triton:
            from .dre_triton import TILE_GROUPS

            self.rows = self.layout.rows(TILE_GROUPS).to(self.device)
        self.group_counts = torch.tensor([lay.num_groups for lay in self.layouts], dtype=torch.int32,
                                         device=self.device)

    def dequantize(self, codes: list[torch.Tensor], metas: list[torch.Tensor]) -> list[torch.Tensor]:
        """fp32 values of each tensor's codes (flat, its numel; views into one buffer)."""
        codes_all = _joined(codes)
        metas_all = metas[0] if len(metas) == 1 else torch.cat(metas, dim=1)
        if self.use_triton:
            from . import dre_triton

            values = dre_triton.dequantize(codes_all, metas_all, self.layout, rows=self.rows)
        else:
            values = dre_reference.dequantize(codes_all, metas_all, self.layout)
        return self._split(values)

    def quantize(self, values: list[torch.Tensor], cfg: DREConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(codes, metadata) of each tensor's fp32 values (any shape, its numel): views into one result each. Values
        that lie end to end in one buffer (`dequantize`'s views, updated in place) are read there, not copied."""
        flat = _joined_values(values)
        if self.use_triton:
            from . import dre_triton

            codes, meta = dre_triton.quantize(flat, self.layout, cfg, rows=self.rows)
        else:
            codes, meta = dre_reference.quantize(flat, self.layout, cfg)
        return self._split(codes), self._split_groups(meta)

    def skipped(self, finite: list[torch.Tensor]) -> torch.Tensor:
        """int32 0-dim: the groups of the tensors whose flag (a 0-dim bool tensor each) is False."""
        return torch.where(torch.stack(finite), 0, self.group_counts).sum(dtype=torch.int32)

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(flat.split([lay.numel for lay in self.layouts]))

    def _split_groups(self, meta: torch.Tensor) -> list[torch.Tensor]:
        return list(meta.split([lay.num_groups for lay in self.layouts], dim=1))


def _joined_values(values: list[torch.Tensor]) -> torch.Tensor:
    """The values end to end, flat: a view when they already lie end to end in one buffer (the views `dequantize`
    returns, updated in place), else a copy."""
    first = values[0]
    total = 0
    for v in values:
        if not (v.is_contiguous() and v.dtype == first.dtype and v.device == first.device
                and v.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and v.storage_offset() == first.storage_offset() + total):
            return torch.cat([v.reshape(-1) for v in values])
        total += v.numel()
    return first.as_strided((total,), (1,))


def _joined(codes: list[torch.Tensor]) -> torch.Tensor:
    """The codes end to end (FP8 through bytes: CPU cat kernels lack FP8)."""
    if len(codes) == 1:
        return codes[0].reshape(-1)
    return torch.cat([c.reshape(-1).view(torch.uint8) for c in codes]).view(codes[0].dtype)
