"""The decoder layer on COAT's FP8 blocks: one composition for every family, run by converted models and by the
benchmarks alike.

    h = x + o_proj(attention(rotary(qkv(norm1(x)))));  y = h + down(act(gate) * up), [gate | up] = fc1(norm2(h))

- norm1 + q/k/v projections: one FP8 GEMM over the three weights (`fp8_norm_linear` with weight pieces, residual_out:
  x's two gradients meet inside the norm backward);
- attention core in BF16: the family's rotary step (Llama: RoPE fused with the q/k/v split), the KV cache updated when
  one is passed (generation's prefill), then the model's own attention backend through Hugging Face's attention
  interface (coat_hf.attention: sdpa, eager, flex, flash, with the model's masks and packed-sequence arguments);
- o_proj: `fp8_linear`, reusing the attention output where the attention kernel keeps it;
- residual add + norm2 + gate/up + gated GLU (the family's activation: SwiGLU, GeGLU) + down: one
  `fp8_norm_swiglu_mlp` node.
Generation steps that extend a KV cache (one new token at a time), calls asking for attention weights and paged
attention run the layer's original BF16 forward.
With `ActivationConfig(cuda_graphs=True)` a training step's layer forward and backward replay CUDA graphs captured
per length bucket (coat_kernels.act.layer_graphs; the sequence padded inside the layer to a multiple of
`cuda_graph_pad_multiple`, coat_hf.graphed_calls) where the call allows it (`graphed_calls.graphable`); other calls
run eagerly.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from coat_kernels.act import ActivationConfig, CoatRuntime, fp8_norm_swiglu_mlp
from coat_kernels.act.layer_graphs import GraphedLayer
from coat_kernels.act.weights import WeightCache

from . import attention, graphed_calls
from .attention_block import attention_block
from .causal_lm import kv_cache_of
from .families import Family


@dataclass
class LayerState:
    """What a converted decoder layer holds besides its modules: its family, config, the model's runtime and the
    FP8 weight caches of its four GEMMs."""
    family: Family
    config: ActivationConfig
    runtime: CoatRuntime
    qkv_cache: WeightCache
    o_cache: WeightCache
    fc1_cache: WeightCache
    fc2_cache: WeightCache
    graphs: GraphedLayer | None = None  # made at the first graphed call

    @classmethod
    def new(cls, family: Family, config: ActivationConfig, runtime: CoatRuntime) -> "LayerState":
        return cls(family, config, runtime, *(runtime.new_weight_cache() for _ in range(4)))

    def __getstate__(self):
        """Copies and pickles leave the CUDA graphs behind (a copy captures its own)."""
        return {**self.__dict__, "graphs": None}

    def graphed(self, layer) -> GraphedLayer:
        """This layer's GraphedLayer: the layer on a padded x [b, S, h] and the bucket's shared inputs (padded cos,
        sin, mask, number of real positions), weights quantized in every graph."""
        if self.graphs is None:
            inner = dataclasses.replace(self, config=self.config.replace(cache_weights=False))

            def forward(x, cos, sin, mask, valid):
                return decoder_layer(layer, inner, x, (cos, sin), mask, rows=valid)

            self.graphs = GraphedLayer(forward, layer, pool=self.runtime.graph_pool,
                                       max_generations=self.config.cuda_graph_shapes)
        return self.graphs

    def replay(self, layer, x, position_embeddings, mask):
        """The layer's output through its CUDA graphs for x's length bucket, or None: run eagerly."""
        length = graphed_calls.bucket_length(x.shape[1], self.config.cuda_graph_pad_multiple)
        return self.graphed(layer)(x, length, graphed_calls.shared_inputs(*position_embeddings, mask, length))


class CoatDecoderLayer:
    """Mix-in placed before a Hugging Face decoder layer class: the COAT forward (see the module docstring)."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        kv_cache = kv_cache_of(kwargs)
        if runs_in_hf_layer(self, position_embeddings, kv_cache, kwargs):
            return super().forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   position_embeddings=position_embeddings, **kwargs)
        if self.coat.config.cuda_graphs:
            refusal = graphed_calls.refusal(self, hidden_states)
            if refusal:
                self.coat.runtime.graph_pool.warn_once(*refusal)
            elif graphed_calls.graphable(self, hidden_states, attention_mask, kv_cache, kwargs):
                out = self.coat.replay(self, hidden_states, position_embeddings, attention_mask)
                if out is not None:
                    return out
        return decoder_layer(self, self.coat, hidden_states, position_embeddings, attention_mask, kv_cache,
                             dict(kwargs, position_ids=position_ids))


def runs_in_hf_layer(layer, position_embeddings, kv_cache, kwargs) -> bool:
    """Calls the layer's own BF16 forward serves: without position embeddings, generation steps that extend a KV
    cache, attention weights asked for (`output_attentions`: the FP8 layer never forms them), paged attention."""
    return (position_embeddings is None or bool(kwargs.get("output_attentions"))
            or (kv_cache is not None and kv_cache.get_seq_length(layer.self_attn.layer_idx) > 0)
            or attention.runs_in_hf_layer(layer.self_attn))


def decoder_layer(layer, state: LayerState, x, position_embeddings, mask=None, kv_cache=None, kwargs=None,
                  rows=None):
    """One decoder layer of x [b, s, h] on the FP8 blocks (see the module docstring) -> [b, s, h]. kwargs: what the
    model passed the layer for its attention (position_ids, packed-sequence boundaries, ...). rows: in a graphed call
    on a padded x, the number of real positions (a 0-dim tensor): the rows past it of the attention output (and of
    the output, where biases would make them nonzero) are zeroed (coat_hf.graphed_calls). A family with its own
    `layer_forward` (its layer is not this composition) runs that, with these arguments."""
    if state.family.layer_forward is not None:
        return state.family.layer_forward(layer, state, x, position_embeddings, mask, kv_cache, kwargs, rows)
    family = state.family
    attn, mlp = layer.self_attn, layer.mlp
    kw = dict(config=state.config, runtime=state.runtime)
    b, s, h = x.shape
    norm2 = layer.post_attention_layernorm
    a, residual = attention_block(layer, state, x, layer.input_layernorm, position_embeddings, mask, kv_cache, kwargs,
                                  rows)
    y, hsum = fp8_norm_swiglu_mlp(a, norm2.weight, None, (mlp.gate_proj.weight, mlp.up_proj.weight),
                                  mlp.down_proj.weight, fc2_bias=mlp.down_proj.bias, residual=residual,
                                  eps=family.norm_eps(norm2), zero_centered_gamma=family.norm_offset,
                                  activation=family.activation(layer),
                                  fc1_cache=state.fc1_cache, fc2_cache=state.fc2_cache, **kw)
    out = hsum + y
    if rows is not None and (attn.o_proj.bias is not None or mlp.down_proj.bias is not None):
        graphed_calls.zero_padded_rows(out, rows, s)
    return out.view(b, s, h)
