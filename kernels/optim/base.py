"""What every COAT FP8 optimizer (CoatFP8AdamW, CoatFP8Lion, CoatFP8Muon) shares: `CoatFP8Optimizer`.

It owns the state entries (coat_kernels.optim.state: FP8 codes and per-group metadata of the optimizer's moments), the
COAT options (an OptimizerConfig, the per-group ones stored in each param group like lr), their validation before
anything is written, the engines' hooks (`param_segments`, `param_gradient`), the non-finite policy and counter,
state dicts, torch's fp32 layout and pickling (coat_kernels.optim.checkpoint). A subclass says which moments a param
group keeps (`moments_of`), checks its hyper-parameters (`_check_group`), makes the per-tensor constants of a step
(`_group_scalars`) and runs a batch of planned tensors on a backend (`_run_batch`).

A step checks and plans every group before it writes anything: one that raises leaves parameters, moments and steps
as they were (nonfinite="error" aside: it raises after the step, naming the skipped groups).
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from . import backends, checkpoint
from . import dre_reference as reference
from . import state as coat_state
from . import validation
from .config import DEFAULTS, GROUP_OPTION_NAMES, OPTION_NAMES, OptimizerConfig
from .grouping import GroupLayout, Segment, build_layout, normalize_segments
from .validation import StateError

REMAINDER = coat_state.REMAINDER_KEY
CACHES = ("_layouts", "_launchers", "_plans")  # rebuilt on the next step: left out of pickles and copies
# what load_state_dict keeps as saved (torch would cast it to the parameter's dtype)
LOADED_KEYS = coat_state.ENTRY_KEYS + coat_state.MOMENTS + (REMAINDER,)


def coat_config(name: str, config, options: dict, hyper_names: tuple, torch_defaults: dict) -> OptimizerConfig:
    """The OptimizerConfig of optimizer `name` built from `config` and the keyword arguments `options` (COAT options
    are taken out of it; what remains must be a torch option at its default, in `torch_defaults`). `hyper_names`:
    the optimizer's own hyper-parameters, listed in the error for an unknown option."""
    coat = {k: options.pop(k) for k in list(options) if k in OPTION_NAMES}
    for key, value in options.items():
        if key not in torch_defaults:
            valid = ", ".join(hyper_names + OPTION_NAMES)
            raise ValueError(f"{name} got an unknown option {key!r}; valid options: {valid} (in Python also "
                             "config=OptimizerConfig(...), which these options override)")
        if value != torch_defaults[key] and not (key in ("foreach", "fused") and value is False):
            raise ValueError(f"{name} does not support {key}={value!r}")
    if config is not None and not isinstance(config, OptimizerConfig):
        raise TypeError(f"{name}: config must be an OptimizerConfig, got {type(config).__name__}; pass the COAT "
                        "options as keyword arguments (ds_config: in \"params\") or OptimizerConfig(**options)")
    return (config or DEFAULTS).replace(**coat)


