"""What the layer benchmarks share: the BF16 Llama layer every variant is built from, the COAT, TransformerEngine
and torchao variants of it, and the measurements (fwd+bwd time three ways, memory saved for backward, errors against
fp32, a kernel timeline). Measurement only: correctness checks live in tests/gpu.
"""
from __future__ import annotations

import copy
import gc
import json
import math
import os
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # before any CUDA work: TE must load its cuDNN before torch loads another one (a mixed pair fails to link)
    import transformer_engine.pytorch  # noqa: F401
except Exception:  # noqa: BLE001 - te_variants reports why
    pass

from coat_hf import convert_to_coat  # noqa: E402
from coat_kernels.act import ActivationConfig, CoatRuntime  # noqa: E402
from coat_kernels.act.rope import rope_split, rope_tables  # noqa: E402

OUT = os.environ.get("OUT", "out")


def log(*parts, name="bench.log"):
    os.makedirs(OUT, exist_ok=True)
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    with open(os.path.join(OUT, name), "a") as f:
        f.write(line + "\n")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class DecoderLayer(nn.Module):
    """One Hugging Face Llama decoder layer (of a one-layer LlamaModel) fed with its model's rotary embedding:
    forward(x [b, s, h]) -> [b, s, h]. The cos/sin tables are made once per shape, as a model makes them once per
    forward for all its layers. A COAT variant is the same module after coat_hf.convert_to_coat: exactly the layer
    users run."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self._rotary = {}

    @property
    def layer(self):
        return self.model.layers[0]

    def forward(self, x):
        key = (x.shape[1], x.dtype, x.device)
        if key not in self._rotary:
            positions = torch.arange(x.shape[1], device=x.device)[None]
            self._rotary[key] = self.model.rotary_emb(x, positions)
        return self.layer(x, position_embeddings=self._rotary[key])


def make_layers(dev, bsz, seq, h, ffn, heads, kv_heads=None):
    """(fp32 reference layer, bf16 layer with the same weights), seeded: DecoderLayers of Hugging Face's Llama."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=h, intermediate_size=ffn, num_attention_heads=heads,
                      num_key_value_heads=kv_heads or heads, num_hidden_layers=1, vocab_size=16,
                      max_position_embeddings=seq, rms_norm_eps=1e-5, attn_implementation="sdpa")
    base = DecoderLayer(LlamaModel(cfg)).to(dev)
    with torch.no_grad():
        for name, p in base.layer.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
            else:
                p.uniform_(0.8, 1.2)
    layer = copy.deepcopy(base).to(torch.bfloat16)
    layer._rotary = {}
    return base, layer


def coat_layer(ref: DecoderLayer, config=None, warm_cache=False):
    """The BF16 layer converted by coat_hf (a copy). config=None: COAT's defaults with weights quantized every step;
    warm_cache: weights quantized once and reused (what every micro-batch after the first of a step sees)."""
    runtime = CoatRuntime()
    config = config or ActivationConfig(cache_weights=warm_cache)
    layer = copy.deepcopy(ref)
    layer._rotary = {}
    convert_to_coat(layer.model, config, runtime=runtime)
    if warm_cache:  # an optimizer that never steps: the clock says the weights stay as they are
        runtime.attach_optimizer(torch.optim.SGD(layer.parameters(), lr=0.0))
    return layer


