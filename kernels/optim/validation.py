"""Checks of the COAT FP8 optimizers' state entries (format: coat_kernels.optim.state) against the tensors they belong
to. `moments` names the moments an entry holds: AdamW's two (the default, state.MOMENTS) or one momentum
(state.MOMENTUM: Lion, Muon).

`validate_entry` checks an entry against its tensor and its param group's options before it is stored or stepped
(`StateError` names the tensor, the key and what is wrong); its three parts, `entry_layout` (segments and group
size, O(segments)), `check_tensors` (keys, dtypes, shapes, step: O(1)) and `scan_values` (every value: O(numel)),
are also run alone where a full scan would cost too much (a step checks shapes, a load scans). A step also checks
its tensors and gradients (`check_param_and_grad`), that each entry describes its very tensor with the group's options
(`check_state_fits`) and every live step count (`step_count`); a param group being added may not list a tensor twice
(`check_distinct_tensors`).
"""
from __future__ import annotations

import math
import numbers

import torch

from . import dre_reference as reference
from . import master_remainders
from .grouping import GroupLayout, build_layout, normalize_segments
from .state import ENTRY_KEYS, MOMENTS, REMAINDER_KEY, entry_keys, is_coat_state, moment_configs, needs_remainder

LOG2_LIMIT = 160.0  # |log2| of a group's decoded extremes: fp32 values lie within 2^-149 .. 2^128
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PARAM_DTYPES = (torch.float32, torch.bfloat16)


class StateError(ValueError):
    """An optimizer state entry that does not fit its tensor or holds values no step can use: the checkpoint is
    damaged, was edited or converted wrongly, or belongs to another model, partition or param group."""


def validate_entry(entry, numel: int, cfg, where: str, segments=None, scan: bool = True,
                   param_dtype=None, moments: tuple[str, ...] = MOMENTS) -> GroupLayout | None:
    """Check one state entry against the tensor it belongs to (`numel` elements) and its param group's COAT options
    (`cfg`, an OptimizerConfig): every key, dtype and shape; segments (equal to `segments`, the runs this optimizer
    gives the tensor, when given) and group size; with `scan`, every value too (`scan_values`). Raises StateError
    naming `where` (the tensor), the key and the problem. Returns the entry's layout (None for an entry without FP8
    codes: an empty one, or one holding torch.optim.AdamW's fp32 moments).

    Accepted: an empty entry, or one holding only the segments its state is to have; a CoatFP8AdamW entry
    (ENTRY_KEYS), possibly with fp32 moments beside it; a torch.optim.AdamW entry (step, exp_avg, exp_avg_sq, and
    possibly segments) without amsgrad. Either may hold a master remainder (int16, one per element): with
    `param_dtype` given, only when `needs_remainder(cfg, param_dtype)`; an entry without one while the tensor needs
    one is accepted (its master starts at the bf16 parameter, as a fresh state does)."""
    if not isinstance(entry, dict):
        raise StateError(f"{where}: a state entry must be a dict, got {type(entry).__name__}")
    _check_keys(entry, where, moments)
    if "step" in entry:
        check_step(entry["step"], where)
    layout = None
    if is_coat_state(entry):
        layout = entry_layout(entry, numel, where, segments)
        check_tensors(entry, layout, cfg, where, moments=moments)
    elif "segments" in entry:
        entry_layout({"group_size": cfg.group_size, **entry}, numel, where, segments)
    if any(m in entry for m in moments):
        _check_fp32_moments(entry, numel, where, moments)
    if REMAINDER_KEY in entry:
        check_remainder(entry[REMAINDER_KEY], numel, where)
        if param_dtype is not None and not needs_remainder(cfg, param_dtype):
            reason = ("the optimizer's master_remainders is off: turn it on to resume exactly, or drop the remainders "
                      "(the bf16 parameters then become the masters)") if param_dtype == torch.bfloat16 else \
                f"the tensor is {param_dtype}, its own master: only bf16 tensors keep remainders"
            raise StateError(f"{where}: the entry holds {REMAINDER_KEY} (saved with master_remainders on a bf16 "
                             f"tensor) but {reason}")
    if scan:
        scan_values(entry, layout, cfg, where, moments)
    return layout


