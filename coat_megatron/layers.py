"""COAT linear layers with the interfaces of Megatron's TransformerEngine wrappers.

They subclass megatron-core's ColumnParallelLinear / RowParallelLinear and replace only the GEMM
(`_forward_impl`) with the shared FP8 blocks of `coat_kernels.blocks`, so tensor-parallel attributes,
initialisation, `sharded_state_dict` and the `_extra_state` load hook are Megatron's own. Parameter names
follow TE (`weight`, `bias`, `layer_norm_weight`, `layer_norm_bias`): checkpoints move between TE and COAT runs.

Tensor/sequence parallel plumbing done here (the row layer's output reduction stays in Megatron's forward):
- column layers: under SP the BF16 input is all-gathered along the sequence (backward: reduce-scatter);
  otherwise, with TP > 1, the input's gradient is all-reduced over TP (Megatron's `copy_to` region);
- the fused norm's parameters get their gradient summed over TP inside autograd (each TP rank only sees its own
  output columns), so they carry no `sequence_parallel` tag and finalize_model_grads leaves them alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

FUSED_ACTIVATIONS = (None, "swiglu", "gelu")


def _blocks():
    from coat_kernels import blocks  # the shared FP8 blocks; imported on first use

    return blocks


def _param_device(config):
    return torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()


_weight_generation = None


def set_weight_generation(fn) -> None:
    """`fn()` -> a hashable key that changes whenever the weights may have changed (e.g. the training iteration).

    The blocks' WeightCache notices in-place updates through `weight._version`, but Megatron's mixed-precision
    optimizers write the BF16 weights through `.data` (and NCCL param all-gathers), which does not bump it.
    Without a generation source (the default) every forward re-quantizes its weight; the launcher installs
    (iteration, grad mode) so micro-batches of one step share one FP8 weight.
    """
    global _weight_generation
    _weight_generation = fn


class _WeightCacheMixin:
    """One FP8 copy of `weight` per weight generation, shared by the micro-batches of an optimizer step."""

    def weight_cache(self):
        cache = self.__dict__.get("_coat_weight_cache")
        if cache is None:
            cache = _blocks().WeightCache()
            self.__dict__["_coat_weight_cache"] = cache
        generation = None if _weight_generation is None else _weight_generation()
        if generation is None or generation != self.__dict__.get("_coat_weight_generation"):
            cache.invalidate()
            self.__dict__["_coat_weight_generation"] = generation
        return cache


class CoatColumnParallelLinear(_WeightCacheMixin, ColumnParallelLinear):
    """ColumnParallelLinear whose GEMM quantizes its input and weight per tensor to FP8 (input saved in FP8)."""

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False,
                      allreduce_dgrad=False, sequence_parallel=False, tp_group=None, **unused):
        # gradient_accumulation_fusion is ignored: a plain .grad is produced and Megatron's DDP hook adds it to
        # main_grad (distributed_data_parallel.py, `param.main_grad.add_(param.grad.data)`).
        tp_group = tp_group if tp_group is not None else self.tp_group
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        return self._gemm(input, weight, bias)

    def _gemm(self, x, weight, bias):
        return _blocks().fp8_linear(x, weight, bias, weight_cache=self.weight_cache())


class CoatLayerNormColumnParallelLinear(CoatColumnParallelLinear):
    """Norm (config.normalization) fused with an FP8 column-parallel linear, as TELayerNormColumnParallelLinear.

    The norm reads the BF16 input and hands the GEMM its FP8 output directly; what is saved for backward is FP8.
    """

    def __init__(self, input_size, output_size, *, config, init_method, gather_output=False, bias=True,
                 skip_bias_add=False, is_expert=False, tp_comm_buffer_name=None, tp_group=None, stride=1,
                 **kwargs):
        super().__init__(input_size, output_size, config=config, init_method=init_method,
                         gather_output=gather_output, bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name, tp_group=tp_group, stride=stride, **kwargs)
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"COAT supports LayerNorm and RMSNorm, not {config.normalization!r}")
        self.norm = "rmsnorm" if config.normalization == "RMSNorm" else "layernorm"
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        device, dtype = _param_device(config), config.params_dtype
        gamma = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(gamma(input_size, device=device, dtype=dtype))
        if self.norm == "layernorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, device=device, dtype=dtype))
        else:
            self.layer_norm_bias = None

    def _gemm(self, x, weight, bias):
        # Identity forward; the backward sums the partial norm-parameter gradients of the TP ranks.
        norm_weight = copy_to_tensor_model_parallel_region(self.layer_norm_weight, group=self.tp_group)
        norm_bias = self.layer_norm_bias
        if norm_bias is not None:
            norm_bias = copy_to_tensor_model_parallel_region(norm_bias, group=self.tp_group)
        return _blocks().fp8_norm_linear(x, norm_weight, norm_bias, weight, bias, norm=self.norm, eps=self.eps,
                                         zero_centered_gamma=self.zero_centered_gamma,
                                         weight_cache=self.weight_cache())


class CoatRowParallelLinear(_WeightCacheMixin, RowParallelLinear):
    """RowParallelLinear with an FP8 GEMM; `fused_activation` ("swiglu" | "gelu") applies COAT's FP8
    non-linearity to the input first (SwiGLU fused with this GEMM's input quantization)."""

    fused_activation = None

    def _forward_impl(self, input, weight, *args, **kwargs):
        blocks = _blocks()
        if self.fused_activation == "swiglu":
            return blocks.fp8_swiglu_linear(input, weight, None, weight_cache=self.weight_cache())
        if self.fused_activation == "gelu":
            input = blocks.fp8_gelu(input)
        return blocks.fp8_linear(input, weight, None, weight_cache=self.weight_cache())


class CoatNorm(torch.nn.Module):
    """BF16 RMSNorm/LayerNorm with TENorm's constructor and parameter names, for the final norm (COAT keeps the
    final norm, LM head and loss in BF16). Works under sequence parallelism: parameters are tagged
    `sequence_parallel` so finalize_model_grads sums their gradients over TP, as for TENorm."""

    def __init__(self, config, hidden_size, eps=1e-5):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"COAT supports LayerNorm and RMSNorm, not {config.normalization!r}")
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        device, dtype = _param_device(config), config.params_dtype
        gamma = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(gamma(hidden_size, device=device, dtype=dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.rms:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), weight, self.bias, self.eps)
