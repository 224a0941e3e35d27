"""Layer and decoder-block specs for `--transformer-impl coat`, built from megatron-core's stable primitives.

Mirrors the TransformerEngine spec: the input/pre-MLP norms are fused into linear_qkv/linear_fc1
(CoatLayerNormColumnParallelLinear), linear_proj/linear_fc2 are CoatRowParallelLinear, the self-attention is
CoatSelfAttention (fused RoPE and SDPA path), the MLP is CoatMLP and the block's final norm is CoatNorm. Works with
megatron-core 0.16 (ModuleSpec MLP) and 0.19 (MLP builder callables).

Every COAT linear of a model is bound to the same ActivationConfig (default: layers.MEGATRON_ACTIVATION_CONFIG) and
CoatRuntime (scale tickets, gradient-amax hand-off, FP8 weight caches, RoPE tables): pass them in
(coat_megatron.enable_coat's handle does), or a fresh runtime is made. The binding is a callable ModuleSpec
(coat_megatron.bound_spec).
"""
from __future__ import annotations

import functools

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from coat_kernels.act import ActivationConfig, CoatRuntime

from .attention import core_attention_class
from .bound_spec import CallableSpec, bind
from .layers import (MEGATRON_ACTIVATION_CONFIG, CoatLayerNormColumnParallelLinear, CoatNorm,
                     CoatRowParallelLinear, check_no_te_fp8)
from .mlp import CoatMLP
from .self_attention import CoatSelfAttention


def _bind(layer_cls, coat_config, coat_runtime) -> CallableSpec:
    return bind(layer_cls, coat_config=coat_config, coat_runtime=coat_runtime)


def get_coat_mlp_spec(coat_config: ActivationConfig | None = None, coat_runtime: CoatRuntime | None = None):
    coat_config, coat_runtime = coat_config or MEGATRON_ACTIVATION_CONFIG, coat_runtime or CoatRuntime()
    submodules = MLPSubmodules(linear_fc1=_bind(CoatLayerNormColumnParallelLinear, coat_config, coat_runtime),
                               linear_fc2=_bind(CoatRowParallelLinear, coat_config, coat_runtime))
    if hasattr(MLP, "as_mlp_submodule"):  # 0.19+: TransformerLayer calls mlp(config=, pg_collection=, ...)
        return functools.partial(CoatMLP.as_mlp_submodule, submodules=submodules)
    return ModuleSpec(module=CoatMLP, submodules=submodules)


def get_gpt_layer_coat_spec(qk_layernorm: bool = False, attention: str = "auto",
                            coat_config: ActivationConfig | None = None,
                            coat_runtime: CoatRuntime | None = None) -> ModuleSpec:
    """A dense GPT TransformerLayer on COAT's FP8 blocks (attention in BF16: see coat_megatron.self_attention)."""
    coat_config, coat_runtime = coat_config or MEGATRON_ACTIVATION_CONFIG, coat_runtime or CoatRuntime()
    qk_norm = CoatNorm if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            self_attention=ModuleSpec(
                module=CoatSelfAttention,
                params={"attn_mask_type": AttnMaskType.causal, "coat_config": coat_config,
                        "coat_runtime": coat_runtime},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=_bind(CoatLayerNormColumnParallelLinear, coat_config, coat_runtime),
                    core_attention=core_attention_class(attention),
                    linear_proj=_bind(CoatRowParallelLinear, coat_config, coat_runtime),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            mlp=get_coat_mlp_spec(coat_config, coat_runtime),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def get_gpt_decoder_block_coat_spec(config, vp_stage=None, pp_rank=None, qk_layernorm=None,
                                    attention: str = "auto", coat_config: ActivationConfig | None = None,
                                    coat_runtime: CoatRuntime | None = None) -> TransformerBlockSubmodules:
    """This pipeline stage's COAT layers plus CoatNorm as the final norm. TransformerEngine's FP8 in `config` is
    refused (each COAT layer refuses it too)."""
    check_no_te_fp8(config)
    if config.num_moe_experts:
        raise NotImplementedError("the COAT spec covers dense GPT layers; MoE is not supported")
    if qk_layernorm is None:
        qk_layernorm = config.qk_layernorm
    layer = get_gpt_layer_coat_spec(qk_layernorm=qk_layernorm, attention=attention, coat_config=coat_config,
                                    coat_runtime=coat_runtime or CoatRuntime())
    layer_specs = [layer] * config.num_layers
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        from megatron.core.transformer.enums import LayerType

        ids = layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
        local_specs = [layer_specs[i] for i in ids]
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local_specs = layer_specs[offset: offset + get_num_layers_to_build(config, vp_stage=vp_stage,
                                                                           pp_rank=pp_rank)]
    return TransformerBlockSubmodules(layer_specs=local_specs, layer_norm=CoatNorm)
