"""CoatFP8Lion: Lion whose momentum lives in FP8 with per-group Dynamic Range Expansion (COAT's quantizer).

Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"), decoupled weight decay, as lion-pytorch
writes it: c = beta1 m + (1 - beta1) g, p = p (1 - lr wd) - lr sign(c), m = beta2 m + (1 - beta2) g. Defaults
lr=1e-4, betas=(0.9, 0.99), weight_decay=0 (lion-pytorch's). The momentum is the state's `exp_avg` (one FP8 code per
element plus per-group metadata: about 1.1 bytes per parameter at group_size 128).

Everything but the step is CoatFP8AdamW's (coat_kernels.optim.base.CoatFP8Optimizer): the COAT options (OptimizerConfig;
exp_avg_format / expand_exp_avg quantize the momentum, the exp_avg_sq options are unused), state entries without the
exp_avg_sq keys, validation, state dicts, `torch_format_state_dict` ({"step", "exp_avg"} in fp32, lion-pytorch's
layout), pickling, `param_segments` for engines, the non-finite policy (a group whose new momentum is NaN/Inf keeps
its parameters and momentum). backend="auto": CUDA tensors on the fused Triton kernel (coat_kernels.optim.lion_triton),
CPU tensors on the C++ step (cpu_lion.cpp); "torch": the reference (coat_kernels.optim.lion_reference); all give the
same bits. master_remainders is AdamW's alone.

state_dtype="fp32" or "bf16" (default "fp8"): the reference arm, the momentum unquantized in that dtype
(coat_kernels.optim.unquantized; torch's own state dicts).
"""
from __future__ import annotations

import torch

from . import cpu_step, lion_reference, unquantized, validation
from . import state as coat_state
from .base import CoatFP8Optimizer, coat_config
from .config import OptimizerConfig
from .lion_reference import LionScalars

NO_TORCH_OPTIONS = {"foreach": None, "fused": None, "maximize": False, "capturable": False, "differentiable": False}


class CoatFP8Lion(unquantized.ReferenceArm, CoatFP8Optimizer):
    NAME = "CoatFP8Lion"

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, state_dtype: str = "fp8",
                 config: OptimizerConfig | None = None, **options):
        config = coat_config(self.NAME, config, options, ("lr", "betas", "weight_decay", "state_dtype"),
                             NO_TORCH_OPTIONS)
        if config.master_remainders:
            raise ValueError("CoatFP8Lion does not support master_remainders (CoatFP8AdamW's option)")
        self.state_dtype = state_dtype
        self._unquantized = unquantized.check_state_dtype(self.NAME, state_dtype)
        validation.check_hyper_parameters(lr, betas, 0.0, weight_decay, self.NAME)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), config)

    def moments_of(self, group: dict) -> tuple[str, ...]:
        return coat_state.MOMENTUM

    def _check_group(self, group: dict) -> None:
        validation.check_hyper_parameters(group["lr"], group["betas"], 0.0, group["weight_decay"], self.NAME)

    def _group_scalars(self, group: dict, step: float) -> LionScalars:
        beta1, beta2 = group["betas"]
        return LionScalars.make(group["lr"], beta1, beta2, group["weight_decay"])

    def _run_batch(self, group: dict, key: tuple, items: list, cfg: OptimizerConfig) -> None:
        run_lion_batch(self, key, items, cfg)

    def set_fp32_moments(self, p: torch.Tensor, exp_avg: torch.Tensor, step: float | None = None) -> None:
        """Replace p's momentum by these fp32 values (p's numel, any shape; finite), quantized now on p's groups."""
        self._set_fp32_moments(p, {"exp_avg": exp_avg}, step)

    def _unquantized_step(self, group, p, grad, entry):
        self._check_group(group)
        (exp_avg,) = unquantized.buffers(entry, p, ("exp_avg",), self._unquantized)
        entry["step"] += 1
        unquantized.lion_step(p, grad, exp_avg, group["lr"], *group["betas"], group["weight_decay"])

    def load_state_dict(self, state_dict):
        if self._unquantized is None:
            return super().load_state_dict(state_dict)
        torch.optim.Optimizer.load_state_dict(self, state_dict)
        unquantized.restore_dtypes(self, ("exp_avg",), self._unquantized)


def run_lion_batch(optimizer: CoatFP8Optimizer, key: tuple, items: list, cfg: OptimizerConfig) -> None:
    """The fused Lion step over `items` (see CoatFP8Optimizer._run_batch), one call per tensor, on the backend the
    key names."""
    use_triton, device, *_ = key
    m_cfg = cfg.moment_configs()[0]
    counter = optimizer._counter(device)
    for p, grad, st, layout, h in items:
        if use_triton:
            from . import lion_triton
            from .dre_triton import TILE_GROUPS

            rows = optimizer._launchers.get(layout)
            if rows is None:
                rows = optimizer._launchers[layout] = layout.rows(TILE_GROUPS).to(device)
            lion_triton.fused_lion_step(p, grad, st["exp_avg_q"], st["exp_avg_meta"], layout, h, m_cfg, counter,
                                        rows)
        elif device.type == "cpu" and optimizer.config.backend == "auto":
            counter.add_(cpu_step.fused_lion_step(p, grad, st["exp_avg_q"], st["exp_avg_meta"], layout, h, m_cfg))
        else:
            counter.add_(lion_reference.fused_lion_step(p, grad, st["exp_avg_q"], st["exp_avg_meta"], layout, h,
                                                        m_cfg))