class CoatFP8Optimizer(torch.optim.Optimizer, metaclass=abc.ABCMeta):
    NAME = "CoatFP8Optimizer"  # how messages name the optimizer

    def __init__(self, params, defaults: dict, config: OptimizerConfig):
        self.config = config
        super().__init__(params, {**defaults, **config.group_options})
        self._reset_caches()
        self._skipped: dict[torch.device, torch.Tensor] = {}

    # ---- what a subclass defines ----------------------------------------------------------------------------
    @abc.abstractmethod
    def moments_of(self, group: dict) -> tuple[str, ...]:
        """The moments the entries of `group` keep (state.MOMENTS or state.MOMENTUM)."""

    @abc.abstractmethod
    def _check_group(self, group: dict) -> None:
        """TypeError / ValueError for a group's hyper-parameters that a step cannot use."""

    @abc.abstractmethod
    def _group_scalars(self, group: dict, step: float):
        """The (hashable) per-tensor constants of a step of `group` for a tensor at step count `step` (from 1)."""

    @abc.abstractmethod
    def _run_batch(self, group: dict, key: tuple, items: list, cfg: OptimizerConfig) -> None:
        """Step `items` ((param, grad, entry, layout, scalars) sharing the kernel key `key`: use Triton, device,
        param dtype, grad dtype, group size, remainder[, scalars]) and count their skipped groups."""

    def _check_saved_group(self, saved: dict, where: str) -> None:
        """StateError / ValueError for a saved param group this optimizer cannot continue (load_state_dict)."""

    # ---- param groups, caches, pickling -----------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, refusing a tensor listed twice (in this group or in an earlier one): it would be
        stepped twice per step."""
        params = param_group["params"] if isinstance(param_group, dict) and "params" in param_group else []
        if not isinstance(params, (torch.Tensor, set)):  # torch refuses sets itself
            params = param_group["params"] = list(params)
            tensors = [q[1] if isinstance(q, tuple) else q for q in params]
            validation.check_distinct_tensors(tensors, self.param_groups)
            for p in tensors:
                backends.check_device(self.config.backend, p)
        super().add_param_group(param_group)

    def _reset_caches(self):
        self._layouts: dict[torch.Tensor, GroupLayout] = {}
        self._launchers: dict = {}  # fused-kernel launchers per list of layouts
        self._plans: dict[int, StepPlan] = {}  # per param group (by identity)

    def __getstate__(self):
        """copy.deepcopy and pickle: everything but the caches (rebuilt on the next step); FP8 codes travel as
        uint8 (torch cannot unpickle FP8 storages)."""
        return checkpoint.picklable_state(self.__dict__, CACHES)

    def __setstate__(self, state):
        # A whole optimizer (unpickled or deep-copied) has its config; torch's load_state_dict passes only the state
        # and the param groups here, and load_state_dict checks those itself.
        whole_optimizer = "config" in state
        super().__setstate__(checkpoint.unpickled_state(state))
        self._reset_caches()
        if whole_optimizer:  # every entry against its tensor and param group, values scanned (segments aside)
            checkpoint.check_entries(self.param_groups, self.state,
                                     lambda *args: self._check_entry(*args, own_segments=False), self.group_config)

    # ---- the hooks for engines --------------------------------------------------------------------------------
    def param_segments(self, param: torch.Tensor, group_index: int) -> list[Segment] | None:
        """The parameter runs inside `param` (a tensor of param group `group_index`): a list of
        (flat_start, length, param_offset), or None when `param` is one whole parameter. Engines that step flat
        partitions or shards override this; it is asked when a tensor's state is created, and when a state is
        loaded (a loaded entry's segments must be these)."""
        return None

    def param_gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient a step applies to `param`: `param.grad`. Engines that keep gradients elsewhere (Megatron's
        precision-aware optimizer: `decoupled_grad`, which may differ from the parameter's dtype) override this."""
        return param.grad

    # ---- public helpers -------------------------------------------------------------------------------------
    @property
    def skipped_groups(self) -> int:
        """Quantization groups left unchanged so far because their gradient was not finite (synchronizes)."""
        return int(sum(int(c.sum()) for c in self._skipped.values()))

    def state_bytes(self) -> int:
        """Bytes held by the optimizer state tensors (moments, their metadata, segment tables)."""
        return sum(coat_state.entry_bytes(s) for s in self.state.values())

    def group_config(self, group: dict) -> OptimizerConfig:
        """The validated COAT options of one param group (they may be changed in the group's dict between steps)."""
        # types in the key: True == 1 and 128.0 == 128 must not share a cached (validated) config
        return _group_config(self.config, tuple((type(group[k]), group[k]) for k in GROUP_OPTION_NAMES))

    def initialize_state(self) -> None:
        """Create the (zero) FP8 state of every parameter that has none yet, and quantize fp32 moments found in
        entries (a torch-format checkpoint): what the first step would do, now."""
        for index, group, position, p in checkpoint.numbered_params(self.param_groups):
            if self._needs_new_entry(p, self.state[p]):
                self._init_state(p, group, index, self._where(p, index, position))

    def fp32_moments(self, p: torch.Tensor) -> dict:
        """p's moments ({"exp_avg", "exp_avg_sq"}, or {"exp_avg"} for one momentum): fp32, flat, on p's device
        (zeros before the first step). Setting these values back restores the state bit for bit (what checkpoints
        in fp32 formats rely on)."""
        self._ensure_entry(p)
        return coat_state.to_fp32(self.state[p], *self._config_of(p).moment_configs())

    def _set_fp32_moments(self, p: torch.Tensor, values: dict, step: float | None) -> None:
        """Replace p's moments by these fp32 values ({moment: p's numel values, any shape}), quantized now on p's
        groups. Bad values raise StateError and leave the state as it was."""
        state = self.state[p]
        if not coat_state.is_coat_state(state):
            group_index, group = self._group_of(p)
            self._init_state(p, group, group_index, self._describe(p))
        layout = self._layouts.get(p) or self._layout(p, state, self._describe(p))
        configs = coat_state.moment_configs(self._config_of(p), tuple(values))
        try:
            if step is not None:
                validation.check_step(step, "the step given")
            quantized = self._quantized(p, values, layout, configs)
        except ValueError as exc:
            raise StateError(f"{self._describe(p)}: {exc}") from None
        coat_state.commit(state, quantized)
        if step is not None:
            state["step"] = torch.tensor(float(step), dtype=torch.float32)

    def _needs_new_entry(self, p, state) -> bool:
        """No FP8 state yet, fp32 moments to quantize, or a missing master remainder."""
        return not coat_state.is_coat_state(state) or "exp_avg" in state or (
            REMAINDER not in state and coat_state.needs_remainder(self.config, p.dtype))

    def _ensure_entry(self, p) -> None:
        if self._needs_new_entry(p, self.state[p]):
            group_index, group = self._group_of(p)
            self._init_state(p, group, group_index, self._describe(p))

    # ---- step -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every group is checked and planned before anything is written: a step that raises leaves parameters,
        # moments, steps and the kept plans as they were.
        prepared = [self._prepare_group(index, group) for index, group in enumerate(self.param_groups)]
        for group, work in zip(self.param_groups, prepared):
            if work is not None:
                self._plans[id(group)] = work[0]
        before = self.skipped_groups if self.config.nonfinite == "error" else 0
        for group, work in zip(self.param_groups, prepared):
            if work is not None:
                self._run_group(group, *work)
        if self.config.nonfinite == "error" and self.skipped_groups > before:
            raise FloatingPointError(f"{self.skipped_groups - before} quantization groups had NaN/Inf gradients "
                                     "this step; their parameters and moments were left unchanged")
        return loss

    def _prepare_group(self, index, group):
        """(plan, gradients, scalars per tensor, COAT options) of one group's step, or None without gradients;
        raises (writing nothing) for bad options, tensors or states."""
        grads = [self.param_gradient(p) for p in group["params"]]
        params = [p for p, g in zip(group["params"], grads) if g is not None]
        if not params:
            return None
        grads = [g for g in grads if g is not None]
        cfg = self.group_config(group)
        self._check_group(group)
        moments = self.moments_of(group)
        signature = (tuple(map(id, params)), tuple((g.dtype, g.layout, g.shape) for g in grads), cfg, moments)
        plan = self._plans.get(id(group))
        if plan is None or plan.signature != signature or not all(
                self.state[p] is st and not self._needs_new_entry(p, st) and self._layouts.get(p) is layout
                for p, st, layout in zip(params, plan.states, plan.layouts)):
            plan = self._plan(index, group, params, signature, cfg)
        for i, (p, st, update) in enumerate(zip(params, plan.states, plan.updates)):
            # state tensors may have been replaced since the plan (offloading engines swap them)
            if update is None and coat_state.stored_tensors(st) != plan.tensors[i]:
                validation.check_tensors(st, plan.layouts[i], cfg, plan.wheres[i], p.device, moments=moments)
                if plan.kernel_keys[i][-1]:
                    validation.check_remainder(st.get(REMAINDER), p.numel(), plan.wheres[i], p.device)
                plan.tensors[i] = coat_state.stored_tensors(st)
        scalars_by_step: dict = {}
        scalars = []
        for st, update, where in zip(plan.states, plan.updates, plan.wheres):
            # a new entry made from fp32 moments or completed by a remainder keeps the entry's own step
            count = validation.step_count((update if update is not None and "step" in update else st).get("step"),
                                          where)
            step = reference.f32(count + 1.0)
            if step == math.inf:
                raise StateError(f"{where}: step {count:g} is beyond fp32's range")
            if step not in scalars_by_step:
                scalars_by_step[step] = self._group_scalars(group, step)
            scalars.append(scalars_by_step[step])
        return plan, grads, scalars, cfg

    def _run_group(self, group, plan, grads, scalars, cfg):
        for i, (st, update) in enumerate(zip(plan.states, plan.updates)):
            if update is not None:
                coat_state.commit(st, update)
                self._layouts[plan.params[i]] = plan.layouts[i]
                plan.updates[i] = None
            st["step"] += 1
        by_kernel: dict = {}
        for p, grad, st, layout, key, h in zip(plan.params, grads, plan.states, plan.layouts, plan.kernel_keys,
                                               scalars):
            if not grad.is_contiguous():
                grad = grad.contiguous()
            by_kernel.setdefault(key if key[0] else key + (h,), []).append((p, grad, st, layout, h))
        for key, items in by_kernel.items():
            self._run_batch(group, key, items, cfg)

    def _plan(self, index, group, params, signature, cfg) -> "StepPlan":
        """Checks and per-tensor facts of a group's step, kept while the params with gradients, their gradients'
        dtypes and shapes, the group's COAT options and the states stay the same (a step then only walks lists and
        checks the state tensors' shapes). A tensor without an FP8 state yet gets its new entry in `updates`, stored
        when the step runs."""
        positions = {id(q): i for i, q in enumerate(group["params"])}
        offset = sum(len(g["params"]) for g in self.param_groups[:index])
        moments = self.moments_of(group)
        plan = StepPlan(signature, params, [], [], [], [], [], [])
        for p in params:
            grad = self.param_gradient(p)
            validation.check_param_and_grad(p, grad)
            where = self._where(p, index, offset + positions[id(p)])
            state = self.state[p]
            remainder = coat_state.needs_remainder(self.config, p.dtype)
            if not self._needs_new_entry(p, state):
                layout, update = self._layout(p, state, where), None
                validation.check_state_fits(p, state, layout, cfg, moments)
                validation.check_tensors(state, layout, cfg, where, p.device, moments=moments)
                if remainder:
                    validation.check_remainder(state[REMAINDER], p.numel(), where, p.device)
                elif REMAINDER in state:
                    validation.validate_entry(state, p.numel(), cfg, where, scan=False, param_dtype=p.dtype,
                                              moments=moments)
            else:
                update, layout = self._new_entry(p, state, cfg, index, where)
            plan.tensors.append(coat_state.stored_tensors(state if update is None else {**state, **update}))
            plan.states.append(state)
            plan.layouts.append(layout)
            plan.updates.append(update)
            plan.wheres.append(where)
            plan.kernel_keys.append((self._use_triton(p, layout.group_size), p.device, p.dtype, grad.dtype,
                                     layout.group_size, remainder))
        return plan

    def _use_triton(self, p, group_size: int) -> bool:
        return backends.use_triton(self.config.backend, p, group_size)

    def _counter(self, device):
        if device not in self._skipped:
            self._skipped[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return self._skipped[device]

    # ---- state ------------------------------------------------------------------------------------------------
    def _config_of(self, p) -> OptimizerConfig:
        """The COAT options of p's param group; for a tensor with a state outside param_groups (ZeRO-3 swaps its
        sub-group tensors in only while stepping) the options all groups share."""
        try:
            return self.group_config(self._group_of(p)[1])
        except KeyError:
            configs = {self.group_config(group) for group in self.param_groups}
            if len(configs) != 1:
                raise KeyError("a state tensor outside param_groups, and the groups' COAT options differ") from None
            return configs.pop()

    def _group_of(self, p):
        for index, group in enumerate(self.param_groups):
            if any(p is q for q in group["params"]):
                return index, group
        raise KeyError("parameter is not in this optimizer")

    def _describe(self, p) -> str:
        for index, _, position, q in checkpoint.numbered_params(self.param_groups):
            if q is p:
                return self._where(p, index, position)
        return f"{self.NAME} state of a tensor of shape {tuple(p.shape)} outside the param groups"

    def _where(self, p, group_index: int, position: int) -> str:
        """How errors name a parameter: its index in the state dict and its shape."""
        return f"{self.NAME} state of parameter {position} (shape {tuple(p.shape)}, param group {group_index})"

    def _init_state(self, p, group, group_index, where):
        """Store p's entry as the next step would make it (see _new_entry)."""
        state = self.state[p]
        update, layout = self._new_entry(p, state, self.group_config(group), group_index, where)
        coat_state.commit(state, update)
        self._layouts[p] = layout

    def _new_entry(self, p, state, cfg, group_index, where) -> tuple[dict, GroupLayout]:
        """(what to store in p's entry, its layout), computed without changing the entry: a fresh zero state on p's
        groups (keeping the step) where there is no FP8 state, and codes quantized from fp32 moments found in the
        entry (they replace the codes beside them)."""
        moments = self.moments_of(self.param_groups[group_index])
        validation.validate_entry(state, p.numel(), cfg, where, scan=False, param_dtype=p.dtype, moments=moments)
        configs = coat_state.moment_configs(cfg, moments)
        if coat_state.is_coat_state(state):
            layout, update = self._layout(p, state, where), {}
            validation.check_state_fits(p, state, layout, cfg, moments)
        else:
            segments = state["segments"] if "segments" in state else self.param_segments(p, group_index)
            segments = normalize_segments(segments, p.numel())
            layout = build_layout(segments, p.numel(), cfg.group_size)
            update = coat_state.zero_entry(p.numel(), segments, layout, configs, p.device,
                                           step=float(state.get("step", 0.0)))
        if "exp_avg" in state:
            try:
                update.update(self._quantized(p, {m: state[m] for m in configs}, layout, configs))
            except ValueError as exc:
                raise StateError(f"{where}: {exc}") from None
        if coat_state.needs_remainder(self.config, p.dtype) and REMAINDER not in state:
            update[REMAINDER] = coat_state.zero_remainder(p.numel(), p.device)
        return update, layout

    def _quantized(self, p, values: dict, layout: GroupLayout, configs: dict) -> dict:
        """Codes and metadata of fp32 moments {moment: values} on p's layout (ValueError for values no state can
        hold: NaN/Inf, negative second moments)."""
        values = {k: v.to(p.device) for k, v in values.items()}
        use_kernel = self._use_triton(p, layout.group_size)
        if "exp_avg_sq" in values:
            return coat_state.from_fp32(values["exp_avg"], values["exp_avg_sq"], layout, configs["exp_avg"],
                                        configs["exp_avg_sq"], use_kernel)
        return coat_state.quantize_moments(values, layout, configs, use_kernel)

    def _layout(self, p, state, where):
        layout = self._layouts.get(p)
        if layout is None:
            layout = self._layouts[p] = validation.entry_layout(state, p.numel(), where)
        return layout

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def torch_format_state_dict(self) -> dict:
        """The state in torch.optim's fp32 layout: per parameter `step` and fp32 moments shaped like it (see
        `fp32_moments`); param groups keep their COAT options. `load_state_dict` takes it back, the FP8 state
        restored bit for bit on the same tensors."""
        return checkpoint.torch_format(super().state_dict(), self.param_groups, self.fp32_moments)

    def load_state_dict(self, state_dict):
        """torch's load_state_dict, after every entry has been checked against its parameter, layout and param group
        (coat_kernels.optim.validation.validate_entry, values scanned): a bad entry raises StateError and leaves the
        optimizer as it was. FP8 codes stay FP8 and metadata fp32 (torch would cast them to the parameter's dtype).
        lr, betas and the other torch hyper-parameters are the checkpoint's, as in torch. A saved group holding FP8
        moments must have this optimizer's COAT options (group size, formats, expansion): other ones raise StateError
        naming them. A group holding fp32 moments (torch's layout) restores its saved COAT options; one saved
        without them (a torch.optim run) gets this optimizer's."""
        id_to_param = checkpoint.check_state_dict(state_dict, self.param_groups, self._loaded_group_config,
                                                  self._check_entry)
        checkpoint.check_kept_options(state_dict, self.param_groups, GROUP_OPTION_NAMES)
        checkpoint.load_keeping_dtypes(self, super().load_state_dict, state_dict, id_to_param, LOADED_KEYS)
        for group in self.param_groups:  # saved groups from older runs may lack options: this run's defaults
            for key, value in self.config.group_options.items():
                group.setdefault(key, value)
        self._reset_caches()

    def _loaded_group_config(self, saved: dict, where: str) -> OptimizerConfig:
        """The COAT options a saved param group's entries are checked against (this optimizer's where it has none);
        saved groups this optimizer cannot continue are refused (`_check_saved_group`)."""
        self._check_saved_group(saved, where)
        try:
            return self.config.replace(**{k: saved[k] for k in GROUP_OPTION_NAMES if k in saved})
        except (TypeError, ValueError) as exc:
            raise StateError(f"{where}: {exc}") from None

    def _check_entry(self, entry, p, group_index: int, position: int, cfg, own_segments: bool = True) -> None:
        """validate_entry, values scanned; with `own_segments`, an entry's segments must be those `param_segments`
        gives (a loaded state: an unpickled optimizer is no longer linked to the engine that made them)."""
        segments = None
        if own_segments and isinstance(entry, dict) and "segments" in entry:
            segments = normalize_segments(self.param_segments(p, group_index), p.numel())
        validation.validate_entry(entry, p.numel(), cfg, self._where(p, group_index, position), segments=segments,
                                  param_dtype=p.dtype, moments=self.moments_of(self.param_groups[group_index]))


@dataclass
class StepPlan:
    signature: tuple
    params: list
    states: list  # the live entries
    layouts: list
    updates: list  # per tensor: None, or what to store in its entry before its first step (a new FP8 state)
    wheres: list  # per tensor: how errors name it
    tensors: list  # per tensor: (dtype, shape, device) of its codes and metadata, as checked
    kernel_keys: list  # (use Triton, device, param dtype, grad dtype, group size, remainder) per tensor


@lru_cache(maxsize=256)
def _group_config(base: OptimizerConfig, values: tuple) -> OptimizerConfig:
    return base.replace(**{name: value for name, (_, value) in zip(GROUP_OPTION_NAMES, values)})