def entry_layout(entry: dict, numel: int, where: str, segments=None) -> GroupLayout:
    """The layout of a CoatFP8AdamW entry for a tensor of `numel` elements: its segments must be a valid int64
    [n, 3] table within the tensor (equal to `segments` when given) and its group size a positive int."""
    group_size = entry["group_size"]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise StateError(f"{where}: group_size must be a positive int, got {group_size!r}")
    table = entry["segments"]
    if not isinstance(table, torch.Tensor) or table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != 3:
        described = f"{table.dtype} {tuple(table.shape)}" if isinstance(table, torch.Tensor) else type(table).__name__
        raise StateError(f"{where}: segments must be an int64 tensor [n, 3] (flat_start, length, param_offset), "
                         f"got {described}")
    try:
        layout = build_layout(table.cpu(), numel, group_size)
    except ValueError as exc:
        raise StateError(f"{where}: segments do not fit a tensor of {numel} elements ({exc})") from None
    if segments is not None:
        expected = normalize_segments(segments, numel)
        if not torch.equal(table.cpu(), expected):
            raise StateError(f"{where}: segments {_short(table.tolist())} differ from this tensor's "
                             f"{_short(expected.tolist())}: the state belongs to another partition (another rank's "
                             "checkpoint shard, another data-parallel size or ZeRO stage) or to another model")
    return layout


def check_tensors(entry: dict, layout: GroupLayout, cfg, where: str, device=None,
                  moments: tuple[str, ...] = MOMENTS) -> None:
    """O(1): the FP8 codes and metadata of a CoatFP8AdamW entry have the dtypes of the group's formats and the shapes
    of `layout` (codes [numel], metadata fp32 [3, n_groups]), on `device` when given; the step is a finite count."""
    check_step(entry.get("step"), where)
    if layout.group_size != cfg.group_size:
        raise StateError(f"{where}: the state was quantized in groups of {layout.group_size}, the param group's "
                         f"group_size is {cfg.group_size}")
    for moment, fmt_cfg in moment_configs(cfg, moments).items():
        codes, meta = entry.get(moment + "_q"), entry.get(moment + "_meta")
        if not isinstance(codes, torch.Tensor):
            raise StateError(f"{where}: {moment}_q must be a tensor, got {type(codes).__name__}")
        if codes.dtype != fmt_cfg.fmt.dtype:
            hint = (" (FP8 codes converted to another dtype)" if codes.dtype not in (torch.float8_e4m3fn,
                                                                                     torch.float8_e5m2) else "")
            raise StateError(f"{where}: {moment}_q holds {codes.dtype}, the param group's {moment}_format is "
                             f"{fmt_cfg.fmt.name} ({fmt_cfg.fmt.dtype}){hint}")
        if tuple(codes.shape) != (layout.numel,):
            raise StateError(f"{where}: {moment}_q has shape {tuple(codes.shape)}, the tensor needs ({layout.numel},)")
        if not isinstance(meta, torch.Tensor):
            raise StateError(f"{where}: {moment}_meta must be a tensor, got {type(meta).__name__}")
        if meta.dtype != torch.float32 or tuple(meta.shape) != (3, layout.num_groups):
            raise StateError(f"{where}: {moment}_meta is {meta.dtype} {tuple(meta.shape)}, the tensor's "
                             f"{layout.num_groups} quantization groups need torch.float32 (3, {layout.num_groups})")
        for key, t in ((moment + "_q", codes), (moment + "_meta", meta)):
            if device is not None and t.device != device:
                raise StateError(f"{where}: {key} is on {t.device}, the tensor on {device}")


def check_distinct_tensors(params: list, param_groups: list) -> None:
    """The tensors of a param group to be added appear once in it and in no earlier group (ValueError, as
    torch.optim raises for the latter): an optimizer keeps one state entry per tensor and steps it once."""
    index, first = len(param_groups), {}
    for position, p in enumerate(params):
        if id(p) in first:
            shape = f" of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else ""
            raise ValueError(f"a tensor{shape} appears twice in param group {index} (positions {first[id(p)]} and "
                             f"{position}): it would be stepped twice per step; list it once")
        first[id(p)] = position
    for earlier, group in enumerate(param_groups):
        for position, q in enumerate(group["params"]):
            if id(q) in first:
                raise ValueError(f"param group {index} lists a tensor of param group {earlier} (its position "
                                 f"{position} there): some parameters appear in more than one parameter group")


