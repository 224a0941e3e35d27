"""COAT for Megatron-core: `--transformer-impl coat` layer specs on the shared FP8 blocks (coat_kernels.act),
`--coat-optimizer` (CoatFP8AdamW under Megatron's optimizers), and `enable_coat()` for megatron.training jobs."""
from .attention import SDPACoreAttention, core_attention_class
from .enable import CoatMegatron, enable_coat
from .layers import CoatColumnParallelLinear, CoatLayerNormColumnParallelLinear, CoatNorm, CoatRowParallelLinear
from .mlp import CoatMLP
from .self_attention import CoatSelfAttention
from .spec import get_coat_mlp_spec, get_gpt_decoder_block_coat_spec, get_gpt_layer_coat_spec

__all__ = [
    "CoatColumnParallelLinear", "CoatLayerNormColumnParallelLinear", "CoatMLP", "CoatMegatron", "CoatNorm",
    "CoatRowParallelLinear", "CoatSelfAttention", "SDPACoreAttention", "core_attention_class", "enable_coat",
    "get_coat_mlp_spec", "get_gpt_decoder_block_coat_spec", "get_gpt_layer_coat_spec",
]
