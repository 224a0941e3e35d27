"""COAT's FP8 activations for Hugging Face decoder models: `convert_to_coat(model, config=None)`.

Converts, in place, every decoder layer of a Llama-family model (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM and their base models) to run on the FP8 blocks of `coat_kernels.act`, and the
causal-LM loss to the chunked LM head + cross-entropy. Each layer keeps its modules and parameters (names, shapes,
dtypes: `state_dict()`, `save_pretrained` and existing checkpoints are unchanged); only its class gains a COAT
`forward`:

    h = x + o_proj(attention(rope(qkv(norm1(x)))));  y = h + down(silu(gate) * up)(norm2(h))

- norm1 + q/k/v projections: one FP8 GEMM over the three weights (`fp8_norm_linear` with weight pieces, residual_out);
- attention core in BF16: RoPE fused with the q/k/v split (HF's cos/sin per token; Qwen3's q/k norms and RoPE in
  torch), causal scaled-dot-product attention with grouped-query attention, HF's mask when it passes one (padding,
  sliding windows), the KV cache updated when one is passed (generation's prefill);
- o_proj: `fp8_linear` reusing the attention output the attention kernel keeps;
- residual add + norm2 + gate/up + SwiGLU + down: one `fp8_norm_swiglu_mlp` node.
Generation steps that extend a KV cache (one new token at a time) run the layer's original BF16 forward.
The final norm, the LM head and the loss stay BF16; in training with labels, the head and cross-entropy run in
chunks of tokens and never hold the full logits (`logits` is None in that output; evaluation returns them).

All converted layers share one `CoatRuntime` (`coat_runtime(model)`); tie it to the optimizer with
`coat_runtime(model).attach_optimizer(optimizer)` so each weight is quantized once per optimizer step (the DeepSpeed
integration does it). Idempotent: converting again changes nothing but the config.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from coat_kernels.act import ActivationConfig, CoatRuntime, fp8_linear, fp8_norm_linear, fp8_norm_swiglu_mlp
from coat_kernels.act.lm_loss import chunked_lm_loss
from coat_kernels.act.rope import rope_split

logger = logging.getLogger("coat_ds")

FAMILIES = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "qwen2": "Qwen2DecoderLayer",
            "qwen3": "Qwen3DecoderLayer"}


@dataclass
class LayerState:
    """What a converted decoder layer holds besides its modules: config, the model's runtime, FP8 weight caches."""
    config: ActivationConfig
    runtime: CoatRuntime
    qkv_cache: object
    o_cache: object
    fc1_cache: object
    fc2_cache: object


def coat_runtime(model) -> CoatRuntime | None:
    """The CoatRuntime of a converted model (None if it was not converted)."""
    return getattr(model, "coat_runtime", None)


def convert_to_coat(model: torch.nn.Module, config: ActivationConfig | None = None, *,
                    runtime: CoatRuntime | None = None, chunked_loss: bool = True) -> torch.nn.Module:
    """Convert a Hugging Face Llama / Mistral / Qwen2 / Qwen3 model in place (see the module docstring); returns it."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        raise RuntimeError(f"coat_ds.convert_to_coat needs transformers >= 5 (decoder layers returning a tensor); "
                           f"found {transformers.__version__}")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"coat_ds.convert_to_coat supports Hugging Face Llama-family decoders (model_type "
                         f"{', '.join(sorted(FAMILIES))}: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                         f"Qwen3ForCausalLM and their base models); got {type(model).__name__} (model_type "
                         f"{model_type!r})")
    config = config or ActivationConfig()
    runtime = coat_runtime(model) or runtime or CoatRuntime()
    model.coat_runtime = runtime
    converted, skipped = 0, []
    for name, module in model.named_modules():
        if type(module).__name__ not in (FAMILIES[model_type], "Coat" + FAMILIES[model_type]):
            continue
        problem = _unsupported(module)
        if problem:
            skipped.append(f"{name} ({problem})")
            continue
        if not isinstance(module, CoatDecoderLayer):
            module.__class__ = _coat_class(type(module), CoatDecoderLayer)
            module.coat = LayerState(config, runtime, *(runtime.new_weight_cache() for _ in range(4)))
        else:
            module.coat.config = config
        converted += 1
    head = chunked_loss and hasattr(model, "lm_head") and hasattr(model, "model")
    if head and not isinstance(model, CoatCausalLM):
        model.__class__ = _coat_class(type(model), CoatCausalLM)
    logger.warning("coat-fp8: %d decoder layers of %s on FP8 activations (%s); left in BF16: embeddings, final norm, "
                   "LM head%s%s", converted, type(model).__name__, config,
                   " (chunked LM head + cross-entropy in training)" if head else "",
                   "; not converted: " + ", ".join(skipped) if skipped else "")
    return model


def _unsupported(layer) -> str | None:
    attn, mlp = layer.self_attn, layer.mlp
    cfg = attn.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act}"
    if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj")):
        return "MLP biases"
    widths = (cfg.hidden_size, cfg.intermediate_size, attn.head_dim * cfg.num_attention_heads,
              attn.head_dim * cfg.num_key_value_heads)
    if any(w % 16 for w in widths) or attn.head_dim % 2:
        return f"widths {widths} not multiples of 16"
    return None


_CLASSES: dict = {}  # (HF class, COAT mix-in) -> their subclass (one per pair, so isinstance and pickling work)


def _coat_class(base, mixin):
    cls = _CLASSES.get((base, mixin))
    if cls is None:
        cls = _CLASSES[(base, mixin)] = type("Coat" + base.__name__, (mixin, base), {"__module__": __name__})
    return cls


class CoatDecoderLayer:
    """Mix-in placed before a Hugging Face decoder layer class: the COAT forward (see the module docstring)."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        attn = self.self_attn
        kv_cache = _kv_cache(kwargs)
        extends_cache = kv_cache is not None and kv_cache.get_seq_length(attn.layer_idx) > 0
        if position_embeddings is None or extends_cache:
            return super().forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   position_embeddings=position_embeddings, **kwargs)
        st = self.coat
        kw = dict(config=st.config, runtime=st.runtime)
        b, s, h = hidden_states.shape
        norm1, norm2, mlp = self.input_layernorm, self.post_attention_layernorm, self.mlp
        qkv_bias = None
        if attn.q_proj.bias is not None:
            qkv_bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        qkv, residual = fp8_norm_linear(hidden_states.reshape(b * s, h), norm1.weight, None,
                                        (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight), qkv_bias,
                                        eps=norm1.variance_epsilon, residual_out=True, weight_cache=st.qkv_cache, **kw)
        o, kept = _attention(attn, qkv, b, s, position_embeddings, attention_mask, kv_cache, st)
        a = fp8_linear(o, attn.o_proj.weight, attn.o_proj.bias, reuse_input=kept, weight_cache=st.o_cache, **kw)
        y, hsum = fp8_norm_swiglu_mlp(a, norm2.weight, None, (mlp.gate_proj.weight, mlp.up_proj.weight),
                                      mlp.down_proj.weight, fc2_bias=mlp.down_proj.bias, residual=residual,
                                      eps=norm2.variance_epsilon, fc1_cache=st.fc1_cache, fc2_cache=st.fc2_cache, **kw)
        return (hsum + y).view(b, s, h)


