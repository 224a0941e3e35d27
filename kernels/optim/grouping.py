"""Quantization groups over a flat 1-D buffer described as segments.

A segment `(flat_start, length, param_offset)` is a run of one parameter (or of a parameter's fragment inside a
ZeRO partition) that sits at `flat_start` in the buffer and starts at element `param_offset` of its parameter.
Groups of `group_size` follow the parameter's own grid (group boundaries where `param_offset % group_size == 0`),
clipped at segment ends: they never straddle two parameters, and away from cut points they are the groups a
run without partitioning would have. Elements outside every segment (ZeRO padding) belong to no group.

Groups are stored as *runs*: `(flat_start, numel, first_group)`, inside which group j starts at
`flat_start + j * group_size`. A fragment that starts mid-group contributes a one-group head run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

Segment = tuple[int, int, int]  # (flat_start, length, param_offset)


@dataclass(frozen=True)
class GroupLayout:
    numel: int
    group_size: int
    runs: tuple[tuple[int, int, int], ...]  # (flat_start, numel, first_group)
    num_groups: int

    def group_bounds(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(starts, lengths) of every group, int64, in group order."""
        starts, lengths = [], []
        g = self.group_size
        for start, n, _ in self.runs:
            k = (n + g - 1) // g
            s = start + g * torch.arange(k, dtype=torch.int64)
            starts.append(s)
            lengths.append(torch.clamp(start + n - s, max=g))
        if not starts:
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            return empty, empty.clone()
        return torch.cat(starts).to(device), torch.cat(lengths).to(device)

    def rows(self, groups_per_row: int) -> torch.Tensor:
        """Kernel work items, int64 [R, 3]: (flat_start, numel <= groups_per_row*group_size, first_group)."""
        span = groups_per_row * self.group_size
        out = []
        for start, n, first in self.runs:
            k = (n + span - 1) // span
            j = torch.arange(k, dtype=torch.int64)
            out.append(torch.stack([start + j * span, torch.clamp(n - j * span, max=span),
                                    first + j * groups_per_row], dim=1))
        return torch.cat(out) if out else torch.zeros(0, 3, dtype=torch.int64)


def normalize_segments(segments: Sequence[Segment] | torch.Tensor | None, numel: int) -> torch.Tensor:
    """Validate segments against a buffer of `numel` elements; int64 [n, 3]. None means one whole-buffer segment."""
    if segments is None:
        segments = [(0, numel, 0)] if numel > 0 else []
    seg = torch.as_tensor(segments, dtype=torch.int64).reshape(-1, 3)
    end = 0
    for flat_start, length, param_offset in seg.tolist():
        if length <= 0 or param_offset < 0 or flat_start < end:
            raise ValueError(f"segments must be ordered, non-overlapping and non-empty; got {seg.tolist()}")
        end = flat_start + length
    if end > numel:
        raise ValueError(f"segments end at {end}, past the buffer's {numel} elements")
    return seg


def build_layout(segments: Sequence[Segment] | torch.Tensor | None, numel: int, group_size: int) -> GroupLayout:
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")
    runs, first = [], 0
    for flat_start, length, param_offset in normalize_segments(segments, numel).tolist():
        head = min(length, -param_offset % group_size)
        if head:
            runs.append((flat_start, head, first))
            first += 1
        body = length - head
        if body:
            runs.append((flat_start + head, body, first))
            first += (body + group_size - 1) // group_size
    return GroupLayout(numel, group_size, tuple(runs), first)


def concat_layouts(layouts: Sequence[GroupLayout]) -> GroupLayout:
    """The layout of the buffers laid end to end (group ids follow in the same order): one reference step for many
    tensors."""
    group_size = layouts[0].group_size
    if any(lay.group_size != group_size for lay in layouts):
        raise ValueError("concatenated layouts need one group_size")
    runs, numel, groups = [], 0, 0
    for lay in layouts:
        runs += [(start + numel, n, first + groups) for start, n, first in lay.runs]
        numel, groups = numel + lay.numel, groups + lay.num_groups
    return GroupLayout(numel, group_size, tuple(runs), groups)