class TeLlamaLayer(nn.Module):
    """TransformerEngine's modules (LayerNormLinear + Linear + LayerNormMLP with SwiGLU, RMSNorm, no biases) around
    the same RoPE kernel and SDPA as COAT's layer; recipe None = BF16. Its own parameters, copied from the BF16
    layer."""

    def __init__(self, ref: DecoderLayer, recipe):
        super().__init__()
        import transformer_engine.pytorch as te
        src, cfg = ref.layer, ref.model.config
        h, ffn = cfg.hidden_size, cfg.intermediate_size
        self.heads, self.kv_heads, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, src.self_attn.head_dim
        self.te, self.recipe = te, recipe
        kw = dict(params_dtype=torch.bfloat16, bias=False)
        qkv_rows = (self.heads + 2 * self.kv_heads) * self.d
        self.qkv = te.LayerNormLinear(h, qkv_rows, eps=1e-5, normalization="RMSNorm", **kw)
        self.o = te.Linear(self.heads * self.d, h, **kw)
        self.mlp = te.LayerNormMLP(h, ffn, eps=1e-5, normalization="RMSNorm", activation="swiglu", **kw)
        attn, mlp = src.self_attn, src.mlp
        with torch.no_grad():
            self.qkv.layer_norm_weight.copy_(src.input_layernorm.weight)
            self.qkv.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
            self.o.weight.copy_(attn.o_proj.weight)
            self.mlp.layer_norm_weight.copy_(src.post_attention_layernorm.weight)
            self.mlp.fc1_weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            self.mlp.fc2_weight.copy_(mlp.down_proj.weight)
        cos, sin = rope_tables(cfg.max_position_embeddings, self.d, cfg.rope_parameters["rope_theta"],
                               device=src.mlp.down_proj.weight.device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        b, s, h = x.shape
        with self.te.autocast(enabled=self.recipe is not None, recipe=self.recipe):
            qkv = self.qkv(x.reshape(b * s, h))
            q, k, v = rope_split(qkv, self.cos[:s], self.sin[:s], self.d, self.kv_heads, True)
            q = q.view(b, s, self.heads, self.d).transpose(1, 2)
            k, v = (t.view(b, s, self.kv_heads, self.d).transpose(1, 2) for t in (k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
            hsum = x.reshape(b * s, h) + self.o(o.transpose(1, 2).reshape(b * s, self.heads * self.d))
            return (hsum + self.mlp(hsum)).view(b, s, h)


def te_variants(layer):
    """([(name, module)], None) for TransformerEngine, or ([], the reason it is skipped)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
        from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format
    except Exception as exc:
        return [], f"not importable: {type(exc).__name__}: {str(exc)[:120]}"
    recipes = [("TE BF16", None),
               ("TE FP8 delayed (HYBRID, history 1024)",
                DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max")),
               ("TE FP8 current scaling", Float8CurrentScaling(fp8_format=Format.HYBRID))]
    out = []
    for name, recipe in recipes:
        try:
            out.append((name, TeLlamaLayer(layer, recipe)))
        except Exception as exc:
            log(f"{name}: could not be built ({type(exc).__name__}: {exc})")
    return out, None


def torchao_variant(layer):
    """(name, module) of torchao float8 tensorwise + torch.compile, or raises."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    ao = convert_to_float8_training(copy.deepcopy(layer), config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return "torchao float8 tensorwise + compile", torch.compile(ao)


def clear_grads(params, x):
    for p in params:
        p.grad = None
    x.grad = None


HOST_AHEAD_SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU sleep: longer than the host needs to enqueue a forward


def measure(name, fn, x, params, iters, warmup=3):
    """fwd+bwd ms three ways (synchronised steps: median; back to back: mean; host ahead: median of steps queued
    behind a GPU sleep, i.e. the step's GPU time alone) and the memory saved for backward (allocated after forward,
    minus before, minus the output)."""
    dy = torch.randn_like(x)
    for _ in range(warmup):
        clear_grads(params, x)
        fn(x).backward(dy)
    torch.cuda.synchronize()
    clear_grads(params, x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = fn(x)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    out.backward(dy)
    del out
    gc.collect()
    gc.disable()  # no collector pauses inside the timed steps (the same for every variant)
    try:
        times = []
        for _ in range(iters):
            clear_grads(params, x)
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            fn(x).backward(dy)
            t1.record()
            torch.cuda.synchronize()
            times.append(t0.elapsed_time(t1))
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(iters):
            clear_grads(params, x)
            fn(x).backward(dy)
        t1.record()
        torch.cuda.synchronize()
        steady = t0.elapsed_time(t1) / iters
        ahead = []
        for _ in range(iters):
            clear_grads(params, x)
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(HOST_AHEAD_SLEEP_CYCLES)
            t0.record()
            fn(x).backward(dy)
            t1.record()
            torch.cuda.synchronize()
            ahead.append(t0.elapsed_time(t1))
    finally:
        gc.enable()
    times.sort()
    ms, ahead = times[len(times) // 2], sorted(ahead)[len(ahead) // 2]
    log(f"  {name:44s} fwd+bwd {ms:7.2f} ms (min {times[0]:.2f}; back to back {steady:.2f}; host ahead "
        f"{ahead:.2f})   saved {saved / 2**20:8.1f} MiB")
    return {"variant": name, "ms": ms, "ms_min": times[0], "ms_steady": steady, "ms_host_ahead": ahead,
            "saved_mib": saved / 2**20}


def run_variants(variants, x, iters, rows):
    for name, module in variants:
        try:
            t = time.time()
            rows.append(measure(name, module, x, list(module.parameters()), iters))
            log(f"    ({time.time() - t:.0f} s incl. warm-up/compile)")
        except Exception:
            log(f"{name}: FAILED\n{traceback.format_exc()}")
        torch.cuda.empty_cache()


def layer_errors(ref32, module, x):
    """Relative L2 errors of output and input gradient of `module` against the fp32 layer, same inputs."""
    x32 = x.detach().float().requires_grad_()
    dy = torch.randn_like(x32)
    out32 = ref32(x32)
    out32.backward(dy)
    xb = x.detach().clone().requires_grad_()
    out = module(xb)
    out.backward(dy.to(out.dtype))
    return {"out": rel(out, out32), "dx": rel(xb.grad, x32.grad)}


def saved_by_dtype(module, x):
    """MiB saved for backward by dtype (through saved_tensors_hooks; parameters included)."""
    counts = {}

    def pack(t):
        key = str(t.dtype).replace("torch.", "")
        counts[key] = counts.get(key, 0) + t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    del out
    return {k: round(v / 2**20, 1) for k, v in counts.items()}


def chart(rows, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no chart")
        return
    names = [r["variant"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.5 * len(rows) + 2))
    for ax, key, label in ((axes[0], "ms", "fwd+bwd ms"), (axes[1], "saved_mib", "saved activations MiB")):
        values = [0.0 if math.isnan(r.get(key, math.nan)) else r[key] for r in rows]
        ax.barh(names, values, color=["C3" if n.startswith("COAT") else "C0" for n in names])
        ax.set_xlabel(label)
        ax.invert_yaxis()
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.1f}", va="center")
    axes[1].set_yticklabels([])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"chart: {path}")


def save_json(obj, name):
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, name), "w") as f:
        json.dump(obj, f, indent=1)