def _attention(attn, qkv, b, s, position_embeddings, mask, cache, st):
    """RoPE + causal attention of qkv [b*s, (hq + 2 hkv) d] -> (o [b*s, hq d], whether o is the attention kernel's
    own output tensor)."""
    cfg = attn.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    cos, sin = position_embeddings
    if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm of q and k before RoPE
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        q, k, v = qkv.view(b, s, hq + 2 * hkv, d).split((hq, hkv, hkv), 2)
        q, k = apply_rotary_pos_emb(attn.q_norm(q).transpose(1, 2), attn.k_norm(k).transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
    else:
        # [1 or b, s, d] (cat(freqs, freqs)) -> fp32 [s or b*s, d/2]: token t of the flat batch uses row t % rows
        tables = [t[..., : d // 2].reshape(-1, d // 2).float().contiguous() for t in (cos, sin)]
        q, k, v = rope_split(qkv, *tables, d, hkv, st.config.use_triton(qkv), handoff=st.runtime.handoff,
                             tickets=st.runtime.tickets)
        q = q.view(b, s, hq, d).transpose(1, 2)
        k, v = (t.view(b, s, hkv, d).transpose(1, 2) for t in (k, v))
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx)
    dropout = attn.attention_dropout if attn.training else 0.0
    if mask is None:
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=attn.scaling,
                                           enable_gqa=hkv != hq)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, :, :, : k.shape[-2]], dropout_p=dropout,
                                           scale=attn.scaling, enable_gqa=hkv != hq)
    o = o.transpose(1, 2)
    return o.reshape(b * s, hq * d), o.is_contiguous()


class CoatCausalLM:
    """Mix-in placed before a Hugging Face *ForCausalLM class: in training with labels, the LM head and the
    cross-entropy run in chunks of tokens (coat_kernels.act.lm_loss) and the output's logits are None."""

    coat_loss_chunk_tokens = 4096

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        if labels is None or not self.training:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)  # no logits are made in training
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]  # the label of position t is token t + 1
        loss = chunked_lm_loss(outputs.last_hidden_state, self.lm_head.weight, shifted, num_items=num_items,
                               chunk_tokens=self.coat_loss_chunk_tokens)
        cache_field = _cache_field(CausalLMOutputWithPast)
        return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                      attentions=outputs.attentions, **{cache_field: getattr(outputs, cache_field)})


# Earlier transformers 5 releases name the KV cache `past_key_values`, later ones `cache` (deprecating the old name).
# Whatever the caller passed is forwarded untouched; these read it under either name.
CACHE_NAMES = ("cache", "past_key_values")


def _kv_cache(kwargs):
    """The KV cache a decoder layer was given (None without one)."""
    for name in CACHE_NAMES:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def _cache_field(output_class) -> str:
    """The name of the KV-cache field of a transformers ModelOutput class."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(output_class)}
    return next(n for n in CACHE_NAMES if n in names)
