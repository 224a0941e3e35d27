"""Which parameter fragments a flat tensor handed to the optimizer by a DeepSpeed wrapper holds.

`fragment_segments(flat, lp_params)` returns `[(flat_start, length, param_offset), ...]`: the runs of `flat` that
belong to one parameter each, in flat order, padding excluded. CoatFP8AdamW builds its quantization groups per
segment on the parameter's own grid, so no group straddles two parameters.

DeepSpeed 0.19.8 internals read here (entries of coat_ds.patch_sites.INTERNALS):
- ZeRO-1/2 and BF16_Optimizer: each low-precision param overlapping the local partition has `lp._hp_mapping`, a
  `tensor_fragment` with `hp_fragment` (a narrow of the flat fp32 partition), `hp_fragment_address.start/numel`
  (partition-local) and `lp_fragment_address.start` (offset inside the parameter).
- ZeRO-3: the flat fp32 sub-group tensor has `ds_id == "<first ds_id>_<last ds_id>"`; each param of the sub-group
  holds `partition_numel()` elements of the flat tensor, in order, starting at element `rank * partition_numel()`
  of the parameter (`ds_numel` elements in all; the rest of the last shard is padding).
- FP16_UnfusedOptimizer (bf16 without ZeRO): per-parameter fp32 masters shaped like the parameters.
Anything else: one segment over the whole tensor, with a one-time warning.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch

Segment = tuple[int, int, int]

_warned: set[str] = set()


def fragment_segments(flat: torch.Tensor, lp_params: Sequence[torch.Tensor]) -> list[Segment]:
    for finder in (_hp_mapping_segments, _zero3_segments, _per_param_master_segments):
        segments = finder(flat, lp_params)
        if segments is not None:
            return segments
    _warn_once("unknown", f"CoatFP8AdamW: a tensor of {flat.numel()} elements matches no known DeepSpeed layout (no "
               "_hp_mapping, ds_id or parameter shape); its quantization groups follow one grid over the whole tensor")
    return [(0, flat.numel(), 0)]


def _hp_mapping_segments(flat, lp_params):
    """ZeRO-1/2 and BF16_Optimizer: fragments whose hp tensor is a view of `flat`."""
    storage = flat.untyped_storage().data_ptr()
    segments = []
    for lp in lp_params:
        mapping = getattr(lp, "_hp_mapping", None)
        if mapping is None or mapping.hp_fragment.untyped_storage().data_ptr() != storage:
            continue
        hp = mapping.get_hp_fragment_address()
        segments.append((int(hp.start), int(hp.numel), int(mapping.lp_fragment_address.start)))
    return sorted(segments) or None


def _zero3_segments(flat, lp_params):
    """ZeRO-3: the sub-group named by `flat.ds_id`, each param's local shard in order, padding excluded."""
    ds_id = getattr(flat, "ds_id", None)
    if not isinstance(ds_id, str) or "_" not in ds_id:
        return None
    first, last = (int(x) for x in ds_id.split("_"))
    trainable = [q for q in lp_params if q.requires_grad and hasattr(q, "ds_id")]
    ids = [q.ds_id for q in trainable]
    if first not in ids or last not in ids:
        return None
    from deepspeed import comm as dist

    segments, flat_start = [], 0
    for q in trainable[ids.index(first):ids.index(last) + 1]:
        shard = q.partition_numel()
        param_offset = dist.get_rank(group=q.ds_process_group) * shard
        valid = max(0, min(shard, q.ds_numel - param_offset))
        if valid:
            segments.append((flat_start, valid, param_offset))
        flat_start += shard
    if flat_start != flat.numel():
        _warn_once("zero3", f"CoatFP8AdamW: ZeRO-3 sub-group {ds_id} holds {flat.numel()} elements, its params' shards "
                   f"{flat_start}; grouping it as one segment")
        return [(0, flat.numel(), 0)]
    return segments


def _per_param_master_segments(flat, lp_params):
    """FP16_UnfusedOptimizer: a master copy shaped like one of the group's parameters is a whole parameter."""
    if any(flat.shape == q.shape for q in lp_params):
        return [(0, flat.numel(), 0)] if flat.numel() else []
    return None


def _warn_once(kind: str, message: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
