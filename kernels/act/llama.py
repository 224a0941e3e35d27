"""A Llama-style decoder layer on COAT's FP8 blocks, and its attention core.

    h = x + proj(attention(rope(qkv(norm1(x)))));  y = h + mlp(norm2(h))

- norm1 + QKV projection: `Fp8NormLinear` with residual_out (x's two gradients meet inside the norm backward);
- attention core in BF16: RoPE fused with the q/k/v split (grouped-query attention when kv_heads < heads), causal
  scaled-dot-product attention (flash / cuDNN kernels on CUDA);
- output projection: `Fp8Linear`, which reuses the attention output that flash attention keeps anyway as its
  saved input (no new memory);
- residual add + norm2 + SwiGLU MLP: one `Fp8NormSwigluMLP` node (d[gate | up] goes straight to E5M2).
Everything saved for backward is FP8 except what the attention kernel itself keeps (q, k, v, its output and
statistics). Parameter names follow TransformerEngine's TransformerLayer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ActivationConfig
from .modules import Fp8Linear, Fp8NormLinear, Fp8NormSwigluMLP
from .rope import rope_split, rope_tables
from .runtime import CoatRuntime


def attention_core(qkv, batch, seq, heads, kv_heads, head_dim, cos, sin, config: ActivationConfig,
                   runtime: CoatRuntime | None):
    """qkv [batch * seq, (heads + 2 kv_heads) * head_dim] -> (o [batch * seq, heads * head_dim], whether o is a view
    of the attention output tensor itself, i.e. what the attention kernel keeps for its backward)."""
    q, k, v = rope_split(qkv, cos, sin, head_dim, kv_heads, config.use_triton(qkv),
                         handoff=runtime.handoff if runtime else None, tickets=runtime.tickets if runtime else None)
    q = q.view(batch, seq, heads, head_dim).transpose(1, 2)
    k, v = (t.view(batch, seq, kv_heads, head_dim).transpose(1, 2) for t in (k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads).transpose(1, 2)
    return o.reshape(batch * seq, heads * head_dim), o.is_contiguous()


class CoatLlamaDecoderLayer(torch.nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, num_heads, num_kv_heads=None, *, max_seq_len=4096, eps=1e-5,
                 rope_base=10000.0, config: ActivationConfig | None = None, runtime: CoatRuntime | None = None,
                 device=None, params_dtype=torch.bfloat16):
        super().__init__()
        self.config = config or ActivationConfig()
        self.runtime = runtime or CoatRuntime()
        kv = num_kv_heads or num_heads
        if hidden_size % num_heads or num_heads % kv:
            raise ValueError(f"hidden {hidden_size}, heads {num_heads}, kv heads {kv}: heads must divide hidden "
                             "and kv heads must divide heads")
        self.heads, self.kv_heads, self.head_dim = num_heads, kv, hidden_size // num_heads
        common = dict(config=self.config, runtime=self.runtime, device=device, params_dtype=params_dtype)
        self.layernorm_qkv = Fp8NormLinear(hidden_size, (num_heads + 2 * kv) * self.head_dim, eps=eps, **common)
        self.proj = Fp8Linear(num_heads * self.head_dim, hidden_size, **common)
        self.layernorm_mlp = Fp8NormSwigluMLP(hidden_size, ffn_hidden_size, eps=eps, **common)
        cos, sin = rope_tables(max_seq_len, self.head_dim, rope_base, device=device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x, rope=None):
        """x [batch, seq, hidden]; rope: optional (cos, sin) [positions, head_dim / 2] fp32 tables (token t uses row
        t % positions), default: this layer's tables of positions 0 .. max_seq_len - 1 (sequences start at 0)."""
        b, s, h = x.shape
        cos, sin = rope if rope is not None else (self.rope_cos[:s], self.rope_sin[:s])
        x2 = x.reshape(b * s, h)
        qkv, x2 = self.layernorm_qkv(x2, residual_out=True)
        o, kept = attention_core(qkv, b, s, self.heads, self.kv_heads, self.head_dim, cos, sin, self.config,
                                 self.runtime)
        a = self.proj(o, reuse_input=kept)
        y, hsum = self.layernorm_mlp(a, residual=x2)
        return (hsum + y).view(b, s, h)
