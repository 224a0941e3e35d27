"""The FP8 activation half of COAT: everything a transformer layer saves for backward is FP8 (per-tensor E4M3 for
GEMM inputs, E5M2 for gradients, 1x16 E4M3 groups for what non-linear layers consume and save).

Modules: `config` (ActivationConfig), `runtime` (CoatRuntime: what a model's blocks share), `modules` (nn.Modules
with TransformerEngine's names), `functional` and `fused_mlp` (the autograd blocks, sharing `block_parts`),
`compiled_ops` (the same blocks as torch.library custom ops, which they dispatch to under torch.compile),
`layer_graphs` (per-layer CUDA graphs), `saved_tensors` (what an autograd graph saved), `weights` (FP8 weights once
per optimizer step), and the kernels, each with its torch reference: `group_quant` (1x16), `tensor_quant`
(per-tensor), `scaling` (stage-2 scale protocol), `handoff` (gradient amaxes between blocks), `norm`, `swiglu`,
`rope`, `pointwise`, `gemm`, `tiles` (Triton helpers).
"""
from .config import ActivationConfig
from .functional import (fp8_add_norm_linear, fp8_gelu, fp8_linear, fp8_norm_linear, fp8_silu, fp8_swiglu,
                         fp8_swiglu_linear)
from .fused_mlp import fp8_norm_swiglu_mlp
from .modules import Fp8Linear, Fp8NormLinear, Fp8NormSwigluMLP, Norm
from .runtime import CoatRuntime
from .weights import StepClock, WeightCache

__all__ = ["ActivationConfig", "CoatRuntime", "Fp8Linear", "Fp8NormLinear",
           "Fp8NormSwigluMLP", "Norm", "StepClock", "WeightCache", "fp8_add_norm_linear",
           "fp8_gelu", "fp8_linear", "fp8_norm_linear", "fp8_norm_swiglu_mlp", "fp8_silu", "fp8_swiglu",
           "fp8_swiglu_linear"]
