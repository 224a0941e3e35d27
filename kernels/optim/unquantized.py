"""The reference arms of CoatFP8Lion and CoatFP8Muon (`state_dtype="fp32"` or `"bf16"`): the same algorithms with the
momentum (and, in Muon's AdamW groups, both moments) kept unquantized in that dtype, written as the usual torch
implementations write them (lion-pytorch's Lion, torch.optim.AdamW's single-tensor step, torch.optim.Muon's momentum).

Entries hold `step` and the unquantized moments shaped like the parameter; state dicts are torch's (their moments
are put back in `state_dtype` after a load, which casts them to the parameter's dtype).
"""
from __future__ import annotations

import math

import torch

STATE_DTYPES = {"fp8": None, "fp32": torch.float32, "bf16": torch.bfloat16}


def check_state_dtype(name: str, state_dtype) -> torch.dtype | None:
    """The torch dtype of an unquantized state, None for the FP8 one; ValueError naming the choices otherwise."""
    if not isinstance(state_dtype, str) or state_dtype not in STATE_DTYPES:
        raise ValueError(f"{name}: state_dtype must be one of {', '.join(map(repr, STATE_DTYPES))}, got "
                         f"{state_dtype!r}")
    return STATE_DTYPES[state_dtype]


def buffers(state: dict, p: torch.Tensor, keys: tuple[str, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """The entry's moments `keys` (zeros, and step 0, on first use)."""
    if "step" not in state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
    for key in keys:
        if key not in state:
            state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    return [state[key] for key in keys]


def restore_dtypes(optimizer: torch.optim.Optimizer, keys: tuple[str, ...], dtype: torch.dtype) -> None:
    """After torch's load_state_dict (which casts state tensors to the parameter's dtype): moments in `dtype`."""
    for entry in optimizer.state.values():
        for key in keys:
            if key in entry and entry[key].dtype != dtype:
                entry[key] = entry[key].to(dtype)


def lion_step(p: torch.Tensor, g: torch.Tensor, exp_avg: torch.Tensor, lr, beta1, beta2, weight_decay) -> None:
    """Lion (lion-pytorch's operations), momentum in exp_avg's dtype."""
    m = exp_avg.float()
    update = m.lerp(g.float(), 1 - beta1).sign_()
    p.mul_(1 - lr * weight_decay).add_(update.to(p.dtype), alpha=-lr)
    exp_avg.copy_(m.lerp_(g.float(), 1 - beta2))


def adamw_step(p, g, exp_avg, exp_avg_sq, step: float, lr, beta1, beta2, eps, weight_decay) -> None:
    """AdamW (torch.optim.AdamW's single-tensor operations), moments in their own dtype, `step` counted from 1."""
    m, v, g = exp_avg.float(), exp_avg_sq.float(), g.float()
    p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-lr / (1 - beta1 ** step))
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)


class ReferenceArm:
    """The `state_dtype="fp32"` / `"bf16"` option of an FP8 optimizer (listed before it among the bases): with
    `_unquantized` set (the moments' torch dtype), a step is `run_step` over the subclass's `_unquantized_step`;
    without (FP8 state), the FP8 optimizer's own step."""

    _unquantized: torch.dtype | None

    def step(self, closure=None):
        if self._unquantized is None:
            return super().step(closure)
        return run_step(self, closure, self._unquantized_step)


def run_step(optimizer: torch.optim.Optimizer, closure, step_tensor) -> object:
    """An optimizer step over every parameter with a gradient: `step_tensor(group, p, grad, entry)` each."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError(f"{type(optimizer).__name__} does not support sparse gradients")
                    step_tensor(group, p, p.grad, optimizer.state[p])
    return loss
