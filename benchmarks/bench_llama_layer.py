"""One Llama-2-7B decoder layer (H 4096, SwiGLU FFN 11008, 32 heads, batch 4 x seq 2048, RMSNorm, RoPE, causal SDPA
flash attention), fwd+bwd ms and saved-activation MiB for every variant, measured the same way in one process:
saved = memory allocated after forward - before forward - the output (whatever forward creates and keeps counts).
Variants: COAT (fused MLP block, and the unfused blocks), COAT with a warm WeightCache, BF16 eager and
torch.compile, torchao float8 + compile, TransformerEngine BF16 / FP8 delayed / FP8 current scaling (when
`transformer_engine` imports), and COAT / BF16 replayed as CUDA graphs (captured in child processes, so a failed
capture cannot touch the other rows).
Also: GPU correctness of each Triton kernel against its torch reference, the COAT layer's output/gradient error
against an fp32 layer (beside BF16's), the dtypes COAT saves, each quantization kernel's bandwidth against a device
copy, a tile sweep, and a one-step kernel timeline (GPU busy/idle, largest gaps). Writes a PNG bar chart, a JSON and
the log to $OUT (or ./out).

    python benchmarks/bench_llama_layer.py [--skip sweep,compile,torchao,te,graph,...] [--autotune]
    python benchmarks/bench_llama_layer.py --cpu-smoke     # tiny shapes on the CPU (TRITON_INTERPRET=1): code paths
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:  # before any CUDA work: TE must load its cuDNN before torch loads another one (a mixed pair fails to link)
    import transformer_engine.pytorch  # noqa: F401
except Exception:  # noqa: BLE001 - te_variants reports why
    pass

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from coat_kernels import act_norm, act_pointwise, act_quant as aq, act_rope, act_swiglu, blocks  # noqa: E402
from coat_kernels.formats import E4M3, E5M2  # noqa: E402

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
LOG = None


def log(*a):
    global LOG
    if LOG is None:
        LOG = open(os.path.join(OUT, "bench_llama_layer.log"), "a")
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n")
    LOG.flush()


class RMSNorm(nn.Module):
    def __init__(self, h, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):  # Hugging Face's LlamaRMSNorm
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x):
    return torch.cat([-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]], -1)


class LlamaLayer(nn.Module):
    def __init__(self, h, ffn, heads, seq):
        super().__init__()
        self.h, self.ffn, self.heads, self.d, self.seq = h, ffn, heads, h // heads, seq
        self.ln1, self.ln2 = RMSNorm(h), RMSNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.fc1 = nn.Linear(h, 2 * ffn, bias=False)  # [gate | up]
        self.fc2 = nn.Linear(ffn, h, bias=False)
        cos, sin = act_rope.rope_tables(seq, self.d)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, self.d).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        cos = torch.cat([self.cos, self.cos], -1).to(x.dtype)[None, None]
        sin = torch.cat([self.sin, self.sin], -1).to(x.dtype)[None, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.o(o)
        gate, up = self.fc1(self.ln2(x)).chunk(2, -1)
        return x + self.fc2(F.silu(gate) * up)


def attention(r, qkv, b, s, h):
    """RoPE + q/k/v split (one Triton kernel per output, BF16) and causal SDPA; o in [b*s, h] (flash keeps o in
    [b, s, heads, d], so this is a view of what SDPA saves anyway)."""
    q, k, v = act_rope.rope_split(qkv, r.cos, r.sin, s, r.d)
    q, k, v = (t.view(b, s, r.heads, r.d).transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    return o.reshape(b * s, h), o.is_contiguous()


class CoatLlamaLayer(nn.Module):
    """The same layer on COAT's FP8 blocks (shares the BF16 layer's parameters). fused=True: norm 1's input is
    passed through as the residual (its two gradients meet inside the norm backward) and the MLP is one
    fp8_norm_swiglu_mlp block; fused=False: the separate blocks (fp8_add_norm_linear + fp8_swiglu_linear)."""

    def __init__(self, ref: LlamaLayer, weight_cache=False, fused=True):
        super().__init__()
        self.ref, self.fused = ref, fused
        self.caches = {n: (blocks.WeightCache() if weight_cache else None) for n in ("qkv", "o", "fc1", "fc2")}
        self.reuse_attn_out = None

    def forward(self, x):
        r, c = self.ref, self.caches
        b, s, h = x.shape
        x2 = x.reshape(b * s, h)
        if self.fused:
            qkv, x2 = blocks.fp8_norm_linear(x2, r.ln1.weight, None, r.qkv.weight, weight_cache=c["qkv"],
                                             residual_out=True)
        else:
            qkv = blocks.fp8_norm_linear(x2, r.ln1.weight, None, r.qkv.weight, weight_cache=c["qkv"])
        o, contiguous = attention(r, qkv, b, s, h)
        if self.reuse_attn_out is None:
            self.reuse_attn_out = contiguous  # flash keeps o: the linear reuses it as its saved input
        a = blocks.fp8_linear(o, r.o.weight, weight_cache=c["o"], reuse_input=self.reuse_attn_out)
        if self.fused:
            y, hsum = blocks.fp8_norm_swiglu_mlp(a, r.ln2.weight, None, r.fc1.weight, r.fc2.weight, residual=x2,
                                                 fc1_cache=c["fc1"], fc2_cache=c["fc2"])
        else:
            y1, hsum = blocks.fp8_add_norm_linear(a, x2, r.ln2.weight, None, r.fc1.weight, weight_cache=c["fc1"])
            y = blocks.fp8_swiglu_linear(y1, r.fc2.weight, weight_cache=c["fc2"])
        return (hsum + y).view(b, s, h)


class FastAccumFprop(nn.Module):
    """A COAT layer whose forward GEMMs use fast FP8 accumulation (act_gemm.FPROP_FAST_ACCUM), as TE's fprop and
    torchao's tensorwise recipe do; the gradient GEMMs keep fp32 accumulation."""

    def __init__(self, coat):
        super().__init__()
        self.coat = coat

    def forward(self, x):
        from coat_kernels.act_gemm import fprop_fast_accumulation
        with fprop_fast_accumulation():
            return self.coat(x)