def check_remainder(remainder, numel: int, where: str, device=None) -> None:
    """O(1): a master remainder is an int16 tensor of the tensor's numel elements (any bit pattern is valid)."""
    if not isinstance(remainder, torch.Tensor) or remainder.dtype != master_remainders.REMAINDER_DTYPE or \
            remainder.numel() != numel:
        hint = (" (torch.optim.AdamW's load_state_dict casts every state tensor to the parameter's dtype, which "
                "loses the remainders: drop the key to start the masters at the parameters)"
                if isinstance(remainder, torch.Tensor) and remainder.is_floating_point() else "")
        raise StateError(f"{where}: {REMAINDER_KEY} must be an int16 tensor of {numel} elements (the low halves of "
                         f"the fp32 master), got {_described(remainder)}{hint}")
    if device is not None and remainder.device != device:
        raise StateError(f"{where}: {REMAINDER_KEY} is on {remainder.device}, the tensor on {device}")


def check_step(step, where: str) -> None:
    """A step count: a finite number >= 0 (a Python number or a one-element tensor)."""
    step_count(step, where)


def step_count(step, where: str) -> float:
    """The value of a step count (a finite number >= 0: a Python number or a one-element tensor)."""
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_complex():
        value = float(step)
    elif isinstance(step, (int, float)) and not isinstance(step, bool):
        value = float(step)
    else:
        raise StateError(f"{where}: step must be a number or a one-element tensor, got {_described(step)}")
    if not (value >= 0 and math.isfinite(value)):
        raise StateError(f"{where}: step is {value}, not a finite count >= 0")
    return value


def scan_values(entry: dict, layout: GroupLayout | None, cfg, where: str, moments: tuple[str, ...] = MOMENTS) -> None:
    """O(numel): FP8 codes that are not NaN, second-moment codes that are not negative, metadata that is finite with
    k in [1 / expand_min, k_max] and decoded extremes within fp32's range; fp32 moments that are finite, second
    moments not negative. Run once per load."""
    if layout is not None:
        for moment, fmt_cfg in moment_configs(cfg, moments).items():
            _scan_codes(entry[moment + "_q"], moment, fmt_cfg.fmt, where)
            _scan_meta(entry[moment + "_meta"], moment, fmt_cfg, layout, where)
    for moment in moments:
        if moment in entry:
            _scan_fp32(entry[moment], moment, where)


def _check_keys(entry: dict, where: str, moments: tuple[str, ...] = MOMENTS) -> None:
    if moments != MOMENTS:
        return _check_momentum_keys(entry, where, moments)
    keys = set(entry)
    if "max_exp_avg_sq" in keys:
        raise StateError(f"{where}: the entry holds max_exp_avg_sq, the state of AdamW with amsgrad=True; "
                         "CoatFP8AdamW has no amsgrad: continue that run with torch.optim.AdamW")
    keys.discard(REMAINDER_KEY)  # checked by validate_entry
    unknown = sorted(keys - set(ENTRY_KEYS) - set(MOMENTS), key=str)
    if unknown:
        raise StateError(f"{where}: unknown state key(s) {unknown}: not a CoatFP8AdamW or torch.optim.AdamW state "
                         f"(CoatFP8AdamW keys: {', '.join(ENTRY_KEYS)}, {REMAINDER_KEY}; AdamW keys: step, exp_avg, "
                         "exp_avg_sq)")
    moments = keys & set(MOMENTS)
    if keys <= {"segments"}:
        return  # no state yet (perhaps the segments the state made at the first step is to have)
    fp8 = keys & (set(ENTRY_KEYS) - {"step", "segments"})
    missing = sorted((set(ENTRY_KEYS) if fp8 else {"step", *MOMENTS}) - keys)
    if missing:
        raise StateError(f"{where}: the state entry lacks {missing} (it holds {sorted(keys)})")
    if moments and moments != set(MOMENTS):
        raise StateError(f"{where}: the state entry holds {sorted(moments)} but needs both exp_avg and exp_avg_sq")


