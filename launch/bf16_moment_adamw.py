"""AdamW with both moments stored in bf16 over fp32 master weights: the BF16-moments recipe large-model teams run.

Storage and arithmetic are those of DeepSpeed's FusedAdam on bf16 state tensors and of TransformerEngine's FusedAdam
under Megatron's precision-aware optimizer (`--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16`): each step reads the bf16
moments into fp32, does torch.optim.AdamW's update in fp32 (decoupled weight decay, t counted from 1), and stores the
new moments back rounded to nearest even. 4 bytes of moments per parameter. (DeepSpeed's
`"bf16": {"bf16_optimizer_states": true}` stores its moments this way too, but also requires bf16 master weights:
launch/ds_optimizer_recipes.py runs that recipe itself.)

compile_step: each tensor's step is one torch.compile'd function (a fused kernel per tensor, as torchao's optimizers
do; lr and the step count are tensors, so a schedule recompiles nothing); else eager torch ops.
"""
from __future__ import annotations

import torch


def adamw_bf16_moments_step(p, g, exp_avg, exp_avg_sq, lr, step, beta1: float, beta2: float, eps: float,
                            weight_decay: float):
    """One AdamW step of fp32 p with bf16 moments, in place. lr, step: fp32 0-dim tensors (CPU or p's device)."""
    m = exp_avg.float().lerp(g.float(), 1 - beta1)
    v = exp_avg_sq.float() * beta2 + g.float().square() * (1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    denom = (v.sqrt() / bias_correction2.sqrt()) + eps
    p.copy_(p * (1 - lr * weight_decay) - lr * (m / bias_correction1) / denom)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)


class BF16MomentAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, compile_step=False):
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid AdamW hyper-parameters: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.step_function = (torch.compile(adamw_bf16_moments_step, fullgraph=True, dynamic=False)
                              if compile_step else adamw_bf16_moments_step)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # one compiled graph per tensor shape: more shapes than torch's default recompile limit (as torchao does)
        with torch._dynamo.utils.disable_cache_limit():
            self._step_groups()
        return loss

    def _step_groups(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = torch.tensor(float(group["lr"]))  # 0-dim CPU tensors, as torch.optim keeps steps: no copies
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.float32:
                    raise TypeError(f"BF16MomentAdamW steps fp32 master weights; got a {p.dtype} parameter")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(())
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                self.step_function(p, p.grad, state["exp_avg"], state["exp_avg_sq"], lr, state["step"], beta1,
                                   beta2, group["eps"], group["weight_decay"])
