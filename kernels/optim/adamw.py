"""CoatFP8AdamW: AdamW whose two moments live in FP8 with per-group Dynamic Range Expansion (COAT).

A drop-in for torch.optim.AdamW (decoupled weight decay, t counted from 1) that knows no training engine.
Parameters are the fp32 (or bf16) master weights; gradients fp32, bf16 or fp16. backend="auto": CUDA tensors are
stepped by one fused Triton launch per param group and dtype pair, CPU tensors by the C++ step (coat_kernels.optim.
cpu_step; the torch reference when it cannot be built); backend="torch": the PyTorch reference of the same math on any
device; backend="triton": the kernel (on CPU tensors under TRITON_INTERPRET=1). All give the same bits.

COAT options: `OptimizerConfig` (coat_kernels.optim.config), given as `config=` and/or keyword arguments; the
per-group ones (formats, expansion, group size, expand_min, k_max) are stored in each param group like lr.
State per tensor: see coat_kernels.optim.state; checkpoint formats (torch.optim's fp32 layout, state dicts,
pickling): coat_kernels.optim.checkpoint. With `master_remainders` a bf16 parameter is its own fp32 master
weight: its entry keeps the master's low 16 bits, and every step reads and writes the master exactly
(coat_kernels.optim.master_remainders; `fp32_master` / `set_fp32_master` read and write it). fp32 `exp_avg` /
`exp_avg_sq` found in a state entry (DeepSpeed's universal-checkpoint loader writes them) are quantized when the entry
is next planned.

The machinery it shares with CoatFP8Lion and CoatFP8Muon (state entries, options, validation, checkpoints, the
engines' hooks, the non-finite policy) is coat_kernels.optim.base.CoatFP8Optimizer. Engines that hand the optimizer
flat tensors holding fragments of several parameters (ZeRO partitions,
distributed-optimizer shards) say where each fragment comes from by overriding `param_segments`, so that
quantization groups follow each parameter's own grid and never straddle two parameters.

States are checked before they are used (coat_kernels.optim.validation.validate_entry): `load_state_dict` and unpickling
check every entry against its parameter, layout and param group, values included, and raise StateError (naming the
parameter, the key and the problem) with the optimizer left as it was; a step checks keys, dtypes and shapes. A step
checks and plans every group before it writes anything: one that raises leaves parameters, moments and steps as they
were (nonfinite="error" aside, see below).

Non-finite gradients (nonfinite="skip_group", the default): a quantization group whose gradient holds NaN or Inf
(seen as a non-finite new second moment: a gradient whose square overflows fp32 counts too) keeps its parameters and
moments unchanged; `skipped_groups` counts such groups (reading it synchronizes). nonfinite="error" does the same
and then raises FloatingPointError.
"""
from __future__ import annotations

import torch

from . import backends, checkpoint, validation
from . import state as coat_state
from .base import REMAINDER, CoatFP8Optimizer, coat_config
from .config import OptimizerConfig
from .dre_reference import AdamWScalars
from .master_remainders import join as join_master
from .master_remainders import split as split_master
from .validation import StateError


class CoatFP8AdamW(CoatFP8Optimizer):
    NAME = "CoatFP8AdamW"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 config: OptimizerConfig | None = None, **options):
        config = coat_config(self.NAME, config, options, ("lr", "betas", "eps", "weight_decay"),
                             validation.TORCH_ADAMW_DEFAULTS)
        validation.check_hyper_parameters(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), config)

    def moments_of(self, group: dict) -> tuple[str, ...]:
        return coat_state.MOMENTS

    def _check_group(self, group: dict) -> None:
        validation.check_hyper_parameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def _group_scalars(self, group: dict, step: float) -> AdamWScalars:
        beta1, beta2 = group["betas"]
        return AdamWScalars.make(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step)

    def _run_batch(self, group: dict, key: tuple, items: list, cfg: OptimizerConfig) -> None:
        run_adamw_batch(self, key, items, cfg)

    def _check_saved_group(self, saved: dict, where: str) -> None:
        validation.check_torch_options(saved, where)  # torch.optim.AdamW options CoatFP8AdamW lacks

    def set_fp32_moments(self, p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         step: float | None = None) -> None:
        """Replace p's moments by these fp32 values (p's numel, any shape; finite, exp_avg_sq >= 0), quantized now
        on p's groups. Bad values raise StateError and leave the state as it was."""
        self._set_fp32_moments(p, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, step)

    def torch_adamw_state_dict(self) -> dict:
        """The state in torch.optim.AdamW's layout: per parameter `step` and fp32 `exp_avg` / `exp_avg_sq` shaped like
        it; param groups keep their COAT options (torch AdamW carries them along unused). `torch.optim.AdamW(params).
        load_state_dict(...)` continues the run without COAT; `CoatFP8AdamW.load_state_dict` takes it back, with the
        groups' options and the FP8 state restored bit for bit on the same tensors. (A torch AdamW state dict loads
        into CoatFP8AdamW as it is: its moments are quantized with this optimizer's options.)"""
        return self.torch_format_state_dict()

    def fp32_master(self, p: torch.Tensor) -> torch.Tensor:
        """p's fp32 master weight, shaped like p: (p, its remainder) joined for a bf16 p with master remainders,
        else p as fp32. `set_fp32_master` with it changes nothing."""
        if not coat_state.needs_remainder(self.config, p.dtype):
            return p.detach().float()
        self._ensure_entry(p)
        return join_master(p, self.state[p][REMAINDER].view(p.shape))

    def set_fp32_master(self, p: torch.Tensor, master: torch.Tensor) -> None:
        """Write p's fp32 master weight (p's numel elements, any shape): a bf16 p with master remainders keeps it
        exactly (the bf16 value rounded to nearest, ties away from zero, and the remainder), any other p gets it
        cast to its dtype."""
        if master.numel() != p.numel():
            raise ValueError(f"a master of {master.numel()} elements for a tensor of {p.numel()}")
        master = master.detach().to(device=p.device).reshape(p.shape)
        bad = ~torch.isfinite(master)
        if bad.any():
            raise StateError(f"{self._describe(p)}: cannot set a master weight holding {int(bad.sum())} "
                             f"NaN/Inf value(s) (first at element {int(bad.view(-1).nonzero()[0, 0])})")
        with torch.no_grad():
            if not coat_state.needs_remainder(self.config, p.dtype):
                p.copy_(master)
                return
            self._ensure_entry(p)
            param, remainder = split_master(master)
            p.copy_(param)
            self.state[p][REMAINDER].copy_(remainder.view(-1))


def run_adamw_batch(optimizer: CoatFP8Optimizer, key: tuple, items: list, cfg: OptimizerConfig) -> None:
    """The fused AdamW step over `items` (see CoatFP8Optimizer._run_batch) on the backend the key names: the Triton
    kernel, the C++ step (CPU tensors under backend="auto") or the torch reference. CoatFP8Muon steps its AdamW
    param groups through it too."""
    use_triton, device, _, _, _, remainder, *_ = key
    m_cfg, v_cfg = cfg.moment_configs()
    counter = optimizer._counter(device)
    if use_triton:
        backends.launch_triton(optimizer._launchers, device, items, m_cfg, v_cfg, counter, remainder)
    elif device.type == "cpu" and optimizer.config.backend == "auto":
        counter.add_(backends.run_cpu(items, m_cfg, v_cfg, remainder))
    else:
        counter.add_(backends.run_reference(items, m_cfg, v_cfg, remainder))


# pickles that name the FP8 wrapper by this module's name unpickle through it
_PicklableCodes = checkpoint.PicklableCodes
