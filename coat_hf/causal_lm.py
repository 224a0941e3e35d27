"""The causal-LM side of a converted model: the chunked LM head + cross-entropy in training, and the KV cache, which
`transformers` releases pass under two names."""
from __future__ import annotations

import torch.nn.functional as F

from coat_kernels.act.lm_loss import DEFAULT_CHUNK_TOKENS, chunked_lm_loss

# Earlier transformers 5 releases name the KV cache `past_key_values`, later ones `cache` (deprecating the old name).
# Whatever the caller passed is forwarded untouched; these read it under either name.
CACHE_NAMES = ("cache", "past_key_values")


def kv_cache_of(kwargs):
    """The KV cache a decoder layer was given (None without one)."""
    for name in CACHE_NAMES:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def cache_field(output_class) -> str:
    """The name of the KV-cache field of a transformers ModelOutput class (read from the class's dataclass fields
    mapping, which torch.compile traces; dataclasses.fields of a class breaks its graph)."""
    return next(n for n in CACHE_NAMES if n in output_class.__dataclass_fields__)


class CoatCausalLM:
    """Mix-in placed before a Hugging Face *ForCausalLM class: in training with labels, the LM head and the
    cross-entropy run in chunks of tokens (coat_kernels.act.lm_loss) and the output's logits are None; no KV cache
    is made there unless `use_cache=True` is passed (a training step reads none)."""

    coat_loss_chunk_tokens = DEFAULT_CHUNK_TOKENS

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        if labels is None or not self.training:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)  # no logits are made in training
        kwargs.setdefault("use_cache", False)
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]  # the label of position t is token t + 1
        loss = chunked_lm_loss(outputs.last_hidden_state, self.lm_head.weight, shifted, num_items=num_items,
                               chunk_tokens=self.coat_loss_chunk_tokens)
        field = cache_field(CausalLMOutputWithPast)
        return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                      attentions=outputs.attentions, **{field: getattr(outputs, field)})