class TeLlamaLayer(nn.Module):
    """TransformerEngine's modules (LayerNormLinear + Linear + LayerNormMLP with SwiGLU, RMSNorm, no biases) around
    the same RoPE kernel and SDPA; recipe None = BF16. Its own parameters, copied from the BF16 layer."""

    def __init__(self, ref: LlamaLayer, recipe):
        super().__init__()
        import transformer_engine.pytorch as te
        h, ffn = ref.h, ref.ffn
        self.te, self.recipe, self.r = te, recipe, ref
        kw = dict(params_dtype=torch.bfloat16, bias=False)
        self.qkv = te.LayerNormLinear(h, 3 * h, eps=1e-5, normalization="RMSNorm", **kw)
        self.o = te.Linear(h, h, **kw)
        self.mlp = te.LayerNormMLP(h, ffn, eps=1e-5, normalization="RMSNorm", activation="swiglu", **kw)
        with torch.no_grad():
            self.qkv.layer_norm_weight.copy_(ref.ln1.weight)
            self.qkv.weight.copy_(ref.qkv.weight)
            self.o.weight.copy_(ref.o.weight)
            self.mlp.layer_norm_weight.copy_(ref.ln2.weight)
            self.mlp.fc1_weight.copy_(ref.fc1.weight)
            self.mlp.fc2_weight.copy_(ref.fc2.weight)

    def forward(self, x):
        b, s, h = x.shape
        with self.te.autocast(enabled=self.recipe is not None, recipe=self.recipe):
            qkv = self.qkv(x.reshape(b * s, h))
            o, _ = attention(self.r, qkv, b, s, h)
            hsum = x.reshape(b * s, h) + self.o(o)
            return (hsum + self.mlp(hsum)).view(b, s, h)


def te_variants(layer):
    """[(name, module)] for TransformerEngine, or a reason it is skipped."""
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


# ------------------------------------------------------------------------------------------------ measurement
def clear_grads(params, x):
    """Gradients set to None before a step (the same for every variant)."""
    for p in params:
        p.grad = None
    x.grad = None


HOST_AHEAD_SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU sleep: longer than the host needs to enqueue a forward (~4 ms)


