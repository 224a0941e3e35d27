"""The attention core of a converted decoder layer, through Hugging Face's own attention interface.

A converted layer computes q, k and v on its FP8 blocks and then calls the function the unconverted layer would:
the one `transformers` registers for the model's `config._attn_implementation` (`sdpa`, `flex_attention`,
`flash_attention_2` / `_3`, any function a user registered with `AttentionInterface.register`), or the model
module's own `eager_attention_forward` for `eager`. It passes what the unconverted attention passes: the mask the
model built for that backend (a 4-D tensor, a flex `BlockMask`, a 2-D padding mask or None), dropout, scaling, the
family's sliding window, and every keyword argument the model hands its layers (`position_ids`, `cu_seq_lens_q/k`,
`max_length_q/k`, ...). So padding masks, sliding windows and packed sequences (documents isolated by the mask or by
the flash kernels' sequence boundaries) behave in a converted model as in the unconverted one.

o_proj reuses the attention output instead of saving an FP8 copy of it when the attention kernel keeps that very tensor
for its own backward (`output_kept`): SDPA's fused kernels, flash attention on unpadded or packed batches, flex
attention. Eager attention returns a copy nobody keeps, and flash attention on a padded batch re-pads its output into
a new tensor: o_proj then saves the E4M3 copy (1 byte per element).
"""
from __future__ import annotations

import sys

import torch

from coat_kernels.act.saved_tensors import saved_by_node

from .causal_lm import CACHE_NAMES

# Backends whose kernels keep the output tensor they return (used where the autograd graph cannot be read: under
# torch.compile and under saved-tensor hooks).
KEEPS_OUTPUT = frozenset({"sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4"})
# Autograd nodes of pure views: the tensor they produce shares the storage of their input.
VIEW_NODES = frozenset({"ViewBackward0", "TransposeBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
                        "AsStridedBackward0", "PermuteBackward0", "AliasBackward0", "SqueezeBackward0",
                        "SqueezeBackward1", "UnsqueezeBackward0", "ExpandBackward0"})


def implementation(attn) -> str | None:
    """The attention backend the model is set to (`config._attn_implementation`)."""
    return getattr(attn.config, "_attn_implementation", None)


def unsupported(attn) -> str | None:
    """Why a converted layer cannot run this attention module's backend (None: it can)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = implementation(attn)
    if impl is None:
        return "no attention implementation set (config._attn_implementation is None)"
    if impl == "eager" or impl.startswith("paged|") or impl in ALL_ATTENTION_FUNCTIONS:
        return None
    return (f"attention implementation {impl!r} is not registered with transformers' AttentionInterface "
            f"(registered: eager, {', '.join(sorted(ALL_ATTENTION_FUNCTIONS))})")


def runs_in_hf_layer(attn) -> bool:
    """Backends served by the layer's own BF16 forward: paged attention (continuous-batching generation)."""
    impl = implementation(attn)
    return impl is not None and impl.startswith("paged|")


def attention_function(attn):
    """The function Hugging Face's attention module would call for its backend."""
    impl = implementation(attn)
    if impl == "eager":
        return sys.modules[type(attn).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[impl]


def attend(attn, q, k, v, mask, extra: dict, kwargs: dict):
    """attention(q, k, v) as the unconverted module computes it: q [b, hq, s, d], k and v [b, hkv, s_kv, d] ->
    (o [b*s, hq*d], whether o_proj may reuse o, see `output_kept`). `extra`: the family's own arguments (sliding
    window); `kwargs`: the keyword arguments the model passed the decoder layer besides the mask and the position
    embeddings, position_ids included (the KV cache among them is not passed on: the caller updated it)."""
    b, s = q.shape[0], q.shape[2]
    passed = {key: value for key, value in kwargs.items() if key not in CACHE_NAMES}
    dropout = attn.attention_dropout if attn.training else 0.0
    o, _ = attention_function(attn)(attn, q, k, v, mask, dropout=dropout, scaling=attn.scaling, **extra, **passed)
    o = o.reshape(b * s, -1)
    return o, output_kept(o, implementation(attn))


def output_kept(o: torch.Tensor, impl: str | None) -> bool:
    """Whether the autograd node that produced o (through views) saved o's storage for its backward: then o_proj can
    save o itself at no extra memory. Read from the autograd graph in eager runs; where it cannot be read (inside
    torch.compile, or while saved-tensor hooks are active, whose unpacking may recompute or copy), from the backend's
    name (KEEPS_OUTPUT)."""
    if torch.compiler.is_compiling() or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return impl in KEEPS_OUTPUT
    node = o.grad_fn
    while node is not None and node.name() in VIEW_NODES:
        node = node.next_functions[0][0]
    if node is None:
        return False
    storage = o.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == storage for t in saved_by_node(node))
