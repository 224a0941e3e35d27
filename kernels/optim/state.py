"""The per-parameter state entry of the COAT FP8 optimizers (CoatFP8AdamW, CoatFP8Lion, CoatFP8Muon): how it is made,
stored, converted to and from fp32 moments, recognised and counted.

An entry (one per parameter or flat partition) holds:
  step             fp32 0-dim tensor (steps taken, as torch.optim.AdamW keeps it)
  segments         int64 [n, 3]: (flat_start, length, param_offset) runs of parameters inside the tensor
  group_size       int
  exp_avg_q        FP8 codes [numel]          exp_avg_meta     fp32 [3, n_groups] (k, log2 center, log2 scale*Q)
  exp_avg_sq_q     FP8 codes [numel]          exp_avg_sq_meta  fp32 [3, n_groups]
An optimizer with one momentum (Lion, Muon) keeps exp_avg alone (`MOMENTUM`): its entry has no exp_avg_sq keys.
And, for a bf16 tensor of an optimizer with master_remainders, also
  master_remainder int16 [numel]: the low 16 bits of the fp32 master (coat_kernels.optim.master_remainders)
The entry describes itself (segments and group size give the layout), so every function here works offline on a
saved entry too. Every adapter (DeepSpeed, the universal-checkpoint tool, Megatron) goes through these functions.

An entry may also hold torch.optim.AdamW's fp32 `exp_avg` / `exp_avg_sq` (shaped like the tensor or flat), alone with
`step` (a torch-AdamW state dict) or beside the FP8 keys (DeepSpeed's universal-checkpoint loader writes them there):
they are quantized when the entry is next planned.

Entries are checked against their tensors by coat_kernels.optim.validation; checkpoint formats built on entries
(torch.optim's fp32 layout, pickling, state dicts) live in coat_kernels.optim.checkpoint.
"""
from __future__ import annotations

import warnings
from typing import Iterable

import torch

from . import dre_reference as reference
from . import exact_export, master_remainders
from .dre_reference import DREConfig
from .grouping import GroupLayout, build_layout

CODE_KEYS = ("exp_avg_q", "exp_avg_sq_q")
META_KEYS = ("exp_avg_meta", "exp_avg_sq_meta")
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's two moments
MOMENTUM = ("exp_avg",)  # the one momentum of Lion and Muon
ENTRY_KEYS = ("step", "segments", "group_size") + CODE_KEYS + META_KEYS
REMAINDER_KEY = "master_remainder"


def is_coat_state(entry) -> bool:
    """True for a COAT FP8 entry (live or saved): FP8 codes with their segments."""
    return isinstance(entry, dict) and "exp_avg_q" in entry and "segments" in entry


def entry_keys(moments: tuple[str, ...] = MOMENTS) -> tuple[str, ...]:
    """The keys of an entry holding `moments` in FP8."""
    return ("step", "segments", "group_size") + tuple(m + "_q" for m in moments) + tuple(m + "_meta" for m in moments)


def moment_configs(cfg, moments: tuple[str, ...] = MOMENTS) -> dict[str, DREConfig]:
    """{moment: its quantizer} under the options `cfg` (an OptimizerConfig): exp_avg's and exp_avg_sq's."""
    return {name: c for name, c in zip(MOMENTS, cfg.moment_configs()) if name in moments}


def needs_remainder(cfg, param_dtype) -> bool:
    """Whether a tensor of `param_dtype` keeps a master remainder in its entry under the options `cfg`."""
    return bool(cfg.master_remainders) and param_dtype == torch.bfloat16


def zero_remainder(numel: int, device) -> torch.Tensor:
    """The remainder of a master equal to its bf16 parameter (a fresh state starts there)."""
    return torch.zeros(numel, dtype=master_remainders.REMAINDER_DTYPE, device=device)


def layout_of(entry: dict) -> GroupLayout:
    return build_layout(entry["segments"], entry["exp_avg_q"].numel(), int(entry["group_size"]))


def zero_meta(num_groups: int, device) -> torch.Tensor:
    """Metadata of all-zero groups: k = 1, everything else 0 (their codes 0 decode to exact zeros)."""
    meta = torch.zeros(3, num_groups, dtype=torch.float32, device=device)
    meta[0] = 1.0  # k; rows as in dre_reference.META_ROWS
    return meta


def zero_state(numel: int, segments: torch.Tensor, layout: GroupLayout, m_cfg: DREConfig, v_cfg: DREConfig,
               device, step: float = 0.0) -> dict:
    """Zero AdamW moments: codes 0 with k = 1 (they dequantize to exact zeros)."""
    return zero_entry(numel, segments, layout, {"exp_avg": m_cfg, "exp_avg_sq": v_cfg}, device, step)


def zero_entry(numel: int, segments: torch.Tensor, layout: GroupLayout, configs: dict[str, DREConfig], device,
               step: float = 0.0) -> dict:
    """An entry whose moments (the keys of `configs`, with their quantizers) are zero: codes 0 with k = 1."""
    entry = {"step": torch.tensor(float(step), dtype=torch.float32), "segments": segments.clone(),
             "group_size": layout.group_size}
    for moment, cfg in configs.items():
        entry[moment + "_q"] = torch.zeros(numel, dtype=cfg.fmt.dtype, device=device)
        entry[moment + "_meta"] = zero_meta(layout.num_groups, device)
    return entry


def commit(state: dict, update: dict) -> None:
    """Store a new or re-quantized FP8 state in an entry (in place: engines may hold the entry), dropping the fp32
    moments it was made from."""
    for key in MOMENTS:  # those of every optimizer: MOMENTUM is exp_avg
        state.pop(key, None)
    state.update(update)


