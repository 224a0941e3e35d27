"""Checkpoint formats of an optimizer whose state entries follow coat_kernels.optim.state, as functions over its param
groups and state (the optimizer's own class supplies what differs: how a saved group's options and an entry are
checked, how an entry's moments are exported to fp32).

- Its own state dict: torch's, checked entry by entry before anything is stored (`check_state_dict`), and loaded
  with every entry's tensors kept as saved (`load_keeping_dtypes`: torch would cast FP8 codes and fp32 metadata to
  the parameter's dtype).
- torch.optim's fp32 layout (`torch_format`): per tensor `step` and fp32 moments shaped like it, through the
  optimizer's exact export (coat_kernels.optim.exact_export), so that loading it back restores the FP8 state bit for
  bit; a master remainder travels beside them. Only copies are handed out: a dict kept while training goes on still
  holds the state it was made from.
- Pickling and copy.deepcopy (`picklable_state` / `unpickled_state`): FP8 tensors travel as uint8 (torch cannot
  unpickle FP8 storages).

Tensors are numbered as torch's state dicts number them, in param-group order (`numbered_params`).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterator

import torch

from .state import REMAINDER_KEY, is_coat_state
from .validation import StateError

# (saved param group, how errors name it) -> the options the group's entries are checked against
GroupCheck = Callable[[dict, str], object]
# (entry, tensor, group index, state-dict position, options) -> None, or StateError
EntryCheck = Callable[[dict, torch.Tensor, int, int, object], None]


def numbered_params(param_groups: list) -> Iterator[tuple[int, dict, int, torch.Tensor]]:
    """(group index, group, state-dict position, tensor) of every tensor, in state-dict order."""
    position = 0
    for index, group in enumerate(param_groups):
        for p in group["params"]:
            yield index, group, position, p
            position += 1


# ---- torch.optim's fp32 layout ---------------------------------------------------------------------------------
def torch_format(state_dict: dict, param_groups: list, fp32_moments: Callable[[torch.Tensor], dict]) -> dict:
    """`state_dict` (torch's, of the optimizer holding `param_groups`) with every FP8 entry replaced by `step`, the
    fp32 moments `fp32_moments(tensor)` gives (new tensors, flat) shaped like the tensor, and its master remainder;
    every other tensor of every entry copied."""
    params = [p for *_, p in numbered_params(param_groups)]
    for index, entry in state_dict["state"].items():
        p = params[index]
        exported, fresh = entry, {}
        if is_coat_state(entry):
            fresh = {k: v.view(p.shape) for k, v in fp32_moments(p).items()}
            exported = {"step": entry["step"], **fresh, **{k: entry[k] for k in (REMAINDER_KEY,) if k in entry}}
        state_dict["state"][index] = {k: v.clone() if isinstance(v, torch.Tensor) and k not in fresh else v
                                      for k, v in exported.items()}
    return state_dict


# ---- the optimizer's own state dict -----------------------------------------------------------------------------
def check_state_dict(state_dict, param_groups: list, check_group: GroupCheck, check_entry: EntryCheck) -> dict:
    """Raise StateError (a ValueError; ValueError where torch would) for a state dict that does not fit the optimizer
    holding `param_groups`: its groups (count, sizes, `check_group` for their options) and every entry
    (`check_entry`). Nothing is stored. Returns {saved parameter id: tensor}."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise StateError("an optimizer state dict needs 'state' and 'param_groups'")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"loaded state dict has a different number of parameter groups ({len(saved_groups)}, "
                         f"this optimizer {len(param_groups)})")
    targets, offset = {}, 0
    for index, (group, saved) in enumerate(zip(param_groups, saved_groups)):
        where = f"param group {index} of the loaded state dict"
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(f"{where} has {len(saved['params'])} parameters, this optimizer's "
                             f"{len(group['params'])}: loaded state dict contains a parameter group that doesn't "
                             "match the size of optimizer's group")
        options = check_group(saved, where)
        for position, (p, pid) in enumerate(zip(group["params"], saved["params"])):
            targets[pid] = (p, index, offset + position, options)
        offset += len(group["params"])
    for pid, entry in state_dict["state"].items():
        if pid not in targets:
            raise StateError(f"the loaded state dict holds a state for parameter id {pid!r}, which none of its param "
                             "groups lists")
        check_entry(entry, *targets[pid])
    return {pid: target[0] for pid, target in targets.items()}


def check_kept_options(state_dict: dict, param_groups: list, option_names: tuple) -> None:
    """StateError when a saved param group holding FP8 entries was saved with other COAT options (`option_names`)
    than this optimizer's group has: torch's load would put the saved options in place of the ones this run was
    given (its ds_config "params", its keyword arguments), silently. fp32 moments (torch.optim.AdamW's layout) are
    quantized at the next step and load under any options."""
    state = state_dict["state"]
    for index, (group, saved) in enumerate(zip(param_groups, state_dict["param_groups"])):
        if not any(is_coat_state(state.get(pid)) for pid in saved["params"]):
            continue
        changed = [(name, saved[name], group[name]) for name in option_names
                   if name in saved and name in group and saved[name] != group[name]]
        if changed:
            was = ", ".join(f"{name}={old!r}" for name, old, _ in changed)
            now = ", ".join(f"{name}={new!r}" for name, _, new in changed)
            keep = ", ".join(f"set {name}={old!r}" for name, old, _ in changed)
            raise StateError(
                f"param group {index} of the loaded state dict holds FP8 moments quantized with {was}; this optimizer "
                f"has {now} (its options or ds_config \"params\"). To resume, {keep}. To change them, resume with the "
                "saved values and hand each tensor's fp32 moments to an optimizer built with the new ones: "
                "new.set_fp32_moments(p, m['exp_avg'], m['exp_avg_sq'], step=...) with m = old.fp32_moments(p)")


def load_keeping_dtypes(optimizer: torch.optim.Optimizer, load: Callable[[dict], None], state_dict: dict,
                        id_to_param: dict, kept_keys: tuple) -> None:
    """`load(state_dict)` (torch's load_state_dict), then each entry's `kept_keys` put back as saved, on its tensor's
    device: torch casts floating state tensors to the parameter's dtype, which FP8 codes, fp32 metadata and
    moments must not be. Each entry gets its own fp32 step tensor (steps increment in place)."""
    originals = {pid: {k: v for k, v in entry.items() if k in kept_keys} for pid, entry in state_dict["state"].items()}
    load(state_dict)
    for pid, tensors in originals.items():
        p = id_to_param[pid]
        entry = optimizer.state[p]
        for key, value in tensors.items():
            entry[key] = value.to(p.device).contiguous() if isinstance(value, torch.Tensor) else value
        if "step" in entry:
            entry["step"] = torch.tensor(float(entry["step"]), dtype=torch.float32)


def check_entries(param_groups: list, state: dict, check_entry: EntryCheck, group_options: Callable[[dict], object]):
    """`check_entry` on every entry held for a tensor of `param_groups` (a whole optimizer that was unpickled)."""
    for index, group, position, p in numbered_params(param_groups):
        if p in state:
            check_entry(state[p], p, index, position, group_options(group))


# ---- pickling ----------------------------------------------------------------------------------------------------
class PicklableCodes:
    """An FP8 tensor as its uint8 bytes and its dtype's name."""

    def __init__(self, codes: torch.Tensor):
        self.dtype, self.raw = str(codes.dtype).removeprefix("torch."), codes.view(torch.uint8)

    def tensor(self) -> torch.Tensor:
        return self.raw.view(getattr(torch, self.dtype))


def picklable_state(attributes: dict, left_out: tuple) -> dict:
    """An optimizer's `__dict__` for pickling: without the attributes `left_out` (caches), FP8 state tensors as
    PicklableCodes."""
    out = {k: v for k, v in attributes.items() if k not in left_out}
    out["state"] = {p: {k: PicklableCodes(v) if _is_fp8(v) else v for k, v in entry.items()}
                    for p, entry in attributes["state"].items()}
    return out


def unpickled_state(pickled: dict) -> dict:
    """The inverse of `picklable_state` (also given torch's load_state_dict's {"state", "param_groups"}): the
    state as a defaultdict of entries, FP8 tensors restored."""
    return {**pickled, "state": defaultdict(dict, {p: {k: v.tensor() if isinstance(v, PicklableCodes) else v
                                                       for k, v in entry.items()}
                                                   for p, entry in pickled["state"].items()})}


def _is_fp8(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.element_size() == 1
