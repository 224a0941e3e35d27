"""CoatFP8Muon: Muon whose momentum lives in FP8 with per-group Dynamic Range Expansion, with the parameters Muon does
not take stepped by CoatFP8AdamW's step in the same optimizer.

Muon groups (`use_muon=True`) follow torch.optim.Muon: m = lerp(m, g, 1 - momentum); the update is lerp(g, m,
momentum) (Nesterov, the default) or m; it is orthogonalised by `ns_steps` quintic Newton-Schulz iterations with
`ns_coefficients` in bf16 on the whole matrix (the transpose of a tall one), scaled by its norm (clamped at `eps`);
p = p (1 - lr wd) - adjust_lr(lr, shape) update, adjust_lr_fn None / "original": sqrt(max(1, rows / cols)),
"match_rms_adamw": 0.2 sqrt(max(rows, cols)). torch's defaults: lr=1e-3, weight_decay=0.1, momentum=0.95,
nesterov=True, ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5. Their parameters must be 2-D (as
torch.optim.Muon requires): hidden-layer matrices. The momentum is the state's `exp_avg` (about 1.1 bytes per
parameter at group_size 128), dequantized, updated in fp32, used for the update and re-quantized each step.

AdamW groups (`use_muon=False`: embeddings, the LM head, norms, biases) are stepped as CoatFP8AdamW steps them (the
fused kernels, both moments in FP8) with the group's lr, `betas` and weight_decay, and `adamw_eps` as their eps (a
group may set "eps"). A group without `use_muon` is a Muon group when all its parameters are 2-D, else an error:
`muon_param_groups(model)` splits a model the way DeepSpeed's Muon and Keller Jordan's MuonWithAuxAdam do (2-D
parameters whose names hold neither "embed" nor "lm_head" to Muon).

Shared with CoatFP8AdamW (coat_kernels.optim.base): the COAT options, state entries (Muon groups' without the
exp_avg_sq keys), validation, state dicts, pickling, the non-finite policy: a Muon matrix whose gradient holds NaN/Inf
keeps its parameter and momentum (all its quantization groups count as skipped: Newton-Schulz mixes the whole
matrix). `torch_format_state_dict`: Muon groups' momentum as torch.optim.Muon's `momentum_buffer`, which
`load_state_dict` also takes. Newton-Schulz runs in torch on the parameter's device, one matrix at a time. On the
Triton path (coat_kernels.optim.muon_triton) two launches per batch of matrices check their gradients, dequantize
the momenta, step them, write the updates and re-quantize them, and one launch per matrix updates the parameter,
with no host synchronisation; elsewhere the momenta of a group's matrices are dequantized together, stepped in torch
and quantized together (coat_kernels.optim.moment_batch, the torch reference). Engines must hand Muon groups whole
matrices (no ZeRO partitions: `param_segments` must say None for them).

state_dtype="fp32" or "bf16" (default "fp8"): the reference arm, moments unquantized in that dtype
(coat_kernels.optim.unquantized): with "fp32" a Muon group's step is torch.optim.Muon's.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from . import moment_batch, unquantized, validation
from . import state as coat_state
from .adamw import run_adamw_batch
from .base import CoatFP8Optimizer, coat_config
from .config import OptimizerConfig
from .dre_reference import AdamWScalars
from .validation import StateError

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's, as torch.optim.Muon
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
NO_TORCH_OPTIONS = {"foreach": None, "fused": None, "maximize": False, "capturable": False, "differentiable": False}
HYPER_NAMES = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn",
               "betas", "adamw_eps", "state_dtype")
TORCH_BUFFER = "momentum_buffer"  # torch.optim.Muon's name of the momentum


@dataclass(frozen=True)
class MuonScalars:
    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    ns_coefficients: tuple
    eps: float
    ns_steps: int
    adjust_lr_fn: str | None


def newton_schulz(update: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """The orthogonalised 2-D `update` (bf16): torch.optim.Muon's quintic Newton-Schulz iteration."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def muon_param_groups(model: torch.nn.Module, **muon_options) -> list[dict]:
    """[Muon group, AdamW group] of `model`'s trainable parameters: 2-D ones whose names hold neither "embed" nor
    "lm_head" to Muon (DeepSpeed's and Keller Jordan's rule), the rest to AdamW; `muon_options` go into the Muon
    group. Empty groups are left out."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            hidden = p.dim() == 2 and not any(word in name.lower() for word in ("embed", "lm_head"))
            (muon if hidden else adamw).append(p)
    groups = [dict(params=muon, use_muon=True, **muon_options), dict(params=adamw, use_muon=False)]
    return [g for g in groups if g["params"]]


class CoatFP8Muon(unquantized.ReferenceArm, CoatFP8Optimizer):
    NAME = "CoatFP8Muon"

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=NS_COEFFICIENTS, eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 betas=(0.9, 0.999), adamw_eps=1e-8, state_dtype: str = "fp8",
                 config: OptimizerConfig | None = None, **options):
        config = coat_config(self.NAME, config, options, HYPER_NAMES, NO_TORCH_OPTIONS)
        if config.master_remainders:
            raise ValueError("CoatFP8Muon does not support master_remainders (CoatFP8AdamW's option)")
        self.state_dtype = state_dtype
        self._unquantized = unquantized.check_state_dtype(self.NAME, state_dtype)
        self._adamw_eps = adamw_eps
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        betas=tuple(betas))
        _check_muon(dict(defaults, eps=eps))
        validation.check_hyper_parameters(lr, betas, adamw_eps, weight_decay, self.NAME)
        self._muon_eps = eps
        super().__init__(params, defaults, config)

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, with `use_muon` settled (see the module docstring) and Muon groups' parameters
        checked to be 2-D; the group's eps defaults to Muon's eps or adamw_eps by its kind."""
        if isinstance(param_group, dict) and "params" in param_group:
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group = {**param_group, "params": params}
            if "use_muon" not in param_group:
                if not all(isinstance(p, torch.Tensor) and p.dim() == 2 for p in params):
                    raise ValueError("CoatFP8Muon: a param group without \"use_muon\" holds parameters that are not "
                                     "2-D matrices; mark each group use_muon=True (2-D hidden matrices) or False "
                                     "(stepped by AdamW), e.g. with coat_kernels.optim.muon_param_groups(model)")
                param_group["use_muon"] = True
            if not isinstance(param_group["use_muon"], bool):
                raise TypeError(f"CoatFP8Muon: use_muon must be a bool, got {param_group['use_muon']!r}")
            if param_group["use_muon"]:
                for p in params:
                    if isinstance(p, torch.Tensor) and p.dim() != 2:
                        raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter with size: "
                                         f"{tuple(p.shape)} (put it in a use_muon=False group)")
            param_group.setdefault("eps", self._muon_eps if param_group["use_muon"] else self._adamw_eps)
        super().add_param_group(param_group)

    def moments_of(self, group: dict) -> tuple[str, ...]:
        return coat_state.MOMENTUM if group["use_muon"] else coat_state.MOMENTS

    def _check_group(self, group: dict) -> None:
        if group["use_muon"]:
            _check_muon(group)
        else:
            validation.check_hyper_parameters(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                                              self.NAME)

    def _group_scalars(self, group: dict, step: float):
        if not group["use_muon"]:
            beta1, beta2 = group["betas"]
            return AdamWScalars.make(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step)
        return MuonScalars(*(group[k] for k in ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients",
                                                "eps", "ns_steps", "adjust_lr_fn")))

    def _run_batch(self, group: dict, key: tuple, items: list, cfg: OptimizerConfig) -> None:
        if not group["use_muon"]:
            return run_adamw_batch(self, key, items, cfg)
        for p, _, _, layout, _ in items:
            if p.dim() != 2:
                raise RuntimeError(f"CoatFP8Muon needs whole 2-D matrices in Muon groups, got a tensor of shape "
                                   f"{tuple(p.shape)} (a ZeRO partition or shard?)")
            covered = sum(n for _, n, _ in layout.runs)
            if covered != p.numel():
                raise RuntimeError(f"CoatFP8Muon needs whole matrices in Muon groups: param_segments gives "
                                   f"{covered} of the {tuple(p.shape)} matrix's {p.numel()} elements")
        counter = self._counter(key[1])
        if key[0]:
            counter.add_(self._run_muon_kernels(key[1], items, cfg.moment_configs()[0]))
            return
        layouts = [it[3] for it in items]
        for indices in moment_batch.batches(layouts):
            batch_items = [items[i] for i in indices]
            counter.add_(self._run_muon_batch(key, batch_items, cfg.moment_configs()[0]))

    def _run_muon_kernels(self, device: torch.device, items: list, m_cfg) -> torch.Tensor:
        """Muon steps of `items` on muon_triton's kernels: per batch of matrices (one gradient dtype, at most
        moment_batch's element count, which bounds the bf16 updates held at once) their finiteness and momenta in two
        launches, then per matrix Newton-Schulz and the parameter's update in one launch; no host synchronisation.
        Returns the skipped groups (int32, 0-dim, on the device)."""
        from . import muon_triton

        skipped = []
        for dtype in dict.fromkeys(it[1].dtype for it in items):
            same_dtype = [it for it in items if it[1].dtype == dtype]
            for indices in moment_batch.batches([it[3] for it in same_dtype]):
                batch_items = [same_dtype[i] for i in indices]
                key = ("muon_kernels", device, dtype) + tuple(id(it[3]) for it in batch_items)
                batch = self._launchers.get(key)
                if batch is None:
                    batch = self._launchers[key] = muon_triton.MomentumBatch([it[3] for it in batch_items], device)
                h = batch_items[0][4]
                updates, flags = batch.step([it[1] for it in batch_items], [it[2]["exp_avg_q"] for it in batch_items],
                                            [it[2]["exp_avg_meta"] for it in batch_items], h.momentum, h.nesterov,
                                            m_cfg)
                for i, ((p, _, _, _, h), update) in enumerate(zip(batch_items, updates)):
                    orthogonal = newton_schulz(update, h.ns_coefficients, h.ns_steps, h.eps)
                    muon_triton.apply_update_(p, orthogonal, 1 - h.lr * h.weight_decay,
                                              adjusted_lr(h.lr, h.adjust_lr_fn, p.shape), flags[i])
                skipped.append(batch.skipped(flags))
        return torch.stack(skipped).sum(dtype=torch.int32)

    def _run_muon_batch(self, key: tuple, items: list, m_cfg) -> torch.Tensor:
        """Muon steps of `items` with their momenta (de)quantized in one call each (a MomentBatch, kept per list of
        layouts); no host synchronisation. Returns the skipped groups (int32, 0-dim, on the device)."""
        use_triton, device = key[0], key[1]
        cache_key = ("muon", use_triton, device) + tuple(id(it[3]) for it in items)
        batch = self._launchers.get(cache_key)
        if batch is None:
            batch = self._launchers[cache_key] = moment_batch.MomentBatch([it[3] for it in items], device, use_triton)
        states = [it[2] for it in items]
        momenta = batch.dequantize([st["exp_avg_q"] for st in states], [st["exp_avg_meta"] for st in states])
        finite, new_momenta = [], []
        for (p, grad, _, _, h), m in zip(items, momenta):
            ok = torch.isfinite(grad).all()
            m, new_p = muon_update(p, grad, m.view(p.shape), h)
            torch.where(ok, new_p, p, out=p)
            finite.append(ok)
            new_momenta.append(m)
        codes, metas = batch.quantize(new_momenta, m_cfg)
        for st, ok, new_codes, new_meta in zip(states, finite, codes, metas):
            stored = st["exp_avg_q"].view(torch.uint8)
            torch.where(ok, new_codes.view(torch.uint8), stored, out=stored)
            torch.where(ok, new_meta, st["exp_avg_meta"], out=st["exp_avg_meta"])
        return batch.skipped(finite)

    def set_fp32_moments(self, p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor | None = None,
                         step: float | None = None) -> None:
        """Replace p's moments by these fp32 values (p's numel, any shape), quantized now on p's groups: the
        momentum alone for a Muon group's tensor, exp_avg and exp_avg_sq for an AdamW group's."""
        values = {"exp_avg": exp_avg} if exp_avg_sq is None else {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        expected = self.moments_of(self._group_of(p)[1])
        if tuple(values) != expected:
            raise ValueError(f"{self._describe(p)} keeps {', '.join(expected)}; got {', '.join(values)}")
        self._set_fp32_moments(p, values, step)

    # ---- torch.optim.Muon's layout -------------------------------------------------------------------------------
    def torch_format_state_dict(self) -> dict:
        """base's torch layout, with Muon groups' momentum named torch.optim.Muon's way (`momentum_buffer`)."""
        state_dict = super().torch_format_state_dict()
        for group in state_dict["param_groups"]:
            if group["use_muon"]:
                for pid in group["params"]:
                    entry = state_dict["state"].get(pid)
                    if entry is not None and "exp_avg" in entry:
                        entry[TORCH_BUFFER] = entry.pop("exp_avg")
        return state_dict

    def load_state_dict(self, state_dict):
        """base's load_state_dict (FP8 entries, or fp32 moments to quantize); a Muon group's `momentum_buffer`
        (torch.optim.Muon's state, which counts no steps: step 0 then) is its momentum. A saved group must have the
        same use_muon as this one's; options it lacks are this optimizer's."""
        for index, (group, saved) in enumerate(zip(self.param_groups, state_dict.get("param_groups", []))):
            if saved.get("use_muon", group["use_muon"]) != group["use_muon"]:
                raise StateError(f"param group {index} of the loaded state dict has use_muon={saved['use_muon']!r}, "
                                 f"this optimizer's use_muon={group['use_muon']!r}")
        groups = [{**{k: v for k, v in group.items() if k != "params"}, **saved}  # torch's groups lack use_muon
                  for group, saved in zip(self.param_groups, state_dict.get("param_groups", []))]
        state_dict = {**state_dict, "param_groups": groups,
                      "state": {pid: _from_torch_muon(entry) for pid, entry in state_dict["state"].items()}}
        if self._unquantized is None:
            return super().load_state_dict(state_dict)
        torch.optim.Optimizer.load_state_dict(self, state_dict)
        unquantized.restore_dtypes(self, coat_state.MOMENTS, self._unquantized)

    # ---- the reference arm ---------------------------------------------------------------------------------------
    def _unquantized_step(self, group, p, grad, entry):
        self._check_group(group)
        moments = unquantized.buffers(entry, p, self.moments_of(group), self._unquantized)
        entry["step"] += 1
        if group["use_muon"]:
            m, new_p = muon_update(p, grad, moments[0].float(), self._group_scalars(group, float(entry["step"])))
            moments[0].copy_(m)
            p.copy_(new_p)
        else:
            unquantized.adamw_step(p, grad, *moments, float(entry["step"]), group["lr"], *group["betas"],
                                   group["eps"], group["weight_decay"])


def muon_update(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, h: MuonScalars):
    """(new momentum fp32, new parameter) of one Muon step from the momentum m (fp32, p's shape; updated in place, as
    torch.optim.Muon updates its buffer), in torch.optim.Muon's operations."""
    g = grad.to(m.dtype)
    m.lerp_(g, 1 - h.momentum)
    return m, apply_update(p, g.lerp(m, h.momentum) if h.nesterov else m, h)


def apply_update(p: torch.Tensor, update: torch.Tensor, h: MuonScalars) -> torch.Tensor:
    """The new parameter from the momentum's update (p's shape): orthogonalised, then p (1 - lr wd) - lr' update."""
    update = newton_schulz(update, h.ns_coefficients, h.ns_steps, h.eps)
    return p.mul(1 - h.lr * h.weight_decay).add_(update, alpha=-adjusted_lr(h.lr, h.adjust_lr_fn, p.shape))


def _from_torch_muon(entry):
    """An entry with torch.optim.Muon's momentum_buffer as this optimizer's exp_avg (and a step count)."""
    if not isinstance(entry, dict) or TORCH_BUFFER not in entry:
        return entry
    renamed = {("exp_avg" if k == TORCH_BUFFER else k): v for k, v in entry.items()}
    renamed.setdefault("step", torch.tensor(0.0))
    return renamed


def _check_muon(group: dict) -> None:
    """torch.optim.Muon's checks of a Muon group's hyper-parameters, and the types a step needs."""
    where = "CoatFP8Muon hyper-parameters: "
    for name in ("lr", "weight_decay", "momentum", "eps"):
        value = group[name]
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError(f"{where}{name} must be a finite number, got {value!r}")
        if value < 0:
            raise ValueError(f"{where}{name} must be >= 0, got {value!r}")
    if not isinstance(group["nesterov"], bool):
        raise TypeError(f"{where}nesterov must be a bool, got {group['nesterov']!r}")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
        raise ValueError(f"{where}ns_steps must be an int in [0, 100), got {steps!r}")
    coefficients = group["ns_coefficients"]
    if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3 or any(
            isinstance(c, bool) or not isinstance(c, numbers.Real) for c in coefficients):
        raise ValueError(f"{where}ns_coefficients must be three numbers (a, b, c), got {coefficients!r}")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"{where}adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {group['adjust_lr_fn']!r}")
