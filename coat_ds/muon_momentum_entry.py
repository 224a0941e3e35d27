"""The state entry of CoatFP8Muon's Muon momentum on DeepSpeed's ZeRO-1/2 Muon path (coat_ds.muon_zero): one entry
per Muon group's flat partition, over the whole matrices that have a fragment in it, end to end in partition order.
With state_dtype "fp8" it is coat_kernels.optim.state's entry (`step`, `segments` (one per matrix), `group_size`,
`exp_avg_q`, `exp_avg_meta`), with "fp32" / "bf16" a `step` and an `exp_avg` tensor of that dtype; either way
`whole_matrices` holds the matrices' shapes (int64 [n, 2]), which a loaded entry must match (`check_entry`).
"""
from __future__ import annotations

import torch

from coat_kernels.optim import state as coat_state
from coat_kernels.optim import unquantized, validation
from coat_kernels.optim.grouping import build_layout
from coat_kernels.optim.validation import StateError

WHOLE_MATRICES = "whole_matrices"  # the entry's key for the shapes of the matrices its momentum covers


def matrix_layouts(shapes: torch.Tensor, group_size: int) -> list:
    """The quantization-group layout of each matrix (rows of `shapes`), whole, in order."""
    return [build_layout(None, int(rows) * int(cols), group_size) for rows, cols in shapes.tolist()]


def new_entry(optimizer, group: dict, shapes: torch.Tensor, device) -> dict:
    """A zero momentum over matrices of `shapes` (int64 [n, 2]) in `optimizer`'s state dtype."""
    numel = int(shapes.prod(1).sum())
    dtype = unquantized.STATE_DTYPES[optimizer.state_dtype]
    if dtype is not None:
        entry = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(numel, dtype=dtype, device=device)}
    else:
        cfg = optimizer.group_config(group)
        segments = matrix_segments(shapes)
        layout = build_layout(segments, numel, cfg.group_size)
        entry = coat_state.zero_entry(numel, segments, layout, coat_state.moment_configs(cfg, coat_state.MOMENTUM),
                                      device)
    entry[WHOLE_MATRICES] = shapes.clone()
    return entry


def check_entry(entry, shapes: torch.Tensor | None, cfg, state_dtype: str, where: str) -> None:
    """StateError unless `entry` is a momentum (or an empty entry) over whole matrices of `shapes` (None: those it
    names), in `state_dtype` (FP8 codes and metadata checked as any CoatFP8Muon entry, values scanned)."""
    if isinstance(entry, dict) and not entry:
        return
    if not isinstance(entry, dict):
        raise StateError(f"{where}: a state entry must be a dict, got {type(entry).__name__}")
    saved = entry.get(WHOLE_MATRICES)
    valid = (isinstance(saved, torch.Tensor) and saved.dtype == torch.int64 and saved.dim() == 2
             and saved.shape[1] == 2)
    shapes = saved.cpu() if shapes is None and valid else shapes
    if not valid or shapes is None or not torch.equal(saved.cpu(), shapes):
        described = saved.tolist() if isinstance(saved, torch.Tensor) else saved
        holds = shapes.tolist() if shapes is not None else "(not known)"
        raise StateError(f"{where}: the Muon momentum covers matrices {described} ({WHOLE_MATRICES}), this rank's ZeRO "
                         f"partition holds {holds}: the state belongs to another rank, data-parallel size or model")
    numel = int(shapes.prod(1).sum())
    rest = {k: v for k, v in entry.items() if k != WHOLE_MATRICES}
    if state_dtype == "fp8":
        validation.validate_entry(rest, numel, cfg, where, segments=matrix_segments(shapes),
                                  moments=coat_state.MOMENTUM)
        if not coat_state.is_coat_state(rest):
            raise StateError(f"{where}: a CoatFP8Muon (state_dtype fp8) Muon momentum needs FP8 codes, got keys "
                             f"{sorted(entry)}")
    else:
        momentum = rest.get("exp_avg")
        if not isinstance(momentum, torch.Tensor) or momentum.numel() != numel or set(rest) != {"step", "exp_avg"}:
            raise StateError(f"{where}: a CoatFP8Muon (state_dtype {state_dtype}) Muon momentum is step and exp_avg "
                             f"of {numel} elements, got {sorted(entry)}")


def matrix_segments(shapes: torch.Tensor) -> torch.Tensor:
    """One segment per matrix, end to end: (flat_start, numel, 0)."""
    numels = shapes.prod(1)
    starts = torch.cat([numels.new_zeros(1), numels.cumsum(0)[:-1]])
    return torch.stack([starts, numels, torch.zeros_like(starts)], 1)


def partition_shapes(flat: torch.Tensor, model_params) -> torch.Tensor:
    """int64 [n, 2]: the shapes of the model parameters with a fragment in `flat` (a ZeRO-1/2 flat partition), in
    partition order (DeepSpeed's `_hp_mapping`)."""
    storage = flat.untyped_storage().data_ptr()
    found = []
    for lp in model_params:
        mapping = getattr(lp, "_hp_mapping", None)
        if mapping is not None and mapping.hp_fragment.untyped_storage().data_ptr() == storage:
            found.append((int(mapping.get_hp_fragment_address().start), tuple(lp.shape)))
    return torch.tensor([shape for _, shape in sorted(found)], dtype=torch.int64).reshape(-1, 2)