def stored_tensors(state: dict):
    """(dtype, shape, device) of an entry's codes and metadata: compared on every step, O(1)."""
    try:
        if "exp_avg_q" not in state:
            return None
        tensors = [state[k] for k in CODE_KEYS + META_KEYS if k in state]
        if REMAINDER_KEY in state:
            tensors.append(state[REMAINDER_KEY])
        return tuple((t.dtype, t.shape, t.device) for t in tensors)
    except (KeyError, AttributeError):
        return None


def quantize_moment(x: torch.Tensor, layout: GroupLayout, cfg: DREConfig, use_kernel: bool):
    """fp32 moment (any shape, layout.numel elements) -> (codes, meta). NaN/Inf values are an error: the state
    cannot represent them (a step with such gradients skips their groups instead)."""
    x = x.detach().reshape(-1).to(torch.float32)
    if x.numel() != layout.numel:
        raise ValueError(f"a moment of {x.numel()} elements does not fit a state of {layout.numel}")
    bad = ~torch.isfinite(x)
    if bad.any():
        raise ValueError(f"cannot quantize a moment holding {int(bad.sum())} NaN/Inf values (first at element "
                         f"{int(bad.nonzero()[0, 0])}): the checkpoint or the values given are corrupt")
    if use_kernel:
        from . import dre_triton
        return dre_triton.quantize(x, layout, cfg)
    return reference.quantize(x, layout, cfg)


def from_fp32(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, layout: GroupLayout, m_cfg: DREConfig,
              v_cfg: DREConfig, use_kernel: bool = False) -> dict:
    """The code and metadata tensors of fp32 moments (finite; second moments >= 0)."""
    negative = exp_avg_sq.detach() < 0
    if negative.any():
        raise ValueError(f"cannot quantize a second moment holding {int(negative.sum())} negative values (first at "
                         f"element {int(negative.reshape(-1).nonzero()[0, 0])}): the checkpoint or the values given "
                         "are corrupt")
    return quantize_moments({"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, layout,
                            {"exp_avg": m_cfg, "exp_avg_sq": v_cfg}, use_kernel)


def quantize_moments(values: dict[str, torch.Tensor], layout: GroupLayout, configs: dict[str, DREConfig],
                     use_kernel: bool = False) -> dict:
    """The code and metadata tensors of fp32 moments {moment: values} (finite) with their quantizers `configs`."""
    out = {}
    for key, value in values.items():
        out[key + "_q"], out[key + "_meta"] = quantize_moment(value, layout, configs[key], use_kernel)
    return out


def to_fp32(entry: dict, m_cfg: DREConfig, v_cfg: DREConfig | None = None) -> dict:
    """fp32 {"exp_avg", "exp_avg_sq"} (flat; exp_avg alone for an entry of one momentum) of one live or saved entry
    quantized with these configs, such that `from_fp32` (`quantize_moments`) on the same layout gives the entry's
    codes and metadata back (coat_kernels.optim.exact_export)."""
    layout = layout_of(entry)
    out = {}
    for key, cfg in zip(MOMENTS, (m_cfg, v_cfg)):
        if key + "_q" not in entry:
            continue
        codes, meta = entry[key + "_q"], entry[key + "_meta"]
        out[key], failed = exact_export.export(codes, meta.to(codes.device), layout, cfg)
        if failed:
            warnings.warn(f"{failed} of {layout.num_groups} {key} groups have no fp32 values that quantize back to "
                          "their codes and metadata; they are exported as their decoded values, which quantize to "
                          "nearby codes: a run resumed from these fp32 moments departs slightly from the saved one",
                          RuntimeWarning, stacklevel=2)
    return out


def config_of(group: dict):
    """The OptimizerConfig of a saved param group (its COAT options; defaults where absent)."""
    from .config import GROUP_OPTION_NAMES, OptimizerConfig

    return OptimizerConfig(**{k: group[k] for k in GROUP_OPTION_NAMES if k in group})


def moment_configs_of(group: dict) -> tuple[DREConfig, DREConfig]:
    """The (exp_avg, exp_avg_sq) quantizers of a saved param group (its COAT options; defaults where absent)."""
    return config_of(group).moment_configs()


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a state tensor holds: a quantized tensor subclass whose nominal dtype is not what it stores
    (TransformerEngine's Float8Tensor) is counted by the tensors inside it."""
    inner = [x for x in (getattr(t, name, None) for name in ("_data", "_transpose", "_scale_inv"))
             if isinstance(x, torch.Tensor)]
    if inner:
        return sum(x.numel() * x.element_size() for x in inner)
    return t.numel() * t.element_size()


def entry_bytes(entry: dict) -> int:
    return sum(tensor_bytes(t) for t in entry.values() if isinstance(t, torch.Tensor))


def state_report(optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]) -> dict:
    """Optimizer-state bytes (every state tensor: moments, their metadata, master remainders or master copies,
    steps) against the elements of the tensors that hold a state, over one process's torch optimizer or optimizers
    (CoatFP8AdamW or any other, TransformerEngine's FusedAdam with FP8 moments included)."""
    optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    state_bytes = sum(entry_bytes(s) for opt in optimizers for s in opt.state.values())
    numel = sum(p.numel() for opt in optimizers for p in opt.state)
    names = "+".join(sorted({type(opt).__name__ for opt in optimizers}))
    return {"optimizer": names, "state_bytes": state_bytes, "stepped_numel": numel,
            "bytes_per_element": state_bytes / max(numel, 1)}
