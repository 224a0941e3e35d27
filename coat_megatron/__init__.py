"""COAT for Megatron-core: `--transformer-impl coat` layer specs on the shared FP8 blocks (coat_kernels.blocks)."""
from .attention import SDPACoreAttention, core_attention_class
from .layers import CoatColumnParallelLinear, CoatLayerNormColumnParallelLinear, CoatNorm, CoatRowParallelLinear
from .mlp import CoatMLP
from .spec import get_coat_mlp_spec, get_gpt_decoder_block_coat_spec, get_gpt_layer_coat_spec

__all__ = [
    "CoatColumnParallelLinear", "CoatLayerNormColumnParallelLinear", "CoatMLP", "CoatNorm", "CoatRowParallelLinear",
    "SDPACoreAttention", "core_attention_class", "get_coat_mlp_spec", "get_gpt_decoder_block_coat_spec",
    "get_gpt_layer_coat_spec",
]
