"""The FP8 activation half of COAT: everything a transformer layer saves for backward is FP8 (per-tensor E4M3 for
GEMM inputs, E5M2 for gradients, 1x16 E4M3 groups for what non-linear layers consume and save).

Modules: `config` (ActivationConfig), `runtime` (CoatRuntime: what a model's blocks share), `modules` (nn.Modules
with TransformerEngine's names), `block_bodies` (each FP8 block's forward and backward, once, sharing
`block_parts`), `functional` and `fused_mlp` (the blocks as autograd Functions over those bodies), `compiled_ops` and
`compiled_mlp` (the same bodies as torch.library custom ops, which the blocks dispatch to under torch.compile;
sharing `compiled_parts`),
`layer_graphs` (per-layer CUDA graphs), `saved_tensors` (what an autograd graph saved), `weights` (FP8 weights once
per optimizer step), and the kernels, each with its torch reference: `group_quant` (1x16), `tensor_quant`
(per-tensor), `scaling` (stage-2 scale protocol), `handoff` (gradient amaxes between blocks), `norm`, `swiglu`,
`rope` (the block; its kernel in `rope_kernel`), `pointwise`, `gemm`, `tiles` (Triton helpers).
"""
from .config import ActivationConfig
from .functional import fp8_add_norm_linear, fp8_gelu, fp8_linear, fp8_norm_linear, fp8_swiglu_linear
from .fused_mlp import fp8_norm_swiglu_mlp
from .modules import Fp8Linear, Fp8NormLinear, Fp8NormSwigluMLP, Norm
from .runtime import CoatRuntime
from .weights import StepClock, WeightCache

__all__ = ["ActivationConfig", "CoatRuntime", "Fp8Linear", "Fp8NormLinear",
           "Fp8NormSwigluMLP", "Norm", "StepClock", "WeightCache", "fp8_add_norm_linear",
           "fp8_gelu", "fp8_linear", "fp8_norm_linear", "fp8_norm_swiglu_mlp", "fp8_swiglu_linear"]