def _check_momentum_keys(entry: dict, where: str, moments: tuple[str, ...]) -> None:
    """_check_keys for an entry of one momentum (Lion, Muon): its FP8 keys, or `step` and the fp32 momentum."""
    keys = set(entry) - {REMAINDER_KEY}
    fp8_keys = set(entry_keys(moments))
    unknown = sorted(keys - fp8_keys - set(moments), key=str)
    if unknown:
        raise StateError(f"{where}: unknown state key(s) {unknown}: not a state of this optimizer (its keys: "
                         f"{', '.join(sorted(fp8_keys))}; or step with the fp32 {', '.join(moments)})")
    if keys <= {"segments"}:
        return
    missing = sorted((fp8_keys if keys & (fp8_keys - {"step", "segments"}) else {"step", *moments}) - keys)
    if missing:
        raise StateError(f"{where}: the state entry lacks {missing} (it holds {sorted(keys)})")


def _check_fp32_moments(entry: dict, numel: int, where: str, moments: tuple[str, ...] = MOMENTS) -> None:
    for moment in moments:
        value = entry[moment]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.element_size() < 2:
            raise StateError(f"{where}: {moment} must be a floating-point tensor (fp32 moments of torch AdamW), got "
                             f"{_described(value)}")
        if value.numel() != numel:
            raise StateError(f"{where}: {moment} has {value.numel()} elements {tuple(value.shape)}, the tensor "
                             f"{numel}")


def _max_code(fmt) -> int:
    """The largest finite code's byte (0x7E for e4m3, 0x7B for e5m2): larger magnitudes are NaN (or Inf)."""
    return int(torch.tensor(fmt.max).to(fmt.dtype).view(torch.uint8))


def _scan_codes(codes: torch.Tensor, moment: str, fmt, where: str) -> None:
    """Two reductions, no temporaries: codes are finite where no byte's magnitude exceeds the largest finite code,
    and second-moment codes are never negative (-0, 0x80, decodes to -0.0: harmless)."""
    raw, max_code = codes.view(torch.uint8), _max_code(fmt)
    if raw.numel() == 0:
        return
    second = moment == "exp_avg_sq"
    # int8 view: the positive codes' largest byte; uint8 view: the negative codes' largest byte
    if int(raw.view(torch.int8).amax()) <= max_code and int(raw.amax()) <= (0x80 if second else 0x80 | max_code):
        return
    bad = ((raw > max_code) & (raw != 0x80)) if second else ((raw & 0x7F) > max_code)
    first = int(bad.nonzero()[0, 0])
    what = "negative or non-finite (NaN) codes" if second else "non-finite (NaN) codes"
    raise StateError(f"{where}: {moment}_q holds {int(bad.sum())} {what} (first at element {first}, byte "
                     f"0x{int(raw[first]):02X}; {fmt.name} codes above 0x{max_code:02X} are not finite"
                     f"{', and second moments are never negative' if second else ''}): the codes are damaged")


def _scan_meta(meta: torch.Tensor, moment: str, fmt_cfg, layout: GroupLayout, where: str) -> None:
    k, log2_center, log2_scale_q = meta.float()
    finite = torch.isfinite(meta).all(dim=0)
    k_ok = (k >= fmt_cfg.inv_expand_min) & (k <= reference.f32(fmt_cfg.k_max))
    half_range = log2_scale_q / torch.where(k_ok, k, 1.0)
    extremes_ok = ((log2_center + half_range).abs() <= LOG2_LIMIT) & ((log2_center - half_range).abs() <= LOG2_LIMIT)
    for ok, what in ((finite, "NaN/Inf metadata"),
                     (k_ok, f"an expansion exponent k outside [1/{fmt_cfg.expand_min}, {fmt_cfg.k_max:g}]"),
                     (extremes_ok, "metadata decoding outside fp32's range")):
        bad = ~ok
        if bad.any():
            group = int(bad.nonzero()[0, 0])
            raise StateError(f"{where}: {moment}_meta gives {int(bad.sum())} of {layout.num_groups} quantization "
                             f"groups {what} (first: group {group}, (k, log2 center, log2 scale*Q) = "
                             f"{tuple(meta[:, group].tolist())}): the metadata is damaged")


def _scan_fp32(value: torch.Tensor, moment: str, where: str) -> None:
    flat = value.detach().reshape(-1)
    if flat.numel() == 0:
        return
    low, high = (float(v) for v in torch.aminmax(flat))  # NaN anywhere makes both NaN
    second = moment == "exp_avg_sq"
    if math.isfinite(low) and math.isfinite(high) and not (second and low < 0):
        return
    bad = ~torch.isfinite(flat) | (flat < 0) if second else ~torch.isfinite(flat)
    first = int(bad.nonzero()[0, 0])
    raise StateError(f"{where}: {moment} holds {float(flat[first])} at element {first}"
                     f"{' (second moments are finite and >= 0)' if second else ''}: the moments are damaged")


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:80]


