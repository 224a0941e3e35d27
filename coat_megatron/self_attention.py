"""CoatSelfAttention: Megatron's SelfAttention with COAT's fused attention path.

For a training or evaluation forward of causal self-attention with RoPE and the SDPA core (`--coat-attention auto`),
the attention between the two FP8 GEMMs is

    qkv = linear_qkv(x)            FP8 GEMM, [s, b, groups * (q heads + 2) * d] (Megatron's grouped layout)
    q, k, v = rope_split(qkv)      one kernel: RoPE on q and k, the three split into their own tensors
    o = sdpa(q, k, v)              cuDNN / flash attention on the [s, b] token order, no copies
    y = linear_proj(o)             FP8 GEMM; saves nothing new when o is the tensor attention keeps for backward

whose backward is one kernel for d(qkv) (inverse rotation, written in qkv's layout, with the amax its E5M2
quantization needs handed to linear_qkv's backward). Megatron's own path rotates q and k with separate
element-wise ops and copies around the core. Selective recompute of core attention is honoured (the core is then
recomputed in backward and linear_proj saves its FP8 copy of o).

Everything else (inference with a KV cache, packed sequences, cross attention, q/k norms, interleaved or partial
RoPE, multi-latent attention, output gates, context parallelism, fewer key/value groups than TP ranks, non-causal
masks, attention dropout in training, activation offloading, the TE or Megatron core) runs Megatron's forward.
"""
from __future__ import annotations

from megatron.core import tensor_parallel
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp

from coat_kernels.act import ActivationConfig, CoatRuntime
from coat_kernels.act.rope import rope_split

from .attention import SDPACoreAttention, sdpa
from .layers import MEGATRON_ACTIVATION_CONFIG


def _rope_mscale(config) -> float:
    """Megatron's RoPE magnitude factor (YaRN's concentration factor; 1 for plain RoPE)."""
    try:
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
            _yarn_get_concentration_factor_from_config,
        )
    except ImportError:
        return 1.0
    factor = _yarn_get_concentration_factor_from_config(config)
    return 1.0 if factor is None else float(factor)


class CoatSelfAttention(SelfAttention):
    def __init__(self, *args, coat_config: ActivationConfig | None = None, coat_runtime: CoatRuntime | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.coat_config = coat_config or MEGATRON_ACTIVATION_CONFIG
        self.coat_runtime = coat_runtime or CoatRuntime()
        self.rope_mscale = _rope_mscale(self.config)
        self.fused_path = self._fused_path_supported()

    def _fused_path_supported(self) -> bool:
        """What the configuration allows (the call's arguments are checked in forward)."""
        config = self.config
        no_norm = all(m is None or isinstance(m, IdentityOp) for m in (self.q_layernorm, self.k_layernorm))
        offload = any(getattr(self, n, False) for n in ("offload_qkv_linear", "offload_core_attention",
                                                         "offload_attn_proj"))
        return (isinstance(self.core_attention, SDPACoreAttention) and no_norm and not offload
                and self.attn_mask_type == AttnMaskType.causal
                and not config.rotary_interleaved and not getattr(config, "multi_latent_attention", False)
                and getattr(config, "mrope_section", None) is None
                and not getattr(config, "attention_output_gate", False)
                and not getattr(config, "test_mode", False)
                and config.context_parallel_size == 1
                and self.config.num_query_groups >= self.world_size)

    def _rope_frequencies(self, rotary_pos_emb):
        """The [positions, d / 2] angles of Megatron's [positions, 1, 1, d] embedding (cat(freqs, freqs)), or None
        when it is absent, differs between q and k, or rotates only part of each head."""
        if isinstance(rotary_pos_emb, tuple):
            if len(rotary_pos_emb) != 2 or rotary_pos_emb[0] is not rotary_pos_emb[1]:
                return None
            rotary_pos_emb = rotary_pos_emb[0]
        d = self.hidden_size_per_attention_head
        if (rotary_pos_emb is None or rotary_pos_emb.dim() != 4 or rotary_pos_emb.shape[1:3] != (1, 1)
                or rotary_pos_emb.shape[-1] != d):
            return None
        return rotary_pos_emb[:, 0, 0, : d // 2]

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, **kwargs):
        freqs = self._rope_frequencies(rotary_pos_emb) if self.fused_path else None
        no_rope = getattr(self.config, "no_rope_freq", None)
        if no_rope and no_rope[self.layer_number - 1]:
            freqs = None
        plain_call = (key_value_states is None and inference_context is None and rotary_pos_cos is None
                      and rotary_pos_sin is None and attention_bias is None and packed_seq_params is None
                      and sequence_len_offset is None and all(v is None for v in kwargs.values()))
        dropout = self.config.attention_dropout if self.training else 0.0
        if freqs is None or not plain_call or dropout:
            return super().forward(hidden_states, attention_mask, key_value_states=key_value_states,
                                   inference_context=inference_context, rotary_pos_emb=rotary_pos_emb,
                                   rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params,
                                   sequence_len_offset=sequence_len_offset, **kwargs)
        return self._fused_forward(hidden_states, freqs)

    def _fused_forward(self, hidden_states, freqs):
        qkv, _ = self.linear_qkv(hidden_states)
        s, b, width = qkv.shape
        d = self.hidden_size_per_attention_head
        heads, groups = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
        runtime = self.coat_runtime
        cos, sin = runtime.rope.of(freqs, s, self.rope_mscale)
        q, k, v = rope_split(qkv.reshape(s * b, width), cos, sin, d, groups, self.coat_config.use_triton(qkv),
                             layout="grouped", rows_per_position=b, handoff=runtime.handoff,
                             tickets=runtime.tickets)
        # [s * b, heads * d] -> [b, heads, s, d] views: attention reads the [s, b] token order in place
        q = q.view(s, b, heads, d).permute(1, 2, 0, 3)
        k, v = (t.view(s, b, groups, d).permute(1, 2, 0, 3) for t in (k, v))
        scale = self.core_attention.softmax_scale
        if self.checkpoint_core_attention and self.training:
            o = tensor_parallel.checkpoint(lambda q_, k_, v_: sdpa(q_, k_, v_, causal=True, scale=scale), False,
                                           q, k, v)
            kept = False  # recomputed in backward: linear_proj saves its own FP8 copy
        else:
            o = sdpa(q, k, v, causal=True, scale=scale)
            kept = True
        o = o.permute(2, 0, 1, 3)  # [s, b, heads, d]
        kept = kept and o.is_contiguous()
        return self.linear_proj(o.reshape(s, b, heads * d), reuse_input=kept)
