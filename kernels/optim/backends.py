"""How a planned CoatFP8AdamW step runs on each backend, over `items`: (param, grad, entry, layout, AdamW scalars)
per tensor, sharing device, dtypes and moment configs.

`use_triton` says which tensors the Triton kernel takes (backend="auto": CUDA tensors whose group size it supports;
backend="triton": all, or an error); `launch_triton` runs it, `run_cpu` the C++ step (CPU tensors under "auto"),
`run_reference` the torch reference (every other case). All give the same bits; each returns or counts the groups
skipped for non-finite gradients.
"""
from __future__ import annotations

import warnings
from functools import cache

import torch

from ..triton_fp8 import require_triton_device
from . import dre_reference as reference
from .grouping import concat_layouts
from .state import CODE_KEYS, META_KEYS, REMAINDER_KEY


def check_device(backend: str, p: torch.Tensor) -> None:
    """At construction: backend="triton" refuses a tensor the Triton kernels cannot run on (a CPU tensor without
    the interpreter), naming the backend to use instead."""
    if backend == "triton":
        require_triton_device(p, "CoatFP8AdamW")


def use_triton(backend: str, p: torch.Tensor, group_size: int) -> bool:
    """Whether the Triton kernel steps `p` (and its groups of `group_size`) under `backend`. Under "auto", CUDA
    tensors with a group size the kernel does not take are stepped by the torch reference, with one warning per
    group size."""
    from .dre_triton import supports_group_size

    if backend == "triton":
        if not supports_group_size(group_size):
            raise ValueError(f"backend='triton' needs a power-of-two group_size >= 4, got {group_size}")
        require_triton_device(p, "CoatFP8AdamW")
        return True
    if backend != "auto" or not p.is_cuda:
        return False
    if not supports_group_size(group_size):
        warn_reference_fallback(group_size)
        return False
    return True


@cache
def warn_reference_fallback(group_size: int) -> None:
    warnings.warn(f"CoatFP8AdamW: group_size={group_size} is not a power of two >= 4, which the fused Triton kernel "
                  "needs: CUDA tensors are stepped by the torch reference (same bits, many times slower). Use a "
                  "power-of-two group_size (128 by default) for the fused kernel.", RuntimeWarning, stacklevel=3)


def launch_triton(launchers: dict, device, items, m_cfg, v_cfg, counter, remainder: bool) -> None:
    """The Triton kernel over `items`, its launcher kept in `launchers` per list of layouts; skipped groups
    counted into `counter`."""
    from . import dre_triton

    layouts = [it[3] for it in items]
    key = tuple(id(lay) for lay in layouts)
    if key not in launchers:
        launchers[key] = dre_triton.FusedAdamW(layouts, device)
    states = [it[2] for it in items]
    remainders = [s[REMAINDER_KEY] for s in states] if remainder else None
    launchers[key]([it[0] for it in items], [it[1] for it in items],
                   [s["exp_avg_q"] for s in states], [s["exp_avg_meta"] for s in states],
                   [s["exp_avg_sq_q"] for s in states], [s["exp_avg_sq_meta"] for s in states],
                   [it[4] for it in items], m_cfg, v_cfg, counter, remainders=remainders)


def run_cpu(items, m_cfg, v_cfg, remainder: bool) -> torch.Tensor:
    """CPU tensors: the C++ step, one call per tensor (the torch reference when the library cannot be built)."""
    from . import cpu_step

    if cpu_step.library() is None:
        return run_reference(items, m_cfg, v_cfg, remainder)
    skipped = torch.zeros((), dtype=torch.int64)
    for p, grad, st, layout, scalars in items:
        skipped += cpu_step.fused_adamw_step(p, grad, st["exp_avg_q"], st["exp_avg_meta"], st["exp_avg_sq_q"],
                                             st["exp_avg_sq_meta"], layout, scalars, m_cfg, v_cfg,
                                             remainder=st[REMAINDER_KEY] if remainder else None)
    return skipped


def run_reference(items, m_cfg, v_cfg, remainder: bool) -> torch.Tensor:
    """The PyTorch reference step for tensors sharing device, dtypes and AdamW scalars: one call over their
    concatenation (the reference costs hundreds of small ops per call), results copied back."""
    if len(items) == 1:
        p, grad, st, layout, scalars = items[0]
        return reference.fused_adamw_step(p, grad, st["exp_avg_q"], st["exp_avg_meta"], st["exp_avg_sq_q"],
                                          st["exp_avg_sq_meta"], layout, scalars, m_cfg, v_cfg,
                                          remainder=st[REMAINDER_KEY] if remainder else None)
    params, grads, states, layouts, scalars = zip(*items)

    def cat(tensors):
        return torch.cat([t.reshape(-1).view(torch.uint8) if t.is_floating_point() and t.element_size() == 1
                          else t.reshape(-1) for t in tensors])

    p, g = cat(params), cat(grads)
    codes = {k: cat([st[k] for st in states]).view(states[0][k].dtype) for k in CODE_KEYS}
    metas = {k: torch.cat([st[k] for st in states], dim=1) for k in META_KEYS}
    r = cat([st[REMAINDER_KEY] for st in states]) if remainder else None
    skipped = reference.fused_adamw_step(p, g, codes["exp_avg_q"], metas["exp_avg_meta"], codes["exp_avg_sq_q"],
                                         metas["exp_avg_sq_meta"], concat_layouts(layouts), scalars[0], m_cfg, v_cfg,
                                         remainder=r)
    start = groups = 0
    for param, st, layout in zip(params, states, layouts):
        n, k = layout.numel, layout.num_groups
        param.view(-1).copy_(p[start:start + n])
        if r is not None:
            st[REMAINDER_KEY].copy_(r[start:start + n])
        for key in codes:
            st[key].view(torch.uint8).copy_(codes[key][start:start + n].view(torch.uint8))
        for key in metas:
            st[key].copy_(metas[key][:, groups:groups + k])
        start, groups = start + n, groups + k
    return skipped
