"""nn.Modules of the activation half, with TransformerEngine's parameter names, over the blocks of `functional`.

Every module takes `config` (ActivationConfig) and `runtime` (CoatRuntime; pass the model's one to all its modules,
and attach it to the optimizer: `runtime.attach_optimizer(opt)`); each weight gets a WeightCache of that runtime.
Parameters are created in `params_dtype` on `device` and initialised like torch's nn.Linear (norm weights to one);
they can also be assigned afterwards (the Megatron wrappers and the Hugging Face conversion hand in their own).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .config import ActivationConfig
from .functional import fp8_add_norm_linear, fp8_linear, fp8_norm_linear
from .fused_mlp import fp8_norm_swiglu_mlp
from .runtime import CoatRuntime

NORMS = ("rmsnorm", "layernorm")


class _Fp8Module(torch.nn.Module):
    def __init__(self, config, runtime):
        super().__init__()
        self.config = config or ActivationConfig()
        self.runtime = runtime or CoatRuntime()

    def _weight(self, rows, cols, device, dtype):
        w = torch.nn.Parameter(torch.empty(rows, cols, device=device, dtype=dtype))
        torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        return w

    def _bias(self, n, fan_in, device, dtype):
        b = torch.nn.Parameter(torch.empty(n, device=device, dtype=dtype))
        bound = 1 / math.sqrt(fan_in)
        torch.nn.init.uniform_(b, -bound, bound)
        return b

    def _norm_params(self, n, norm, zero_centered_gamma, device, dtype):
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        gamma = torch.zeros if zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(gamma(n, device=device, dtype=dtype))
        self.layer_norm_bias = (torch.nn.Parameter(torch.zeros(n, device=device, dtype=dtype))
                                if norm == "layernorm" else None)


class Fp8Linear(_Fp8Module):
    """y = x @ weight.T + bias, FP8 GEMM; saves x^T as per-tensor E4M3 (or x itself: reuse_input)."""

    def __init__(self, in_features, out_features, bias=False, *, reuse_input=False, config=None, runtime=None,
                 device=None, params_dtype=torch.bfloat16):
        super().__init__(config, runtime)
        self.weight = self._weight(out_features, in_features, device, params_dtype)
        self.bias = self._bias(out_features, in_features, device, params_dtype) if bias else None
        self.reuse_input = reuse_input
        self.weight_cache = self.runtime.new_weight_cache()

    def forward(self, x, reuse_input: bool | None = None):
        """reuse_input: this call's choice (default: the module's)."""
        return fp8_linear(x, self.weight, self.bias, config=self.config, runtime=self.runtime,
                          weight_cache=self.weight_cache,
                          reuse_input=self.reuse_input if reuse_input is None else reuse_input)


class Fp8NormLinear(_Fp8Module):
    """linear(norm(x)), TE's LayerNormLinear: saves x as E4M3 1x16 + row statistics. forward(x) -> y;
    forward(x, residual) -> (y, x + residual); forward(x, residual_out=True) -> (y, x) with x's second gradient
    joined inside the norm backward."""

    def __init__(self, in_features, out_features, bias=False, *, norm="rmsnorm", eps=1e-5,
                 zero_centered_gamma=False, config=None, runtime=None, device=None, params_dtype=torch.bfloat16):
        super().__init__(config, runtime)
        self._norm_params(in_features, norm, zero_centered_gamma, device, params_dtype)
        self.weight = self._weight(out_features, in_features, device, params_dtype)
        self.bias = self._bias(out_features, in_features, device, params_dtype) if bias else None
        self.norm, self.eps, self.zero_centered_gamma = norm, eps, zero_centered_gamma
        self.weight_cache = self.runtime.new_weight_cache()

    def forward(self, x, residual=None, residual_out=False):
        kw = dict(norm=self.norm, eps=self.eps, zero_centered_gamma=self.zero_centered_gamma, config=self.config,
                  runtime=self.runtime, weight_cache=self.weight_cache)
        if residual is not None:
            return fp8_add_norm_linear(x, residual, self.layer_norm_weight, self.layer_norm_bias, self.weight,
                                       self.bias, **kw)
        return fp8_norm_linear(x, self.layer_norm_weight, self.layer_norm_bias, self.weight, self.bias,
                               residual_out=residual_out, **kw)


class Fp8NormSwigluMLP(_Fp8Module):
    """fc2(silu(gate) * up), [gate | up] = fc1(norm(x)): TE's LayerNormMLP with SwiGLU. fc1_weight [2 F, H]
    holds gate rows then up rows. forward(x) -> y; forward(x, residual) -> (y, x + residual)."""

    def __init__(self, hidden_size, ffn_hidden_size, bias=False, *, norm="rmsnorm", eps=1e-5,
                 zero_centered_gamma=False, config=None, runtime=None, device=None, params_dtype=torch.bfloat16):
        super().__init__(config, runtime)
        self._norm_params(hidden_size, norm, zero_centered_gamma, device, params_dtype)
        self.fc1_weight = self._weight(2 * ffn_hidden_size, hidden_size, device, params_dtype)
        self.fc2_weight = self._weight(hidden_size, ffn_hidden_size, device, params_dtype)
        self.fc1_bias = self._bias(2 * ffn_hidden_size, hidden_size, device, params_dtype) if bias else None
        self.fc2_bias = self._bias(hidden_size, ffn_hidden_size, device, params_dtype) if bias else None
        self.norm, self.eps, self.zero_centered_gamma = norm, eps, zero_centered_gamma
        self.fc1_cache, self.fc2_cache = self.runtime.new_weight_cache(), self.runtime.new_weight_cache()

    def forward(self, x, residual=None):
        return fp8_norm_swiglu_mlp(x, self.layer_norm_weight, self.layer_norm_bias, self.fc1_weight, self.fc2_weight,
                                   self.fc1_bias, self.fc2_bias, residual=residual, norm=self.norm, eps=self.eps,
                                   zero_centered_gamma=self.zero_centered_gamma, config=self.config,
                                   runtime=self.runtime, fc1_cache=self.fc1_cache, fc2_cache=self.fc2_cache)


class Norm(torch.nn.Module):
    """BF16 RMSNorm / LayerNorm with TE's parameter names (`weight`, `bias`): the final norm, which COAT keeps in
    BF16 with the LM head and the loss."""

    def __init__(self, hidden_size, *, norm="rmsnorm", eps=1e-5, zero_centered_gamma=False, device=None,
                 params_dtype=torch.bfloat16):
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        gamma = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(gamma(hidden_size, device=device, dtype=params_dtype))
        self.bias = (torch.nn.Parameter(torch.zeros(hidden_size, device=device, dtype=params_dtype))
                     if norm == "layernorm" else None)
        self.norm, self.eps, self.zero_centered_gamma = norm, eps, zero_centered_gamma

    def forward(self, x):
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.norm == "rmsnorm":
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), weight, self.bias, self.eps)
