"""COAT linear layers with the interfaces of Megatron's TransformerEngine wrappers.

They subclass megatron-core's ColumnParallelLinear / RowParallelLinear and replace only the GEMM
(`_forward_impl`) with the shared FP8 blocks of `coat_kernels.act`, so tensor-parallel attributes,
initialisation, `sharded_state_dict` and the `_extra_state` load hook are Megatron's own. Parameter names
follow TE (`weight`, `bias`, `layer_norm_weight`, `layer_norm_bias`): checkpoints move between TE and COAT runs.

Tensor/sequence parallel plumbing done here (the row layer's output reduction stays in Megatron's forward):
- column layers: under SP the BF16 input is all-gathered along the sequence (backward: reduce-scatter);
  otherwise, with TP > 1, the input's gradient is all-reduced over TP (Megatron's `copy_to` region);
- the fused norm's parameters get their gradient summed over TP inside autograd (each TP rank only sees its own
  output columns), so they carry no `sequence_parallel` tag and finalize_model_grads leaves them alone.
Every layer takes `coat_config` (ActivationConfig) and `coat_runtime` (the model's CoatRuntime), which the spec
binds; its weight cache belongs to that runtime, whose clock `coat_megatron.enable_coat` ties to the optimizer.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

from coat_kernels.act import (ActivationConfig, CoatRuntime, Norm, fp8_gelu, fp8_linear, fp8_norm_linear,
                              fp8_swiglu_linear)


# Megatron keeps every weight in memory (its DDP and distributed optimizer never release them after forward), so the
# transposed FP8 weight copies are made in backward, not held through the forward where activation memory peaks.
MEGATRON_ACTIVATION_CONFIG = ActivationConfig(transposed_weights="backward")


def _param_device(config):
    return torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()


def check_no_te_fp8(config) -> None:
    """ValueError for TransformerEngine's FP8 (`fp8=` in the TransformerConfig) on COAT layers: they quantize by
    themselves and would ignore it, training with no word about the recipe asked for."""
    fp8 = getattr(config, "fp8", None)
    if fp8:
        raise ValueError(f"TransformerConfig(fp8={fp8!r}) selects TransformerEngine's FP8, which the COAT layer spec "
                         "does not run: COAT quantizes by itself (its options are coat_kernels.act.ActivationConfig). "
                         "Set fp8=None (drop --fp8-format), or use the TransformerEngine spec for TE's FP8")


def norm_options(config) -> dict:
    """Norm's options (kind, zero-centred gamma, where and in which dtype its parameters are created) as Megatron's
    config gives them, for the final norm (CoatNorm) and the norms fused into the column layers alike."""
    if config.normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"COAT supports LayerNorm and RMSNorm, not {config.normalization!r}")
    return dict(norm="rmsnorm" if config.normalization == "RMSNorm" else "layernorm",
                zero_centered_gamma=config.layernorm_zero_centered_gamma, device=_param_device(config),
                params_dtype=config.params_dtype)


class _CoatLinearMixin:
    """The activation config, the model's CoatRuntime (given by the spec) and this layer's FP8 weight cache."""

    def _init_coat(self, coat_config, coat_runtime):
        check_no_te_fp8(self.config)
        self.coat_config = coat_config or MEGATRON_ACTIVATION_CONFIG
        self.coat_runtime = coat_runtime or CoatRuntime()
        self.weight_cache = self.coat_runtime.new_weight_cache()

    def _block_kwargs(self):
        return dict(config=self.coat_config, runtime=self.coat_runtime, weight_cache=self.weight_cache)


class CoatColumnParallelLinear(_CoatLinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear whose GEMM quantizes its input and weight per tensor to FP8 (input saved in FP8)."""

    def __init__(self, *args, coat_config: ActivationConfig | None = None, coat_runtime: CoatRuntime | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self._init_coat(coat_config, coat_runtime)

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
        return fp8_linear(x, weight, bias, **self._block_kwargs())


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
        # the norm's parameters are created as CoatNorm's are; the layer keeps them under TE's names
        norm = Norm(input_size, eps=config.layernorm_epsilon, **norm_options(config))
        self.norm, self.eps, self.zero_centered_gamma = norm.norm, norm.eps, norm.zero_centered_gamma
        self.layer_norm_weight, self.layer_norm_bias = norm.weight, norm.bias

    def _gemm(self, x, weight, bias):
        # Identity forward; the backward sums the partial norm-parameter gradients of the TP ranks.
        norm_weight = copy_to_tensor_model_parallel_region(self.layer_norm_weight, group=self.tp_group)
        norm_bias = self.layer_norm_bias
        if norm_bias is not None:
            norm_bias = copy_to_tensor_model_parallel_region(norm_bias, group=self.tp_group)
        return fp8_norm_linear(x, norm_weight, norm_bias, weight, bias, norm=self.norm, eps=self.eps,
                               zero_centered_gamma=self.zero_centered_gamma, **self._block_kwargs())


ACTIVATIONS = ("swiglu", "gelu")


class CoatRowParallelLinear(_CoatLinearMixin, RowParallelLinear):
    """RowParallelLinear with an FP8 GEMM. activation ("swiglu" | "gelu" | None; CoatMLP passes its own) applies
    COAT's FP8 non-linearity to the input first (SwiGLU fused with this GEMM's input quantization).
    forward(x, reuse_input=True): save x itself for the weight gradient instead of an FP8 copy (for an input that
    something else keeps for backward anyway, such as the attention output).

    forward takes the steps of megatron-core's RowParallelLinear.forward (scatter an input that is not split yet,
    the GEMM, the reduction over TP or the reduce-scatter under SP, the bias) with this call's reuse_input handed to
    the GEMM. Megatron's legacy CPU-offloading tag on the input is not set: the FP8 blocks save their own tensors."""

    def __init__(self, *args, activation: str | None = None, coat_config: ActivationConfig | None = None,
                 coat_runtime: CoatRuntime | None = None, **kwargs):
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS} or None, got {activation!r}")
        super().__init__(*args, **kwargs)
        self._init_coat(coat_config, coat_runtime)
        self.activation = activation

    def forward(self, input_, reuse_input: bool = False):
        if not self.input_is_parallel:
            if self.sequence_parallel:
                raise ValueError("RowParallelLinear under sequence parallelism needs input_is_parallel=True")
            input_ = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        output_parallel = self._row_gemm(input_, reuse_input)
        if self.explicit_expert_comm:
            output = output_parallel
        elif self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None

    def _row_gemm(self, x, reuse_input: bool):
        if self.activation == "swiglu":
            return fp8_swiglu_linear(x, self.weight, None, **self._block_kwargs())
        if self.activation == "gelu":
            x = fp8_gelu(x, config=self.coat_config)
        return fp8_linear(x, self.weight, None, reuse_input=reuse_input, **self._block_kwargs())


class CoatNorm(Norm):
    """BF16 RMSNorm/LayerNorm with TENorm's constructor and parameter names, for the final norm (COAT keeps the
    final norm, LM head and loss in BF16). Works under sequence parallelism: parameters are tagged
    `sequence_parallel` so finalize_model_grads sums their gradients over TP, as for TENorm."""

    def __init__(self, config, hidden_size, eps=1e-5):
        super().__init__(hidden_size, eps=eps, **norm_options(config))
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel
