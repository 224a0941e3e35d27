"""COAT for Megatron-core: `--transformer-impl coat` layer specs on the shared FP8 blocks (coat_kernels.act),
`--coat-optimizer` (CoatFP8AdamW under Megatron's optimizers), and `enable_coat()` for megatron.training jobs."""
try:
    import megatron.core  # noqa: F401
except ModuleNotFoundError as exc:
    if exc.name not in ("megatron", "megatron.core"):
        raise
    raise ImportError("coat_megatron needs megatron-core (0.16.1 to 0.19): pip install 'coat-fp8[megatron]' "
                      "(or pip install 'megatron-core>=0.16.1,<0.20')") from exc

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
