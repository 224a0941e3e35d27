"""CoatMLP: Megatron's MLP with COAT's FP8 non-linearity between fc1 and fc2.

fc1 is the fused norm + FP8 column-parallel linear; fc2 (CoatRowParallelLinear) is built with the activation that
matches the config (`activation=`), so SwiGLU (or GELU) reads fc1's output, saves it in FP8 groups and feeds fc2's
FP8 GEMM. Everything else, including `sharded_state_dict` with the [gate, up] interleave factory for TP resharding,
is Megatron's MLP.
"""
from __future__ import annotations

import dataclasses

import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import get_module

from .bound_spec import bind
from .layers import CoatRowParallelLinear


def coat_activation(config) -> str:
    """The FP8 block matching config's activation: "swiglu" (silu + GLU) or "gelu" (no GLU)."""
    if config.gated_linear_unit and config.activation_func is F.silu:
        return "swiglu"
    if not config.gated_linear_unit and config.activation_func is F.gelu:
        return "gelu"
    name = getattr(config.activation_func, "__name__", config.activation_func)
    raise ValueError(f"COAT MLP supports SwiGLU (--swiglu) and GELU; got activation {name} with "
                     f"gated_linear_unit={config.gated_linear_unit}")


class CoatMLP(MLP):
    def __init__(self, config, submodules, *args, **kwargs):
        fc2 = get_module(submodules.linear_fc2)
        if not (isinstance(fc2, type) and issubclass(fc2, CoatRowParallelLinear)):
            raise TypeError(f"CoatMLP needs CoatRowParallelLinear as linear_fc2, got {fc2}")
        if config.use_te_activation_func:
            raise ValueError("CoatMLP runs its own FP8 activation: unset use_te_activation_func")
        fc2_spec = bind(submodules.linear_fc2, activation=coat_activation(config))
        super().__init__(config, dataclasses.replace(submodules, linear_fc2=fc2_spec), *args, **kwargs)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            raise NotImplementedError("CoatMLP does not support per_token_scale (MoE experts)")
        intermediate, fc1_bias = self.linear_fc1(hidden_states)
        if fc1_bias is not None:
            intermediate = intermediate + fc1_bias
        return self.linear_fc2(intermediate)
