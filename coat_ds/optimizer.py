"""CoatFP8AdamW: AdamW whose two moments live in FP8 with per-group Dynamic Range Expansion (COAT).

A drop-in for torch.optim.AdamW (decoupled weight decay, t counted from 1). Parameters are the fp32 (or bf16)
master weights; gradients fp32, bf16 or fp16. CUDA tensors are stepped by one fused Triton launch per param group
and dtype pair; CPU tensors by the PyTorch reference of the same math (backend="triton" forces the kernel, which
then runs under TRITON_INTERPRET=1).

State per tensor, created on its first step (see `new_state`): step, segments (int64 [n, 3]: flat_start, length,
param_offset), group_size, exp_avg_q / exp_avg_sq_q (FP8 codes), exp_avg_meta / exp_avg_sq_meta (fp32 [3, n_groups]:
k, log2 center, log2(scale * FP8 max); see coat_kernels.dre_reference). fp32 `exp_avg` / `exp_avg_sq` found in the state (DeepSpeed's universal-checkpoint loader
writes them) are quantized at the next step.

Non-finite gradients (nonfinite="skip_group", the default): a quantization group whose gradient holds NaN or Inf
(seen as a non-finite new second moment: a gradient whose square overflows fp32 counts too) keeps its parameters and
moments unchanged; `skipped_groups` counts such groups (reading it synchronizes).
nonfinite="error" does the same and then raises FloatingPointError.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain

import torch

from coat_kernels import dre_reference as reference
from coat_kernels.dre_reference import AdamWScalars, DREConfig
from coat_kernels.grouping import GroupLayout, build_layout, concat_layouts, normalize_segments

_ADAMW_ARGS = ("lr", "betas", "eps", "weight_decay")
_COAT_ARGS = ("exp_avg_format", "exp_avg_sq_format", "expand_exp_avg", "expand_exp_avg_sq", "group_size",
              "expand_min", "k_max", "nonfinite", "backend")
# torch.optim.AdamW options accepted only at their default value.
_TORCH_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "fused": None, "capturable": False,
                   "differentiable": False}
_NONFINITE = ("skip_group", "error")
_BACKENDS = ("auto", "triton", "torch")
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PARAM_DTYPES = (torch.float32, torch.bfloat16)
_KEEP_ON_LOAD = ("segments", "exp_avg_q", "exp_avg_sq_q", "exp_avg_meta", "exp_avg_sq_meta", "exp_avg", "exp_avg_sq")


class CoatFP8AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 exp_avg_format="e4m3", exp_avg_sq_format="e4m3", expand_exp_avg=True, expand_exp_avg_sq=True,
                 group_size=128, expand_min=16, k_max=16.0, nonfinite="skip_group", backend="auto", **options):
        for name, value in options.items():
            if name not in _TORCH_DEFAULTS:
                valid = ", ".join(_ADAMW_ARGS + _COAT_ARGS + tuple(_TORCH_DEFAULTS))
                raise ValueError(f"CoatFP8AdamW got an unknown option {name!r}; valid options: {valid}")
            if value != _TORCH_DEFAULTS[name] and not (name in ("foreach", "fused") and value is False):
                raise ValueError(f"CoatFP8AdamW does not support {name}={value!r}")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite must be one of {_NONFINITE}, got {nonfinite!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        exp_avg_format=exp_avg_format, exp_avg_sq_format=exp_avg_sq_format,
                        expand_exp_avg=expand_exp_avg, expand_exp_avg_sq=expand_exp_avg_sq, group_size=group_size,
                        expand_min=expand_min, k_max=k_max)
        super().__init__(params, defaults)
        for group in self.param_groups:
            _validate_group(group)
        self.nonfinite = nonfinite
        self.backend = backend
        from coat_kernels.dre_triton import supports_group_size

        # Kernels need a power-of-two group_size >= 4; otherwise "auto" steps with the reference on the device.
        self._kernel_group_size = all(supports_group_size(g["group_size"]) for g in self.param_groups)
        if backend == "triton" and not self._kernel_group_size:
            raise ValueError("backend='triton' needs a power-of-two group_size >= 4 in every param group")
        # The params as handed in, before a ZeRO wrapper swaps in flat partitions (keyed by group identity).
        self._lp_params = {id(g): list(g["params"]) for g in self.param_groups}
        self._layouts: dict[torch.Tensor, GroupLayout] = {}
        self._launchers: dict = {}  # FusedAdamW per list of layouts
        self._plans: dict[int, _StepPlan] = {}  # per param group (by identity)
        self._skipped: dict[torch.device, torch.Tensor] = {}

    # ---- public helpers -------------------------------------------------------------------------------------
    @property
    def skipped_groups(self) -> int:
        """Quantization groups left unchanged so far because their gradient was not finite (synchronizes)."""
        return int(sum(int(c.sum()) for c in self._skipped.values()))

    def state_bytes(self) -> int:
        """Bytes held by the optimizer state tensors (moments, their metadata, segment tables)."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))

    def dequantized_state(self, p: torch.Tensor) -> dict:
        return dequantize_state_entry(self.state[p])

    # ---- step -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        before = self.skipped_groups if self.nonfinite == "error" else 0
        for group in self.param_groups:
            self._step_group(group)
        if self.nonfinite == "error" and self.skipped_groups > before:
            raise FloatingPointError(f"{self.skipped_groups - before} quantization groups had NaN/Inf gradients "
                                     "this step; their parameters and moments were left unchanged")
        return loss

    def _step_group(self, group):
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        signature = (tuple(map(id, params)), tuple((g.dtype, g.layout, g.shape) for g in grads))
        m_cfg, v_cfg = _moment_configs(group)
        plan = self._plans.get(id(group))
        if plan is None or plan.signature != signature or not all(
                self.state[p] is st and "exp_avg_q" in st and self._layouts.get(p) is layout
                for p, st, layout in zip(params, plan.states, plan.layouts)):
            plan = self._plans[id(group)] = self._plan(group, params, signature, m_cfg, v_cfg)
        beta1, beta2 = group["betas"]
        scalars_by_step: dict[float, AdamWScalars] = {}
        by_kernel: dict = {}
        for p, grad, state, layout, key in zip(params, grads, plan.states, plan.layouts, plan.kernel_keys):
            state["step"] += 1
            step = float(state["step"])
            scalars = scalars_by_step.get(step)
            if scalars is None:
                scalars = scalars_by_step[step] = AdamWScalars.make(group["lr"], beta1, beta2, group["eps"],
                                                                    group["weight_decay"], step)
            if not grad.is_contiguous():
                grad = grad.contiguous()
            by_kernel.setdefault(key if key[0] else key + (scalars,), []).append((p, grad, state, layout, scalars))
        for (use_triton, device, *_), items in by_kernel.items():
            if use_triton:
                self._launch(device, items, m_cfg, v_cfg)
            else:
                self._counter(device).add_(_reference_step(items, m_cfg, v_cfg))

    def _plan(self, group, params, signature, m_cfg, v_cfg) -> "_StepPlan":
        """Checks and per-tensor facts of a group's step, kept while the params with gradients, their gradients'
        dtypes and shapes, and their states stay the same (a step then only walks the lists)."""
        states, layouts, keys = [], [], []
        for p in params:
            _check_tensors(p)
            state = self.state[p]
            if "step" not in state or "exp_avg_q" not in state:
                self._init_state(p, group, m_cfg, v_cfg)
            layout = self._layout(p, state)
            states.append(state)
            layouts.append(layout)
            keys.append((self._use_triton(p), p.device, p.dtype, p.grad.dtype, layout.group_size))
        return _StepPlan(signature, states, layouts, keys)

    def _launch(self, device, items, m_cfg, v_cfg):
        from coat_kernels import dre_triton

        layouts = [it[3] for it in items]
        key = tuple(id(lay) for lay in layouts)
        if key not in self._launchers:
            self._launchers[key] = dre_triton.FusedAdamW(layouts, device)
        states = [it[2] for it in items]
        self._launchers[key]([it[0] for it in items], [it[1] for it in items],
                             [s["exp_avg_q"] for s in states], [s["exp_avg_meta"] for s in states],
                             [s["exp_avg_sq_q"] for s in states], [s["exp_avg_sq_meta"] for s in states],
                             [it[4] for it in items], m_cfg, v_cfg, self._counter(device))

    def _use_triton(self, p):
        return self.backend == "triton" or (self.backend == "auto" and p.is_cuda and self._kernel_group_size)

    def _counter(self, device):
        if device not in self._skipped:
            self._skipped[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return self._skipped[device]

    # ---- state ------------------------------------------------------------------------------------------------
    def _segments(self, p, group):
        lp_params = self._lp_params.get(id(group), [])
        if any(p is q for q in lp_params):
            return None
        try:
            from coat_ds.zero_segments import fragment_segments
        except ImportError:
            warnings.warn("CoatFP8AdamW: no fragment table for a flat tensor; grouping it as one segment")
            return None
        return fragment_segments(p, lp_params)

    def _init_state(self, p, group, m_cfg, v_cfg):
        state = self.state[p]
        fp32_moments = {k: state.pop(k) for k in ("exp_avg", "exp_avg_sq") if k in state}
        segments = state["segments"] if "segments" in state else self._segments(p, group)
        segments = normalize_segments(segments, p.numel())
        layout = build_layout(segments, p.numel(), group["group_size"])
        state.update(new_state(p, segments, layout, m_cfg, v_cfg, step=float(state.get("step", 0.0))))
        self._layouts[p] = layout
        for key, cfg in (("exp_avg", m_cfg), ("exp_avg_sq", v_cfg)):
            if key in fp32_moments:
                codes, meta = _quantize(fp32_moments[key].to(p.device, torch.float32).view(-1), layout, cfg,
                                        self._use_triton(p))
                state[key + "_q"], state[key + "_meta"] = codes, meta

    def _layout(self, p, state):
        layout = self._layouts.get(p)
        if layout is None:
            layout = build_layout(state["segments"], p.numel(), state["group_size"])
            self._layouts[p] = layout
        return layout

    def load_state_dict(self, state_dict):
        # torch casts every floating state tensor to the param's dtype: keep codes FP8 and metadata fp32.
        originals = {pid: {k: v for k, v in s.items() if k in _KEEP_ON_LOAD} for pid, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        id_to_param = dict(zip(saved_ids, chain.from_iterable(g["params"] for g in self.param_groups)))
        for pid, tensors in originals.items():
            p = id_to_param[pid]
            for key, value in tensors.items():
                self.state[p][key] = value.to(p.device)
        self._layouts.clear()
        self._launchers.clear()
        self._plans.clear()


@dataclass
class _StepPlan:
    signature: tuple
    states: list
    layouts: list
    kernel_keys: list  # (use Triton, device, param dtype, grad dtype, group size) per tensor


def _reference_step(items, m_cfg, v_cfg) -> torch.Tensor:
    """The PyTorch reference step for tensors sharing device, dtypes and AdamW scalars: one call over their
    concatenation (the reference costs hundreds of small ops per call), results copied back."""
    if len(items) == 1:
        p, grad, st, layout, scalars = items[0]
        return reference.fused_adamw_step(p, grad, st["exp_avg_q"], st["exp_avg_meta"], st["exp_avg_sq_q"],
                                          st["exp_avg_sq_meta"], layout, scalars, m_cfg, v_cfg)
    params, grads, states, layouts, scalars = zip(*items)

    def cat(tensors):
        return torch.cat([t.reshape(-1).view(torch.uint8) if t.is_floating_point() and t.element_size() == 1
                          else t.reshape(-1) for t in tensors])

    p, g = cat(params), cat(grads)
    codes = {k: cat([st[k] for st in states]).view(states[0][k].dtype) for k in ("exp_avg_q", "exp_avg_sq_q")}
    metas = {k: torch.cat([st[k] for st in states], dim=1) for k in ("exp_avg_meta", "exp_avg_sq_meta")}
    skipped = reference.fused_adamw_step(p, g, codes["exp_avg_q"], metas["exp_avg_meta"], codes["exp_avg_sq_q"],
                                         metas["exp_avg_sq_meta"], concat_layouts(layouts), scalars[0], m_cfg, v_cfg)
    start = groups = 0
    for param, st, layout in zip(params, states, layouts):
        n, k = layout.numel, layout.num_groups
        param.view(-1).copy_(p[start:start + n])
        for key in codes:
            st[key].view(torch.uint8).copy_(codes[key][start:start + n].view(torch.uint8))
        for key in metas:
            st[key].copy_(metas[key][:, groups:groups + k])
        start, groups = start + n, groups + k
    return skipped


def new_state(p, segments: torch.Tensor, layout: GroupLayout, m_cfg: DREConfig, v_cfg: DREConfig,
              step: float = 0.0) -> dict:
    """Zero moments: codes 0 with k = 1 (they dequantize to exact zeros)."""
    def zero_meta():
        meta = torch.zeros(3, layout.num_groups, dtype=torch.float32, device=p.device)
        meta[0] = 1.0  # k; rows as in dre_reference.META_ROWS
        return meta

    return {
        "step": torch.tensor(step, dtype=torch.float32),
        "segments": segments.clone(),
        "group_size": layout.group_size,
        "exp_avg_q": torch.zeros(p.numel(), dtype=m_cfg.fmt.dtype, device=p.device),
        "exp_avg_meta": zero_meta(),
        "exp_avg_sq_q": torch.zeros(p.numel(), dtype=v_cfg.fmt.dtype, device=p.device),
        "exp_avg_sq_meta": zero_meta(),
    }


def dequantize_state_entry(entry: dict) -> dict:
    """fp32 {"exp_avg", "exp_avg_sq"} of one saved or live state entry (works offline: the entry describes itself)."""
    numel = entry["exp_avg_q"].numel()
    layout = build_layout(entry["segments"], numel, int(entry["group_size"]))
    out = {}
    for key in ("exp_avg", "exp_avg_sq"):
        codes, meta = entry[key + "_q"], entry[key + "_meta"]
        from coat_kernels import dre_triton

        if codes.is_cuda and dre_triton.supports_group_size(layout.group_size):
            out[key] = dre_triton.dequantize(codes, meta, layout)
        else:
            out[key] = reference.dequantize(codes, meta.to(codes.device), layout)
    return out


def _quantize(x, layout, cfg, use_triton):
    if use_triton:
        from coat_kernels import dre_triton
        return dre_triton.quantize(x, layout, cfg)
    return reference.quantize(x, layout, cfg)


def _moment_configs(group) -> tuple[DREConfig, DREConfig]:
    return _configs(group["exp_avg_format"], group["expand_exp_avg"], group["exp_avg_sq_format"],
                    group["expand_exp_avg_sq"], group["expand_min"], group["k_max"])


@lru_cache(maxsize=64)
def _configs(m_format, m_expand, v_format, v_expand, expand_min, k_max) -> tuple[DREConfig, DREConfig]:
    common = dict(expand_min=expand_min, k_max=k_max)
    return (DREConfig(m_format, expand=m_expand, **common),
            DREConfig(v_format, expand=v_expand, keep_nonzero=True, **common))


def _validate_group(group):
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not (lr >= 0 and 0 <= beta1 < 1 and 0 <= beta2 < 1 and eps >= 0 and wd >= 0):
        raise ValueError(f"invalid AdamW hyper-parameters: lr={lr}, betas={(beta1, beta2)}, eps={eps}, "
                         f"weight_decay={wd}")
    if int(group["group_size"]) != group["group_size"] or group["group_size"] < 1:
        raise ValueError(f"group_size must be a positive integer, got {group['group_size']}")
    _moment_configs(group)  # validates formats, expand_min, k_max


def _check_tensors(p):
    g = p.grad
    if g.is_sparse:
        raise RuntimeError("CoatFP8AdamW does not support sparse gradients")
    if p.is_complex() or g.is_complex():
        raise RuntimeError("CoatFP8AdamW does not support complex parameters")
    if p.dtype not in _PARAM_DTYPES:
        raise TypeError(f"CoatFP8AdamW needs fp32 or bf16 (master) parameters, got {p.dtype}")
    if g.dtype not in _GRAD_DTYPES:
        raise TypeError(f"CoatFP8AdamW needs fp32, bf16 or fp16 gradients, got {g.dtype}")
    if g.shape != p.shape:
        raise RuntimeError(f"gradient shape {tuple(g.shape)} differs from parameter shape {tuple(p.shape)}")
    if not p.is_contiguous():
        raise RuntimeError("CoatFP8AdamW needs contiguous parameters")