def measure(name, fn, x, params, iters, warmup=3):
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
    times = []
    gc.collect()
    gc.disable()  # no collector pauses inside the timed steps (the same for every variant)
    try:
        for _ in range(iters):
            clear_grads(params, x)
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            fn(x).backward(dy)
            t1.record()
            torch.cuda.synchronize()
            times.append(t0.elapsed_time(t1))
        # steady state: the same steps back to back, one sync at the end (the CPU launches a step while the GPU
        # still runs the previous one, as in training with many layers); per step
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(iters):
            clear_grads(params, x)
            fn(x).backward(dy)
        t1.record()
        torch.cuda.synchronize()
        steady = t0.elapsed_time(t1) / iters
        # host ahead: a GPU sleep queued before each step lets the host enqueue the step before the GPU starts it, so
        # this is the step's GPU time alone (no launch latency; the sleep also lets the GPU's clocks recover a little)
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
        ahead = sorted(ahead)[len(ahead) // 2]
    finally:
        gc.enable()
    times.sort()
    ms = times[len(times) // 2]
    log(f"  {name:44s} fwd+bwd {ms:7.2f} ms (min {times[0]:.2f}, p90 {times[int(0.9 * (len(times) - 1))]:.2f}; "
        f"back to back {steady:.2f}; host ahead {ahead:.2f})   saved {saved / 2**20:8.1f} MiB")
    return {"variant": name, "ms": ms, "ms_min": times[0], "ms_all": times, "ms_steady": steady, "ms_host_ahead": ahead,
            "saved_mib": saved / 2**20}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def layer_errors(ref32, layer_fn, params, params32, x):
    """Output and gradient errors of one layer against the fp32 layer, same weights and inputs."""
    x32 = x.detach().float().requires_grad_()
    dy = torch.randn_like(x32)
    for p in params32:
        p.grad = None
    out32 = ref32(x32)
    out32.backward(dy)
    xb = x.detach().clone().requires_grad_()
    for _, p in params:
        p.grad = None
    out = layer_fn(xb)
    out.backward(dy.to(out.dtype))
    errs = {"out": rel(out, out32), "dx": rel(xb.grad, x32.grad)}
    for (n, p), p32 in zip(params, params32):
        errs["d" + n] = rel(p.grad, p32.grad)
    return errs


def saved_by_dtype(fn, x):
    counts = {}

    def pack(t):
        key = str(t.dtype).replace("torch.", "")
        counts[key] = counts.get(key, 0) + t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    del out
    return {k: round(v / 2**20, 1) for k, v in counts.items()}


# ------------------------------------------------------------------------------------------- kernel checks
def fp8_agree(a, b):
    """Fraction of differing codes (NaN == NaN)."""
    a, b = a.float(), b.float()
    same = (a == b) | (a.isnan() & b.isnan())
    return 1.0 - same.float().mean().item()


def kernel_checks(dev, m=4096, h=4096, f=11008):
    """Triton vs the torch reference for every kernel (fresh random inputs each call)."""
    x = torch.randn(m, h, device=dev, dtype=torch.bfloat16) * torch.logspace(-2, 2, h, device=dev).bfloat16()
    res = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(m, 2 * f, device=dev, dtype=torch.bfloat16) * 3
    dp = torch.randn(m, f, device=dev, dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(h, device=dev)
    rows = {}

    def pmax(a, b):  # stage-1 partials: same maximum
        return abs(a.max().item() - b.max().item()) / b.max().item()

    for fmt in (E4M3, E5M2):
        a = aq.group_quantize(x, fmt, partial_amax=True, triton_kernels=True)
        b = aq.group_quantize(x, fmt, partial_amax=True, triton_kernels=False)
        rows[f"group_quantize {fmt.name} (codes, scales)"] = (fp8_agree(a[0], b[0]), fp8_agree(a[1], b[1]))
        rows[f"group_dequantize {fmt.name}"] = (rel(aq.group_dequantize(a[0], a[1], torch.float32, triton_kernels=True),
                                                    aq.group_dequantize(b[0], b[1], torch.float32,
                                                                        triton_kernels=False)), pmax(a[2], b[2]))
        s = aq.tensor_scale(x, fmt, triton_kernels=False)
        rows[f"tensor_scale {fmt.name}"] = (abs((aq.tensor_scale(x, fmt, triton_kernels=True) - s).item()), 0)
        a = aq.cast(x, s, fmt, write_t=True, triton_kernels=True)
        b = aq.cast(x, s, fmt, write_t=True, triton_kernels=False)
        rows[f"cast+T {fmt.name}"] = (fp8_agree(a[0], b[0]), fp8_agree(a[1], b[1]))
    xs = x.clone()
    xs[5, 7] = float("inf")
    rows["amax with Inf -> NaN scale"] = (0 if math.isnan(aq.tensor_scale(xs, triton_kernels=True).item()) else 1, 0)
    a = act_norm.norm_forward(x, w, None, residual=res, triton_kernels=True)
    b = norm_ref = act_norm.norm_forward(x, w, None, residual=res, triton_kernels=False)
    rows["norm_forward(residual) codes, rstd"] = (fp8_agree(a[1], b[1]), rel(a[4], b[4]))
    rows["norm_forward partial amax"] = (pmax(a[5], b[5]), fp8_agree(a[2], b[2]))
    s = aq.finalize_scale(b[5], E4M3)
    ca = act_norm.norm_cast(*b[1:5], w, None, s, write_t=True, triton_kernels=True)
    cb = act_norm.norm_cast(*b[1:5], w, None, s, write_t=True, triton_kernels=False)
    rows["norm_cast row, T"] = (fp8_agree(ca[0], cb[0]), fp8_agree(ca[1], cb[1]))
    ta = act_norm.norm_cast(*b[1:5], w, None, s, write_row=False, write_t=True, triton_kernels=True)
    rows["norm_cast T only"] = (fp8_agree(ta[1], cb[1]), 0)
    da = act_norm.norm_backward(*b[1:5], w, res, dres=x, partial_amax=True, triton_kernels=True)
    db = act_norm.norm_backward(*b[1:5], w, res, dres=x, partial_amax=True, triton_kernels=False)
    rows["norm_backward dx, dw"] = (rel(da[0], db[0]), rel(da[1], db[1]))
    rows["norm_backward partial amax"] = (pmax(da[3], db[3]), 0)
    a = act_swiglu.swiglu_forward(gu, write_out=True, triton_kernels=True)
    b = sw_ref = act_swiglu.swiglu_forward(gu, write_out=True, triton_kernels=False)
    rows["swiglu_forward codes, scales"] = (fp8_agree(a[0], b[0]), fp8_agree(a[1], b[1]))
    rows["swiglu_forward partial, product"] = (pmax(a[2], b[2]), rel(a[3], b[3]))
    s = aq.finalize_scale(b[2], E4M3)
    ca = act_swiglu.swiglu_cast(b[0], b[1], s, write_t=True, triton_kernels=True)
    cb = act_swiglu.swiglu_cast(b[0], b[1], s, write_t=True, triton_kernels=False)
    rows["swiglu_cast row, T"] = (fp8_agree(ca[0], cb[0]), fp8_agree(ca[1], cb[1]))
    cb_t = cb[1]
    ds = aq.tensor_scale(act_swiglu.swiglu_grad_ref(b[0], b[1], dp), E5M2)
    ca = act_swiglu.swiglu_backward_cast(b[0], b[1], dp, ds, triton_kernels=True)
    cb = act_swiglu.swiglu_backward_cast(b[0], b[1], dp, ds, triton_kernels=False)
    rows["swiglu_backward_cast row+T (1 launch)"] = (fp8_agree(ca[0], cb[0]), fp8_agree(ca[1], cb[1]))
    ga = act_swiglu.swiglu_backward(b[0], b[1], dp, triton_kernels=True)
    gb = act_swiglu.swiglu_backward(b[0], b[1], dp, triton_kernels=False)
    rows["swiglu_backward dx, partial"] = (rel(ga[0], gb[0]), pmax(ga[1], gb[1]))
    rows["swiglu_backward_amax"] = (pmax(act_swiglu.swiglu_backward_amax(b[0], b[1], dp, triton_kernels=True),
                                         gb[1]), 0)
    pa, pt = act_swiglu.swiglu_backward_amax(b[0], b[1], dp, product_scale=s, triton_kernels=True)
    rows["swiglu_backward_amax + product T"] = (pmax(pa, gb[1]), fp8_agree(pt, cb_t))
    qkv = torch.randn(m, 3 * h, device=dev, dtype=torch.bfloat16)
    cos, sin = act_rope.rope_tables(min(m, 2048), 128 if h % 128 == 0 else 16, device=dev)
    hd = 128 if h % 128 == 0 else 16
    outs = {}
    for backend in ("triton", "torch"):
        os.environ["COAT_ACT_BACKEND"] = backend
        try:
            qkv_b = qkv.detach().clone().requires_grad_()
            o = act_rope.rope_split(qkv_b, cos, sin, min(m, 2048), hd)
            torch.autograd.backward(o, [t * 0.5 for t in o])
            outs[backend] = (o, qkv_b.grad)
        finally:
            os.environ.pop("COAT_ACT_BACKEND", None)
    rows["rope_split fwd, bwd"] = (max(rel(a, b) for a, b in zip(outs["triton"][0], outs["torch"][0])),
                                   rel(outs["triton"][1], outs["torch"][1]))
    for name in ("silu", "gelu"):
        a = act_pointwise.act_forward(x, name, triton_kernels=True)
        b = act_pointwise.act_forward(x, name, triton_kernels=False)
        rows[f"{name} fwd out, codes"] = (rel(a[0], b[0]), fp8_agree(a[1], b[1]))
    # the scale reduced inside the producing launch (last-ticket program) against a separate reduction of the same
    # partials, several launches each (an ordering bug would show as a mismatch now and then)
    mism = 0
    for _ in range(5):
        for p in (aq.amax_partials(x, E4M3), act_norm.norm_forward(x, w, None, residual=res)[5],
                  act_swiglu.swiglu_forward(gu)[2], act_swiglu.swiglu_backward_amax(sw_ref[0], sw_ref[1], dp),
                  act_norm.norm_backward(*norm_ref[1:5], w, res, dres=x, partial_amax=True)[3]):
            fmt = E5M2 if getattr(p, "_coat_scale", (448.0,))[0] != 448.0 else E4M3
            mism += int(not torch.equal(aq.finalize_scale(p, fmt), aq.finalize_scale(p.clone(), fmt)))
    rows["in-launch scale vs separate (25 launches)"] = (mism / 25, 0)
    bad = {k: v for k, v in rows.items() if max(v) > 1e-3 or v[0] != v[0]}
    log(f"GPU kernel checks (Triton vs torch reference; fraction of differing FP8 codes, relative error, or "
        f"relative difference of the partial-amax maxima); {len(bad)} above 1e-3:")
    for k, v in rows.items():
        log(f"  {k:40s} {v[0]:.2e}  {v[1]:.2e}" + ("   <-- CHECK" if k in bad else ""))
    return rows


# ---------------------------------------------------------------------------------------------- bandwidth
def make_timers(dev):
    """(dirty, clean) median-ms timers: triton's do_bench (its L2 flush zero-fills 256 MB, so each timed call also
    pays for writing back up to 50 MB of dirty lines, which weighs most on read-heavy kernels), and events around
    each call after reading a 256 MB buffer (a cold but clean L2)."""
    from triton.testing import do_bench

    flush = torch.empty(2**26, dtype=torch.float32, device=dev).fill_(1.0)

    def dirty(fn):
        return do_bench(fn, warmup=25, rep=100, return_mode="median")

    def clean(fn, reps=30):
        fn()
        events = []
        for _ in range(reps):
            flush.sum()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            fn()
            t1.record()
            events.append((t0, t1))
        torch.cuda.synchronize()
        times = sorted(t0.elapsed_time(t1) for t0, t1 in events)
        return times[len(times) // 2]

    return dirty, clean


def _kernel_inputs(dev, m, h, f, seq, hd):
    """Random BF16 inputs of the kernel benchmarks: x and a second [m, h] tensor (residual / gradient), [gate | up]
    [m, 2f], its gradient [m, f], qkv [m, 3h], RoPE tables, a norm weight."""
    x = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
    cos, sin = act_rope.rope_tables(seq, hd, device=dev)
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    return (x, torch.randn_like(x), torch.randn(m, 2 * f, **bf16), torch.randn(m, f, **bf16),
            torch.randn(m, 3 * h, **bf16), cos, sin, 1 + 0.1 * torch.randn(h, **bf16))


class _Inputs:
    """One set of kernel-benchmark inputs and what the kernels under test read (FP8 copies, scales, statistics)."""

    def __init__(self, dev, m, h, f, seq, hd):
        self.x, self.res, self.gu, self.dp, self.qkv, self.cos, self.sin, self.w = _kernel_inputs(dev, m, h, f, seq, hd)
        self.seq, self.hd = seq, hd
        self.s = aq.tensor_scale(self.x)
        self.q8, self.e8 = aq.group_quantize(self.x)
        _, self.q, self.e, self.mean, self.rstd, _ = act_norm.norm_forward(self.x, self.w, None, residual=self.res)
        self.gq, self.ge, gpart, _ = act_swiglu.swiglu_forward(self.gu)
        self.gs = aq.finalize_scale(gpart)


def _bandwidth_cases(n, n2, nqkv):
    """(name, fn(inputs), bytes moved: each input read once, each output written once)."""
    return [
        ("group_quantize e4m3 [8192,4096]", lambda i: aq.group_quantize(i.x), n * (2 + 1 + 1 / 8)),
        ("group_quantize e5m2 +partials", lambda i: aq.group_quantize(i.x, E5M2, partial_amax=True),
         n * (2 + 1 + 1 / 8)),
        ("group_dequantize [8192,4096]", lambda i: aq.group_dequantize(i.q8, i.e8), n * (1 + 1 / 8 + 2)),
        ("amax + scale [8192,4096]", lambda i: aq.amax_partials(i.x, E4M3), n * 2),
        ("torch x.amax() (a read-only reference)", lambda i: i.x.amax(), n * 2),
        ("cast e4m3 row [8192,4096]", lambda i: aq.cast(i.x, i.s), n * 3),
        ("cast e5m2 row+T [8192,4096]", lambda i: aq.cast(i.x, i.s, E5M2, write_t=True), n * 4),
        ("cast e4m3 T [8192,4096]", lambda i: aq.cast(i.x, i.s, write_row=False, write_t=True), n * 3),
        ("quantize_tensor row+T (2 launches)", lambda i: aq.quantize_tensor(i.x, E5M2, write_t=True), n * 4),
        ("norm_forward+residual [8192,4096]", lambda i: act_norm.norm_forward(i.x, i.w, None, residual=i.res),
         n * (2 + 2 + 2 + 1 + 1 / 8)),
        ("norm_cast row", lambda i: act_norm.norm_cast(i.q, i.e, i.mean, i.rstd, i.w, None, i.s), n * (2 + 1 / 8)),
        ("norm_cast T", lambda i: act_norm.norm_cast(i.q, i.e, i.mean, i.rstd, i.w, None, i.s, write_row=False,
                                                     write_t=True), n * (2 + 1 / 8)),
        ("norm_backward(+dres)", lambda i: act_norm.norm_backward(i.q, i.e, i.mean, i.rstd, i.w, i.res, dres=i.x,
                                                                  partial_amax=True), n * (1 + 1 / 8 + 2 + 2 + 2)),
        ("swiglu_forward [8192,22016]", lambda i: act_swiglu.swiglu_forward(i.gu), n2 * (2 + 1 + 1 / 8)),
        ("swiglu_cast row", lambda i: act_swiglu.swiglu_cast(i.gq, i.ge, i.gs), n2 * (1 + 1 / 8) + n2 // 2),
        ("swiglu_cast T", lambda i: act_swiglu.swiglu_cast(i.gq, i.ge, i.gs, write_row=False, write_t=True),
         n2 * (1 + 1 / 8) + n2 // 2),
        ("swiglu_backward (bf16 out)", lambda i: act_swiglu.swiglu_backward(i.gq, i.ge, i.dp),
         n2 * (1 + 1 / 8 + 1 + 2)),
        ("swiglu_backward_amax", lambda i: act_swiglu.swiglu_backward_amax(i.gq, i.ge, i.dp), n2 * (1 + 1 / 8 + 1)),
        ("swiglu_backward_amax + product T", lambda i: act_swiglu.swiglu_backward_amax(i.gq, i.ge, i.dp,
                                                                                        product_scale=i.gs),
         n2 * (1 + 1 / 8 + 1) + n2 // 2),
        ("swiglu_backward_cast row+T", lambda i: act_swiglu.swiglu_backward_cast(i.gq, i.ge, i.dp, i.gs),
         n2 * (1 + 1 / 8 + 1 + 2)),
        ("rope_split fwd [8192,3x4096]", lambda i: act_rope.rope_split(i.qkv, i.cos, i.sin, i.seq, i.hd), nqkv * 4),
        ("gelu fwd [8192,4096]", lambda i: act_pointwise.act_forward(i.x, "gelu"), n * (2 + 1 + 1 / 8 + 2)),
    ]


def steady_timer(sets, graph_reps=2, replays=5):
    """Median ms per call of fn over back-to-back calls on rotating input sets (together larger than L2, so no call
    finds its inputs cached, and each call pays the write-back of the dirty lines the previous call left, as in a
    training step), captured in one CUDA graph so that launch overhead is not timed."""

    def timed(fn):
        for i in sets:
            fn(i)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in sets:  # warm-up on the capture stream (allocator pools, compiled variants)
                fn(i)
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(graph_reps):
                    for i in sets:
                        fn(i)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            graph.replay()
            t1.record()
            torch.cuda.synchronize()
            times.append(t0.elapsed_time(t1) / (graph_reps * len(sets)))
        del graph
        return sorted(times)[len(times) // 2]

    return timed


def bandwidth(dev, m=8192, h=4096, f=11008, seq=2048, hd=128, timers=None, n_sets=4):
    """Each kernel's bytes per second against a device copy, three ways: triton's do_bench (L2 flushed by a 256 MB
    zero-fill before every call), events after a clean-L2 read, and steady state (steady_timer)."""
    if timers:  # (dirty, clean) stand-ins (the CPU smoke test): steady state timed by the first on one set
        dirty, clean = timers
        steady_of = lambda sets: lambda fn: dirty(lambda: fn(sets[0]))  # noqa: E731
    else:
        (dirty, clean), steady_of = make_timers(dev), steady_timer
    sets = [_Inputs(dev, m, h, f, seq, hd) for _ in range(n_sets)]
    steady = steady_of(sets)

    def copy_gbs(nbytes):
        pairs = [(torch.randn(nbytes // 2, device=dev, dtype=torch.bfloat16),
                  torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16)) for _ in range(n_sets)]
        src, dst = pairs[0]
        rates = [2 * nbytes / t(lambda: dst.copy_(src)) / 1e6 for t in (dirty, clean)]
        rates.append(2 * nbytes / steady_of(pairs)(lambda pr: pr[1].copy_(pr[0])) / 1e6)
        return rates

    big, big_c, big_s = copy_gbs(min(2**29, 8 * m * h))  # 512 MiB
    same, same_c, same_s = copy_gbs(m * h * 2)  # a [8192, 4096] BF16 tensor, like most kernels below
    cases = _bandwidth_cases(m * h, m * 2 * f, m * 3 * h)
    log(f"Bandwidth (bytes read + written): do_bench / clean-L2 events / steady state (graph of back-to-back calls "
        f"over {n_sets} input sets); device copy {big:.0f} / {big_c:.0f} / {big_s:.0f} GB/s at 512 MiB, {same:.0f} / "
        f"{same_c:.0f} / {same_s:.0f} GB/s at 64 MiB; % of the 512 MiB copy timed the same way")
    rows = []
    for name, fn, nbytes in cases:
        try:
            ms, ms_c = dirty(lambda: fn(sets[0])), clean(lambda: fn(sets[0]))
            ms_s = steady(fn)
        except Exception as exc:
            log(f"  {name:40s} FAILED: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        gbs, gbs_c, gbs_s = (nbytes / t / 1e6 for t in (ms, ms_c, ms_s))
        rows.append({"kernel": name, "ms": ms, "GB/s": gbs, "pct_copy": 100 * gbs / big, "pct_copy64": 100 * gbs / same,
                     "ms_clean": ms_c, "pct_copy_clean": 100 * gbs_c / big_c, "ms_steady": ms_s,
                     "pct_copy_steady": 100 * gbs_s / big_s})
        log(f"  {name:40s} {ms * 1000:7.1f} us {gbs:6.0f} GB/s {100 * gbs / big:5.1f}%   ({ms_c * 1000:6.1f} us "
            f"{100 * gbs_c / big_c:5.1f}%)   steady {ms_s * 1000:6.1f} us {100 * gbs_s / big_s:5.1f}%")
    return {"copy_GBs": big, "copy64_GBs": same, "copy_GBs_clean": big_c, "copy64_GBs_clean": same_c,
            "copy_GBs_steady": big_s, "copy64_GBs_steady": same_s, "kernels": rows}


# ------------------------------------------------------------------------------------------------- sweep
TILES = [(8, 16, 4), (4, 32, 4), (16, 8, 4), (16, 16, 8), (8, 32, 8), (32, 4, 4)]
T_TILES = [(32, 4, 4), (64, 2, 4), (32, 8, 8), (64, 4, 8), (64, 8, 8), (128, 4, 8), (128, 8, 8), (128, 8, 16)]
SWEEP = [  # name, module, attributes, configurations
    ("group_quantize", aq, ("GQ_BM", "GQ_G", "GQ_WARPS"), TILES + [(16, 16, 4)]),
    ("amax", aq, ("AMAX_BLOCK", "AMAX_ITERS", "AMAX_WARPS"),
     [(4096, 4, 8), (4096, 2, 4), (2048, 4, 4), (8192, 4, 16), (2048, 8, 4), (4096, 1, 4), (1024, 8, 4)]),
    ("cast row+T", aq, ("CAST_BM", "CAST_BN", "CAST_WARPS"), [(64, 128, 8), (32, 128, 4), (128, 128, 8), (64, 256, 8)]),
    ("norm_cast row", act_norm, ("ROW_TILE",), [(t,) for t in TILES + [(32, 16, 8), (64, 16, 8), (32, 32, 8)]]),
    ("norm_cast T", act_norm, ("T_TILE", "T_MODE"), [(t, mo) for mo in (1, 2, 0) for t in T_TILES]),
    ("norm_backward", act_norm, ("BWD_ROWS", "BWD_WARPS", "BWD_STAGES"),
     [(32, 16, 1), (32, 4, 3), (16, 4, 2), (32, 4, 2), (16, 4, 3), (64, 4, 3), (32, 2, 3), (16, 8, 3), (64, 8, 1)]),
    ("swiglu_forward", act_swiglu, ("FWD_TILE",), [(t,) for t in TILES]),
    ("swiglu_backward", act_swiglu, ("BWD_TILE",), [(t,) for t in TILES + [(16, 32, 16)]]),
    ("swiglu_backward_amax", act_swiglu, ("BWD_TILE",), [(t,) for t in TILES + [(16, 32, 16)]]),
    ("swiglu_backward_amax_T", act_swiglu, ("BWD_AMAX_T_TILE", "T_MODE"), [(t, mo) for mo in (2, 1) for t in T_TILES]),
    ("swiglu_cast row", act_swiglu, ("ROW_TILE",), [(t,) for t in TILES]),
    ("swiglu_cast T", act_swiglu, ("T_TILE", "T_MODE"), [(t, mo) for mo in (1, 2, 0) for t in T_TILES]),
    ("swiglu_backward_cast", act_swiglu, ("BWD_CAST_TILE", "BWD_CAST_T_MODE"),
     [(t, mo) for mo in (1, 2, 0) for t in T_TILES]),
    ("rope", act_rope, ("BT", "NH", "WARPS"), [(2, 8, 4), (4, 8, 4), (1, 16, 4), (2, 16, 8), (4, 4, 4), (8, 8, 8)]),
]


def sweep(dev, apply=False, m=8192, h=4096, f=11008, seq=2048, hd=128, only=None):
    """Tile/warp/mode choices of the memory-bound kernels, best first. Every configuration's outputs are checked
    against the torch reference first (a wrong one is listed as such and never kept); apply=True keeps the best."""
    from triton.testing import do_bench

    x, dy, gu, dp, qkv, cos, sin, w = _kernel_inputs(dev, m, h, f, seq, hd)
    s = aq.tensor_scale(x)
    _, q, e, mean, rstd, _ = act_norm.norm_forward(x, w, None)
    gq, ge, gpart, _ = act_swiglu.swiglu_forward(gu)
    gs = aq.finalize_scale(gpart)
    n, n2 = m * h, m * 2 * f
    fp8 = lambda a, b: max(fp8_agree(u, v) for u, v in zip(a, b) if u is not None)  # noqa: E731

    def rope(tri):
        if not tri:
            os.environ["COAT_ACT_BACKEND"] = "torch"
        try:
            return act_rope.rope_split(qkv, cos, sin, seq, hd)
        finally:
            os.environ.pop("COAT_ACT_BACKEND", None)

    work = {  # fn(triton: bool) -> outputs, bytes, difference to the reference outputs
        "group_quantize": (lambda t: aq.group_quantize(x, triton_kernels=t), n * 3.125, fp8),
        "amax": (lambda t: aq.amax_partials(x, E4M3 if t else None, triton_kernels=t), n * 2.0,
                 lambda a, b: abs(a.max().item() - b.max().item())),
        "cast row+T": (lambda t: aq.cast(x, s, write_t=True, triton_kernels=t), n * 4.0, fp8),
        "norm_cast row": (lambda t: act_norm.norm_cast(q, e, mean, rstd, w, None, s, triton_kernels=t), n * 2.125,
                          fp8),
        "norm_cast T": (lambda t: act_norm.norm_cast(q, e, mean, rstd, w, None, s, write_row=False, write_t=True,
                                                     triton_kernels=t), n * 2.125, fp8),
        "norm_backward": (lambda t: act_norm.norm_backward(q, e, mean, rstd, w, dy, dres=x, partial_amax=True,
                                                           triton_kernels=t),
                          n * 7.125, lambda a, b: rel(a[0], b[0])),
        "swiglu_forward": (lambda t: act_swiglu.swiglu_forward(gu, triton_kernels=t), n2 * 3.125,
                           lambda a, b: max(fp8(a[:2], b[:2]), abs(a[2].max().item() / b[2].max().item() - 1))),
        "swiglu_backward": (lambda t: act_swiglu.swiglu_backward(gq, ge, dp, triton_kernels=t), n2 * 4.125,
                            lambda a, b: rel(a[0], b[0])),
        "swiglu_backward_amax": (lambda t: act_swiglu.swiglu_backward_amax(gq, ge, dp, triton_kernels=t), n2 * 1.625,
                                 lambda a, b: abs(a.max().item() / b.max().item() - 1)),
        "swiglu_backward_amax_T": (lambda t: act_swiglu.swiglu_backward_amax(gq, ge, dp, product_scale=gs,
                                                                              triton_kernels=t), n2 * 1.875,
                                   lambda a, b: max(abs(a[0].max().item() / b[0].max().item() - 1),
                                                    fp8_agree(a[1], b[1]))),
        "swiglu_cast row": (lambda t: act_swiglu.swiglu_cast(gq, ge, gs, triton_kernels=t), n2 * 1.625, fp8),
        "swiglu_cast T": (lambda t: act_swiglu.swiglu_cast(gq, ge, gs, write_row=False, write_t=True,
                                                           triton_kernels=t), n2 * 1.625, fp8),
        "swiglu_backward_cast": (lambda t: act_swiglu.swiglu_backward_cast(gq, ge, dp, gs, triton_kernels=t),
                                 n2 * 4.125, fp8),
        "rope": (rope, qkv.numel() * 4.0, lambda a, b: max(rel(u, v) for u, v in zip(a, b))),
    }
    tol = {"norm_backward": 1e-3, "swiglu_backward": 1e-3, "rope": 1e-3, "amax": 0.0}
    out = {}
    for name, mod, attrs, configs in SWEEP:
        if only and name not in only:
            continue
        fn, nbytes, diff = work[name]
        ref = fn(False)
        default = tuple(getattr(mod, a) for a in attrs)
        res = []
        for cfg in configs:
            for a, v in zip(attrs, cfg):
                setattr(mod, a, v)
            try:
                d = diff(fn(True), ref)
                if not d <= tol.get(name, 1e-5):
                    res.append((0.0, f"{cfg} WRONG (difference {d:.2e})"))
                    continue
                ms = do_bench(lambda: fn(True), warmup=10, rep=40, return_mode="median")
                res.append((nbytes / ms / 1e6, cfg))
            except Exception as exc:
                res.append((0.0, f"{cfg} failed: {type(exc).__name__}"))
        res.sort(key=lambda r: -r[0])
        best = res[0][1] if res and res[0][0] > 0 else default
        for a, v in zip(attrs, best if apply else default):
            setattr(mod, a, v)
        out[name] = {"default": str(default), "best": str(best), "applied": apply,
                     "results": [(round(g), str(c)) for g, c in res]}
        log(f"  sweep {name:16s} {attrs}: " + "  ".join(f"{c}={g:.0f}" for g, c in res)
            + (f"   -> {best}" if apply else ""))
    return out


# ----------------------------------------------------------------------------------------------- profile
def _category(name):
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if "nvjet" in n or "gemm" in n or "cutlass" in n or "xmma" in n or "scaled_mm" in n:
        return "GEMM"
    if name.startswith("_") and "kernel" in n:
        return "Triton (ours)"
    if "memset" in n or "memcpy" in n:
        return "memset/memcpy"
    return "torch elementwise/reduce"


def profile_step(layer, x, params, path, steps=3):
    """Kernel timeline of single fwd+bwd steps: busy (union of kernel intervals), idle inside the step, the largest
    gaps (with their neighbours), time per kernel category and per kernel."""
    from torch.autograd import DeviceType

    dy = torch.randn_like(x)
    for _ in range(2):
        layer(x).backward(dy)
    per = []
    for i in range(steps):
        clear_grads(params, x)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            layer(x).backward(dy)
            torch.cuda.synchronize()
        ev = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
                    for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA)
        busy, gaps, cats, kern = 0, [], {}, {}
        cur_s, cur_e, last_name = ev[0][0], ev[0][1], ev[0][2]
        for s, e, name in ev:
            cats[_category(name)] = cats.get(_category(name), 0) + (e - s)
            k = kern.setdefault(name[:70], [0, 0])
            k[0] += 1
            k[1] += e - s
            if s > cur_e:
                busy += cur_e - cur_s
                gaps.append((s - cur_e, last_name[:40], name[:40]))
                cur_s = s
            if e > cur_e:
                cur_e, last_name = e, name
        busy += cur_e - cur_s
        span = ev[-1][1] - ev[0][0]
        gaps.sort(reverse=True)
        per.append({"span_ms": span / 1e6, "busy_ms": busy / 1e6, "idle_ms": (span - busy) / 1e6,
                    "launches": len(ev), "gaps_over_5us": sum(1 for g in gaps if g[0] > 5000),
                    "top_gaps_us": [(round(g / 1e3, 1), a, b) for g, a, b in gaps[:8]],
                    "category_ms": {k: round(v / 1e6, 3) for k, v in sorted(cats.items(), key=lambda t: -t[1])},
                    "kernels": sorted(((n, c, round(t / 1e3, 1)) for n, (c, t) in kern.items()), key=lambda t: -t[2])})
    best = min(per, key=lambda p: p["span_ms"])
    with open(path, "w") as fh:
        json.dump(per, fh, indent=1)
    log(f"  timeline (profiled steps, ms): span " + ", ".join(f"{p['span_ms']:.2f}" for p in per)
        + "; busy " + ", ".join(f"{p['busy_ms']:.2f}" for p in per)
        + f"; {best['launches']} device ops; categories {best['category_ms']}")
    log(f"  largest gaps (us, after -> before): {best['top_gaps_us']}")
    for n, c, t in best["kernels"][:30]:
        log(f"    {t:9.1f} us  x{c:<3d} {n}")
    return per


# -------------------------------------------------------------------------------------------- CUDA graphs
def graph_child(kinds, shape, iters):
    """In a child process: capture one whole fwd+bwd step as a CUDA graph (everything made and warmed up on the
    capture stream, grads None at capture so the graph owns them), replay it, time the replays, and compare the
    replayed gradients with an eager step. Prints one GRAPH_RESULT line per kind."""
    bsz, seq, h, ffn, heads = shape
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        layer = make_layers(dev, bsz, seq, h, ffn, heads)[1]
        x = (torch.randn(bsz, seq, h, device=dev)).to(torch.bfloat16).requires_grad_()
        dy = torch.randn_like(x)
        params = list(layer.parameters())
        for kind in kinds:
            fn = {"coat": lambda: CoatLlamaLayer(layer), "bf16": lambda: layer,
                  "coat_cached": lambda: CoatLlamaLayer(layer, weight_cache=True)}[kind]()
            for _ in range(3):
                clear_grads(params, x)
                fn(x).backward(dy)
            torch.cuda.synchronize()
            eager = [p.grad.clone() for p in params] + [x.grad.clone()]
            clear_grads(params, x)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                out = fn(x)
                out.backward(dy)
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            diff = max(rel(a, b) for a, b in zip([p.grad for p in params] + [x.grad], eager))
            times = []
            for _ in range(iters):
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record(stream)
                g.replay()
                t1.record(stream)
                t1.synchronize()
                times.append(t0.elapsed_time(t1))
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record(stream)
            for _ in range(iters):
                g.replay()
            t1.record(stream)
            t1.synchronize()
            times.sort()
            print("GRAPH_RESULT " + json.dumps({"kind": kind, "ms": times[len(times) // 2], "ms_min": times[0],
                                                "ms_steady": t0.elapsed_time(t1) / iters,
                                                "max_rel_grad_diff_vs_eager": diff}), flush=True)
            del g, out
            clear_grads(params, x)
            torch.cuda.empty_cache()


GRAPH_NAMES = {"coat": "COAT, CUDA graph (fwd+bwd replay)", "coat_cached": "COAT + warm WeightCache, CUDA graph",
               "bf16": "BF16 eager, CUDA graph"}


def graphed_rows(shape, iters, kinds=("coat", "coat_cached", "bf16")):
    """Run graph_child in fresh processes until every kind has a result or failed (a failed capture ends its
    process; the rest go on in a new one)."""
    rows, left = [], list(kinds)
    while left:
        cmd = [sys.executable, os.path.abspath(__file__), "--graph-child", ",".join(left), "--iters", str(iters),
               "--shape", ",".join(map(str, shape))]
        t = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        done = []
        for line in proc.stdout.splitlines():
            if line.startswith("GRAPH_RESULT "):
                r = json.loads(line[len("GRAPH_RESULT "):])
                done.append(r["kind"])
                rows.append({"variant": GRAPH_NAMES[r["kind"]], "ms": r["ms"], "ms_min": r["ms_min"],
                             "ms_steady": r["ms_steady"], "saved_mib": float("nan"),
                             "max_rel_grad_diff_vs_eager": r["max_rel_grad_diff_vs_eager"]})
                log(f"  {GRAPH_NAMES[r['kind']]:44s} fwd+bwd {r['ms']:7.2f} ms (min {r['ms_min']:.2f}; back to back "
                    f"{r['ms_steady']:.2f})   grads vs eager: max rel diff {r['max_rel_grad_diff_vs_eager']:.1e}")
        left = [k for k in left if k not in done]
        if left:  # the first kind left failed
            log(f"  {GRAPH_NAMES[left[0]]}: FAILED (rc {proc.returncode}, {time.time() - t:.0f} s)\n"
                + proc.stderr[-3000:])
            left = left[1:]
    return rows


# ------------------------------------------------------------------------------------------------- chart
def chart(rows, path):
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
        ax.barh(names, [0.0 if math.isnan(r[key]) else r[key] for r in rows],
                color=["C3" if n.startswith("COAT") else "C0" for n in names])
        ax.set_xlabel(label)
        ax.invert_yaxis()
        for i, r in enumerate(rows):
            ax.text(0.0 if math.isnan(r[key]) else r[key], i, f" {r[key]:.1f}", va="center")
    axes[1].set_yticklabels([])
    fig.suptitle("Llama-2-7B decoder layer, batch 4 x seq 2048, " + torch.cuda.get_device_name())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"chart: {path}")


def run_variants(variants, x, params, iters, rows):
    for name, fn in variants:
        try:
            t = time.time()
            rows.append(measure(name, fn, x, list(fn.parameters()) if isinstance(fn, nn.Module) else params, iters))
            log(f"    ({time.time() - t:.0f} s incl. warm-up/compile)")
        except Exception:
            log(f"{name}: FAILED\n{traceback.format_exc()}")
        torch.cuda.empty_cache()


def make_layers(dev, bsz, seq, h, ffn, heads):
    """(fp32 reference layer, bf16 layer with the same weights), seeded."""
    torch.manual_seed(0)
    base = LlamaLayer(h, ffn, heads, seq).to(dev)
    with torch.no_grad():
        for lin in (base.qkv, base.o, base.fc1, base.fc2):
            lin.weight.normal_(0, 0.02)
        base.ln1.weight.uniform_(0.8, 1.2)
        base.ln2.weight.uniform_(0.8, 1.2)
    layer = LlamaLayer(h, ffn, heads, seq).to(dev).to(torch.bfloat16)
    layer.load_state_dict({k: v.to(torch.bfloat16) for k, v in base.state_dict().items()})
    return base, layer


def cpu_smoke():
    """The code paths that need no GPU, at tiny shapes on the CPU: kernel checks (Triton interpreter vs the torch
    references), the COAT layer (fused and unfused, both backends) against fp32, saved dtypes."""
    dev = "cpu"
    os.environ["COAT_ACT_BACKEND"] = "triton"
    kernel_checks(dev, m=40, h=64, f=48)
    bsz, seq, h, ffn, heads = 2, 16, 64, 48, 4
    ref32, layer = make_layers(dev, bsz, seq, h, ffn, heads)
    x = torch.randn(bsz, seq, h).to(torch.bfloat16).requires_grad_()
    named = list(layer.named_parameters())
    for fused in (True, False):
        for backend in ("triton", "torch"):
            os.environ["COAT_ACT_BACKEND"] = backend
            e = layer_errors(ref32, CoatLlamaLayer(layer, fused=fused), named, list(ref32.parameters()), x)
            log(f"  COAT fused={fused} {backend}: " + "  ".join(f"{n}={v:.4f}" for n, v in e.items()))
    log(f"  saved by dtype: {saved_by_dtype(CoatLlamaLayer(layer), x)}")
    v, why = te_variants(layer)
    log(f"  TransformerEngine: {'skipped (' + why + ')' if why else [n for n, _ in v]}")
    import triton.testing
    import time as _t

    def fake(fn, **kw):
        t = _t.perf_counter()
        fn()
        return (_t.perf_counter() - t) * 1e3

    triton.testing.do_bench = fake  # the sweep's and bandwidth's code paths, not their numbers
    sweep(dev, apply=True, m=32, h=64, f=48, seq=16, hd=16)
    bandwidth(dev, m=32, h=64, f=48, seq=16, hd=16, timers=(fake, fake))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip", default="", help="comma list: checks,sweep,bandwidth,layer,profile,compile,torchao,te,"
                                               "graph,unfused,fastacc")
    ap.add_argument("--autotune", action="store_true", help="keep the sweep's best tiles for the rest of the run")
    ap.add_argument("--sweep", default="", help="comma list of the sweep's kernels to run (default: all)")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--graph-child", default="")
    ap.add_argument("--shape", default="")
    args = ap.parse_args()
    if args.cpu_smoke:
        return cpu_smoke()
    if args.graph_child:
        return graph_child(args.graph_child.split(","), tuple(int(v) for v in args.shape.split(",")), args.iters)
    skip = set(args.skip.split(","))
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    log(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  skip={sorted(skip - {''})}")
    shape = (2, 256, 1024, 2816, 8) if args.quick else (4, 2048, 4096, 11008, 32)
    bsz, seq, h, ffn, heads = shape
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": list(shape)}
    json_path = os.path.join(OUT, "bench_llama_layer.json")

    def save():
        with open(json_path, "w") as fh:
            json.dump(results, fh, indent=1)

    def step(key, fn):
        t = time.time()
        try:
            results[key] = fn()
        except Exception:
            log(f"{key}: FAILED\n{traceback.format_exc()}")
        log(f"  [{key}: {time.time() - t:.0f} s]")
        save()

    if "checks" not in skip:
        step("kernel_checks", lambda: kernel_checks(dev))
    if "sweep" not in skip:
        step("sweep", lambda: sweep(dev, apply=args.autotune, only=set(filter(None, args.sweep.split(",")))))
        if args.autotune and "checks" not in skip:
            step("kernel_checks_tuned", lambda: kernel_checks(dev))
    if "bandwidth" not in skip:
        step("bandwidth", lambda: bandwidth(dev))
    if "layer" in skip:  # kernel sections only
        return
    ref32, layer = make_layers(dev, bsz, seq, h, ffn, heads)
    x = torch.randn(bsz, seq, h, device=dev).to(torch.bfloat16).requires_grad_()
    params = list(layer.parameters())
    named = list(layer.named_parameters())
    rows = []
    coat = CoatLlamaLayer(layer)

    def errors():  # outside the flash-only context: the fp32 reference needs another SDPA backend
        errs = {"BF16 eager": layer_errors(ref32, layer, named, list(ref32.parameters()), x),
                "COAT": layer_errors(ref32, coat, named, list(ref32.parameters()), x),
                "COAT unfused": layer_errors(ref32, CoatLlamaLayer(layer, fused=False), named,
                                             list(ref32.parameters()), x),
                "COAT fast-acc fprop": layer_errors(ref32, FastAccumFprop(coat), named, list(ref32.parameters()), x)}
        os.environ["COAT_ACT_BACKEND"] = "torch"  # the torch references on the GPU: separates kernel bugs from FP8
        try:
            errs["COAT torch-ref"] = layer_errors(ref32, coat, named, list(ref32.parameters()), x)
        finally:
            del os.environ["COAT_ACT_BACKEND"]
        log("Relative L2 error vs the fp32 layer (same weights/inputs):")
        for k, v in errs.items():
            log(f"  {k:20s} " + "  ".join(f"{n}={e:.4f}" for n, e in v.items()))
        return errs

    step("errors_vs_fp32", errors)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        step("coat_saved_by_dtype_MiB", lambda: saved_by_dtype(coat, x))
        log(f"COAT saved-for-backward by dtype (MiB): {results.get('coat_saved_by_dtype_MiB')}; reuses the flash "
            f"output as the o-proj input: {coat.reuse_attn_out}")
        for p in ref32.parameters():
            p.grad = None
        del ref32
        torch.cuda.empty_cache()
        first = [("COAT (weights quantized every step)", coat),
                 ("COAT + warm WeightCache (micro-batch >= 2)", CoatLlamaLayer(layer, weight_cache=True))]
        if "unfused" not in skip:
            first.append(("COAT, unfused blocks", CoatLlamaLayer(layer, fused=False)))
        if "fastacc" not in skip:
            first.append(("COAT, fast-accumulation forward GEMMs", FastAccumFprop(coat)))
        first.append(("BF16 eager", layer))
        run_variants(first, x, params, args.iters, rows)
        results["layer"] = rows
        save()
        if "profile" not in skip:
            step("coat_timeline", lambda: profile_step(coat, x, params, os.path.join(OUT, "coat_timeline.json")))
    if "graph" not in skip:
        step("graph_rows", lambda: graphed_rows(shape, args.iters))
        rows += results.get("graph_rows") or []
        results["layer"] = rows
        save()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        later = []
        if "te" not in skip:
            te_rows, why = te_variants(layer)
            if why:
                log(f"TransformerEngine: skipped ({why})")
            later += te_rows
            delayed = [m for n, m in te_rows if "delayed" in n]
            if delayed and "profile" not in skip:  # where TE's step spends its time, next to COAT's timeline
                step("te_delayed_timeline", lambda: profile_step(delayed[0], x, params,
                                                                  os.path.join(OUT, "te_delayed_timeline.json")))
        if "compile" not in skip:
            later.append(("BF16 torch.compile", torch.compile(layer)))
        if "torchao" not in skip:
            try:
                import copy

                from torchao.float8 import Float8LinearConfig, convert_to_float8_training
                ao = convert_to_float8_training(copy.deepcopy(layer),
                                                config=Float8LinearConfig.from_recipe_name("tensorwise"))
                later.append(("torchao float8 tensorwise + compile", torch.compile(ao)))
            except Exception as exc:
                log(f"torchao: skipped ({type(exc).__name__}: {exc})")
        run_variants(later, x, params, args.iters, rows)
    results["layer"] = rows
    save()
    chart(rows, os.path.join(OUT, "llama_layer.png"))
    log("\n| variant | fwd+bwd ms (median) | min | back to back | host ahead | saved MiB |\n|---|---|---|---|---|---|")
    for r in rows:
        mib = "n/a" if math.isnan(r["saved_mib"]) else f"{r['saved_mib']:.0f}"
        log(f"| {r['variant']} | {r['ms']:.2f} | {r['ms_min']:.2f} | {r.get('ms_steady', float('nan')):.2f} | "
            f"{r.get('ms_host_ahead', float('nan')):.2f} | {mib} |")
    if "bandwidth" in results:
        b = results["bandwidth"]
        log(f"copy {b['copy_GBs']:.0f} GB/s (64 MiB: {b['copy64_GBs']:.0f}); " + "; ".join(
            f"{k['kernel'].split(' [')[0]} {k['pct_copy']:.0f}%" for k in b["kernels"]))


if __name__ == "__main__":
    main()