def _short(rows: list) -> str:
    return str(rows) if len(rows) <= 4 else f"{rows[:4]}... ({len(rows)} runs)"


def check_state_fits(p, state, layout, cfg, moments: tuple[str, ...] = MOMENTS):
    """The state must describe this very tensor with this group's options: never step part of a tensor."""
    if layout.numel != p.numel():
        raise RuntimeError(f"CoatFP8AdamW: a state of {layout.numel} elements belongs to a tensor of {p.numel()} "
                           f"elements (shape {tuple(p.shape)}): the parameter was resized")
    for moment, fmt_cfg in moment_configs(cfg, moments).items():
        key = moment + "_q"
        if state[key].dtype != fmt_cfg.fmt.dtype:
            raise RuntimeError(f"CoatFP8AdamW: {key} is stored as {state[key].dtype} but the group asks for "
                               f"{fmt_cfg.fmt.name}; change formats only with fresh state (or convert the moments "
                               "with fp32_moments / set_fp32_moments)")
    if layout.group_size != cfg.group_size:
        raise RuntimeError(f"CoatFP8AdamW: the state was quantized in groups of {layout.group_size}, the group asks "
                           f"for {cfg.group_size}; convert with fp32_moments / set_fp32_moments first")


def check_param_and_grad(p, g) -> None:
    """A step's tensor and its gradient: dtypes, shapes and layouts the step takes."""
    if g.is_sparse:
        raise RuntimeError("CoatFP8AdamW does not support sparse gradients")
    if p.is_complex() or g.is_complex():
        raise RuntimeError("CoatFP8AdamW does not support complex parameters")
    if p.dtype not in PARAM_DTYPES:
        raise TypeError(f"CoatFP8AdamW needs fp32 or bf16 (master) parameters, got {p.dtype}")
    if g.dtype not in GRAD_DTYPES:
        raise TypeError(f"CoatFP8AdamW needs fp32, bf16 or fp16 gradients, got {g.dtype}")
    if g.shape != p.shape:
        raise RuntimeError(f"gradient shape {tuple(g.shape)} differs from parameter shape {tuple(p.shape)}")
    if not p.is_contiguous():
        raise RuntimeError("CoatFP8AdamW needs contiguous parameters")


# torch.optim.AdamW options accepted only at their default value.
TORCH_ADAMW_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "fused": None, "capturable": False,
                        "differentiable": False}


def check_torch_options(saved_group: dict, where: str) -> None:
    """A saved group of torch.optim.AdamW may hold options CoatFP8AdamW does not have: refused."""
    for name, default in TORCH_ADAMW_DEFAULTS.items():
        value = saved_group.get(name, default)
        if value != default and not (name in ("foreach", "fused") and value is False):
            hint = " (its state holds max_exp_avg_sq; continue that run with torch.optim.AdamW)" if name == "amsgrad" \
                else ""
            raise StateError(f"{where} has {name}={value!r}, which CoatFP8AdamW does not support{hint}")


def check_hyper_parameters(lr, betas, eps, weight_decay, optimizer: str = "CoatFP8AdamW"):
    """TypeError or ValueError naming the hyper-parameter that is not a finite number in its range."""
    where = f"{optimizer} hyper-parameters: "
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2 or any(
            isinstance(b, bool) or not isinstance(b, numbers.Real) for b in betas):
        raise TypeError(f"{where}betas must be a pair of numbers like (0.9, 0.999), got {betas!r}")
    values = {"lr": lr, "betas[0]": betas[0], "betas[1]": betas[1], "eps": eps, "weight_decay": weight_decay}
    for name, value in values.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:  # torch's optimizers take tensor hyper-parameters
            value = values[name] = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{where}{name} must be a number, got {value!r} ({type(value).__name__})")
        if not math.isfinite(value):
            raise ValueError(f"{where}{name} must be finite, got {value!r}")
    for name in ("lr", "eps", "weight_decay"):
        if not values[name] >= 0:
            raise ValueError(f"{where}{name} must be >= 0, got {values[name]!r}")
    for name in ("betas[0]", "betas[1]"):
        if not 0 <= values[name] < 1:
            raise ValueError(f"{where}{name} must be in [0, 1), got {values[name]!r}")
