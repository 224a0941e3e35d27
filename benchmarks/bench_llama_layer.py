"""One Llama-2-7B decoder layer (H 4096, SwiGLU FFN 11008, 32 heads, batch 4 x seq 2048, RMSNorm, RoPE, causal SDPA
flash attention), fwd+bwd ms and saved-activation MiB for every variant, measured the same way in one process:
saved = memory allocated after forward - before forward - the output (whatever forward creates and keeps counts).
Also: GPU correctness of each Triton kernel against its torch reference, the COAT layer's output/gradient error
against an fp32 layer (beside BF16's), the dtypes COAT saves, and each quantization kernel's bandwidth against a
device copy. Writes a PNG bar chart, a JSON and the log to $OUT (or ./out).

    python benchmarks/bench_llama_layer.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from coat_kernels import act_norm, act_pointwise, act_quant as aq, act_rope, act_swiglu, blocks  # noqa: E402
from coat_kernels.formats import E4M3, E5M2  # noqa: E402

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
LOG = open(os.path.join(OUT, "bench_llama_layer.log"), "w")


def log(*a):
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


class CoatLlamaLayer(nn.Module):
    """The same layer on COAT's FP8 blocks (shares the BF16 layer's parameters)."""

    def __init__(self, ref: LlamaLayer, weight_cache=False):
        super().__init__()
        self.ref = ref
        self.caches = {n: (blocks.WeightCache() if weight_cache else None) for n in ("qkv", "o", "fc1", "fc2")}
        self.reuse_attn_out = None

    def forward(self, x):
        r, c = self.ref, self.caches
        b, s, h = x.shape
        x2 = x.reshape(b * s, h)
        qkv = blocks.fp8_norm_linear(x2, r.ln1.weight, None, r.qkv.weight, weight_cache=c["qkv"])
        q, k, v = act_rope.rope_split(qkv, r.cos, r.sin, s, r.d)
        q, k, v = (t.view(b, s, r.heads, r.d).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        if self.reuse_attn_out is None:
            self.reuse_attn_out = o.is_contiguous()  # flash keeps o in [b, s, heads, d]: the linear reuses it
        a = blocks.fp8_linear(o.reshape(b * s, h), r.o.weight, weight_cache=c["o"], reuse_input=self.reuse_attn_out)
        y1, hsum = blocks.fp8_add_norm_linear(a, x2, r.ln2.weight, None, r.fc1.weight, weight_cache=c["fc1"])
        return (hsum + blocks.fp8_swiglu_linear(y1, r.fc2.weight, weight_cache=c["fc2"])).view(b, s, h)


# ------------------------------------------------------------------------------------------------ measurement
def measure(name, fn, x, params, iters, warmup=3):
    dy = torch.randn_like(x)
    for _ in range(warmup):
        for p in params:
            p.grad = None
        x.grad = None
        fn(x).backward(dy)
    torch.cuda.synchronize()
    for p in params:
        p.grad = None
    x.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = fn(x)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    out.backward(dy)
    del out
    times = []
    for _ in range(iters):
        for p in params:
            p.grad = None
        x.grad = None
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        fn(x).backward(dy)
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1))
    times.sort()
    ms = times[len(times) // 2]
    log(f"  {name:44s} fwd+bwd {ms:7.2f} ms (min {times[0]:.2f})   saved {saved / 2**20:8.1f} MiB")
    return {"variant": name, "ms": ms, "ms_min": times[0], "saved_mib": saved / 2**20}


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
    """Fraction of differing codes; max difference in FP8 steps is judged by dequantized values."""
    a, b = a.float(), b.float()
    same = (a == b) | (a.isnan() & b.isnan())
    return 1.0 - same.float().mean().item()


def kernel_checks(dev):
    torch.manual_seed(1)
    m, h, f = 4096, 4096, 11008
    x = torch.randn(m, h, device=dev, dtype=torch.bfloat16) * torch.logspace(-2, 2, h, device=dev).bfloat16()
    res = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(m, 2 * f, device=dev, dtype=torch.bfloat16) * 3
    dp = torch.randn(m, f, device=dev, dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(h, device=dev)
    rows = {}
    for fmt in (E4M3, E5M2):
        a, b = aq.group_quantize(x, fmt, triton_kernels=True), aq.group_quantize(x, fmt, triton_kernels=False)
        rows[f"group_quantize {fmt.name}"] = (fp8_agree(a[0], b[0]), fp8_agree(a[1], b[1]))
        s = aq.tensor_scale(x, fmt, triton_kernels=False)
        rows[f"tensor_scale {fmt.name}"] = (abs((aq.tensor_scale(x, fmt, triton_kernels=True) - s).item()), 0)
        a = aq.cast(x, s, fmt, write_t=True, triton_kernels=True)
        b = aq.cast(x, s, fmt, write_t=True, triton_kernels=False)
        rows[f"cast+T {fmt.name}"] = (fp8_agree(a[0], b[0]), fp8_agree(a[1], b[1]))
    a = act_norm.norm_forward(x, w, None, residual=res, triton_kernels=True)
    b = act_norm.norm_forward(x, w, None, residual=res, triton_kernels=False)
    rows["norm_forward(residual)"] = (fp8_agree(a[1], b[1]), rel(a[4], b[4]))
    s = aq.finalize_scale(b[5], E4M3)
    ca = act_norm.norm_cast(*b[1:5], w, None, s, write_t=True, triton_kernels=True)
    cb = act_norm.norm_cast(*b[1:5], w, None, s, write_t=True, triton_kernels=False)
    rows["norm_cast+T"] = (fp8_agree(ca[0], cb[0]), fp8_agree(ca[1], cb[1]))
    ta = act_norm.norm_cast(*b[1:5], w, None, s, write_row=False, write_t=True, triton_kernels=True)
    rows["norm_cast T only"] = (fp8_agree(ta[1], cb[1]), 0)
    da = act_norm.norm_backward(*b[1:5], w, res, dres=x, triton_kernels=True)
    db = act_norm.norm_backward(*b[1:5], w, res, dres=x, triton_kernels=False)
    rows["norm_backward"] = (rel(da[0], db[0]), rel(da[1], db[1]))
    a, b = act_swiglu.swiglu_forward(gu, triton_kernels=True), act_swiglu.swiglu_forward(gu, triton_kernels=False)
    rows["swiglu_forward"] = (fp8_agree(a[0], b[0]), fp8_agree(a[1], b[1]))
    s = aq.finalize_scale(b[2], E4M3)
    ca = act_swiglu.swiglu_cast(b[0], b[1], s, write_t=True, triton_kernels=True)
    cb = act_swiglu.swiglu_cast(b[0], b[1], s, write_t=True, triton_kernels=False)
    rows["swiglu_cast+T"] = (fp8_agree(ca[0], cb[0]), fp8_agree(ca[1], cb[1]))
    ta = act_swiglu.swiglu_cast(b[0], b[1], s, write_row=False, write_t=True, triton_kernels=True)
    rows["swiglu_cast T only"] = (fp8_agree(ta[1], cb[1]), 0)
    ds = aq.tensor_scale(act_swiglu.swiglu_grad_ref(b[0], b[1], dp), E5M2)
    ca = act_swiglu.swiglu_backward_cast(b[0], b[1], dp, ds, triton_kernels=True)
    cb = act_swiglu.swiglu_backward_cast(b[0], b[1], dp, ds, triton_kernels=False)
    rows["swiglu_backward_cast+T"] = (fp8_agree(ca[0], cb[0]), fp8_agree(ca[1], cb[1]))
    ga = act_swiglu.swiglu_backward(b[0], b[1], dp, triton_kernels=True)
    gb = act_swiglu.swiglu_backward(b[0], b[1], dp, triton_kernels=False)
    rows["swiglu_backward"] = (rel(ga[0], gb[0]), 0)
    for name in ("silu", "gelu"):
        a = act_pointwise.act_forward(x, name, triton_kernels=True)
        b = act_pointwise.act_forward(x, name, triton_kernels=False)
        rows[f"{name} fwd"] = (rel(a[0], b[0]), fp8_agree(a[1], b[1]))
    log("GPU kernel checks (Triton vs torch reference; fraction of differing FP8 codes, or relative error):")
    for k, v in rows.items():
        log(f"  {k:28s} {v[0]:.2e}  {v[1]:.2e}")
    return rows


def bandwidth(dev):
    from triton.testing import do_bench

    m, h, f = 8192, 4096, 11008
    big = torch.randn(2**29 // 2, device=dev, dtype=torch.bfloat16)  # 512 MiB
    dst = torch.empty_like(big)
    copy_ms = do_bench(lambda: dst.copy_(big), warmup=25, rep=200, return_mode="median")
    copy_gbs = 2 * big.numel() * 2 / copy_ms / 1e6
    del big, dst
    x = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    gu = torch.randn(m, 2 * f, device=dev, dtype=torch.bfloat16)
    dp = torch.randn(m, f, device=dev, dtype=torch.bfloat16)
    w = torch.ones(h, device=dev, dtype=torch.bfloat16)
    n, n2 = x.numel(), gu.numel()
    s = aq.tensor_scale(x)
    hs, q, e, mean, rstd, part = act_norm.norm_forward(x, w, None, residual=res)
    gq, ge, gpart, _ = act_swiglu.swiglu_forward(gu)
    gs = aq.finalize_scale(gpart)
    cases = [  # name, fn, bytes moved (each input read once, each output written once)
        ("group_quantize e4m3 [8192,4096]", lambda: aq.group_quantize(x), n * (2 + 1 + 1 / 16)),
        ("group_dequantize [8192,4096]", lambda: aq.group_dequantize(q, e), n * (1 + 1 / 16 + 2)),
        ("amax partials [8192,4096]", lambda: aq.amax_partials(x), n * 2),
        ("cast e4m3 row [8192,4096]", lambda: aq.cast(x, s), n * 3),
        ("cast e5m2 row+T [8192,4096]", lambda: aq.cast(x, s, E5M2, write_t=True), n * 4),
        ("cast e4m3 T [8192,4096]", lambda: aq.cast(x, s, write_row=False, write_t=True), n * 3),
        ("quantize_tensor row+T (3 launches)", lambda: aq.quantize_tensor(x, E5M2, write_t=True), n * 4),
        ("norm_forward+residual [8192,4096]", lambda: act_norm.norm_forward(x, w, None, residual=res),
         n * (2 + 2 + 2 + 1 + 1 / 16)),
        ("norm_cast row", lambda: act_norm.norm_cast(q, e, mean, rstd, w, None, s), n * (2 + 1 / 16)),
        ("norm_cast T", lambda: act_norm.norm_cast(q, e, mean, rstd, w, None, s, write_row=False, write_t=True),
         n * (2 + 1 / 16)),
        ("norm_backward(+dres)", lambda: act_norm.norm_backward(q, e, mean, rstd, w, res, dres=x),
         n * (1 + 1 / 16 + 2 + 2 + 2)),
        ("swiglu_forward [8192,22016]", lambda: act_swiglu.swiglu_forward(gu), n2 * (2 + 1 + 1 / 16)),
        ("swiglu_cast row", lambda: act_swiglu.swiglu_cast(gq, ge, gs), n2 * (1 + 1 / 16) + n2 // 2),
        ("swiglu_cast T", lambda: act_swiglu.swiglu_cast(gq, ge, gs, write_row=False, write_t=True),
         n2 * (1 + 1 / 16) + n2 // 2),
        ("swiglu_backward (bf16 out)", lambda: act_swiglu.swiglu_backward(gq, ge, dp), n2 * (1 + 1 / 16 + 1 + 2)),
        ("swiglu_backward_cast row+T", lambda: act_swiglu.swiglu_backward_cast(gq, ge, dp, gs), n2 * (1 + 1 / 16 + 1 + 2)),
        ("gelu fwd [8192,4096]", lambda: act_pointwise.act_forward(x, "gelu"), n * (2 + 1 + 1 / 16 + 2)),
    ]
    log(f"Bandwidth: device copy {copy_gbs:.0f} GB/s (bytes read + written)")
    rows = []
    for name, fn, nbytes in cases:
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        gbs = nbytes / ms / 1e6
        rows.append({"kernel": name, "ms": ms, "GB/s": gbs, "pct_copy": 100 * gbs / copy_gbs})
        log(f"  {name:40s} {ms * 1000:8.1f} us  {gbs:7.0f} GB/s  {100 * gbs / copy_gbs:5.1f}% of copy")
    return {"copy_GBs": copy_gbs, "kernels": rows}


def run_variants(variants, x, params, iters, rows):
    for name, fn in variants:
        try:
            t = time.time()
            rows.append(measure(name, fn, x, list(fn.parameters()) if isinstance(fn, nn.Module) else params, iters))
            log(f"    ({time.time() - t:.0f} s incl. warm-up/compile)")
        except Exception:
            log(f"{name}: FAILED\n{traceback.format_exc()}")
        torch.cuda.empty_cache()


def sweep(dev):
    """Tile/warp choices of the main memory-bound kernels (best first); defaults are set from this table."""
    from triton.testing import do_bench

    m, h, f = 8192, 4096, 11008
    x = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(m, 2 * f, device=dev, dtype=torch.bfloat16)
    w = torch.ones(h, device=dev, dtype=torch.bfloat16)
    s = aq.tensor_scale(x)
    _, q, e, mean, rstd, _ = act_norm.norm_forward(x, w, None)
    knobs = [
        ("group_quantize", aq, ("GQ_BM", "GQ_BK", "GQ_WARPS"),
         [(32, 128, 4), (64, 128, 8), (16, 256, 4), (32, 256, 8), (64, 64, 4), (128, 64, 8)],
         lambda: aq.group_quantize(x), m * h * 3.0625),
        ("amax", aq, ("AMAX_BLOCK", "AMAX_ITERS", "AMAX_WARPS"),
         [(4096, 4, 8), (8192, 2, 8), (2048, 8, 4), (8192, 4, 16), (4096, 1, 4), (16384, 1, 16)],
         lambda: aq.amax_partials(x), m * h * 2.0),
        ("cast row+T", aq, ("CAST_BM", "CAST_BN", "CAST_WARPS"),
         [(64, 128, 8), (32, 128, 4), (64, 64, 4), (128, 64, 8), (128, 128, 8), (64, 256, 8)],
         lambda: aq.cast(x, s, write_t=True), m * h * 4.0),
        ("norm_cast row", act_norm, ("CAST_BM", "CAST_BN", "CAST_WARPS"),
         [(64, 128, 8), (32, 128, 4), (64, 64, 4), (128, 64, 8), (128, 128, 8), (16, 256, 4)],
         lambda: act_norm.norm_cast(q, e, mean, rstd, w, None, s), m * h * 2.0625),
        ("swiglu_forward", act_swiglu, ("FWD_BM", "FWD_WARPS"),
         [(32, 4), (16, 4), (64, 8), (32, 8), (8, 4)], lambda: act_swiglu.swiglu_forward(gu), m * 2 * f * 3.0625),
    ]
    out = {}
    for name, mod, attrs, configs, fn, nbytes in knobs:
        default = tuple(getattr(mod, a) for a in attrs)
        res = []
        for cfg in configs:
            for a, v in zip(attrs, cfg):
                setattr(mod, a, v)
            try:
                ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
                res.append((nbytes / ms / 1e6, cfg))
            except Exception as exc:
                res.append((0.0, f"{cfg} failed: {type(exc).__name__}"))
        for a, v in zip(attrs, default):
            setattr(mod, a, v)
        res.sort(key=lambda r: -r[0])
        out[name] = [(round(g), str(c)) for g, c in res]
        log(f"  sweep {name:16s} {attrs}: " + "  ".join(f"{c}={g:.0f}" for g, c in res))
    return out


def profile_coat(layer, x, path):
    dy = torch.randn_like(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            layer(x).backward(dy)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
    with open(path, "w") as fh:
        fh.write(table)
    LOG.write(table + "\n")


def graphed_coat(layer, x, params, iters, rows):
    """Launch overhead: the COAT layer replayed as CUDA graphs (time only: a graph pool holds the memory). Last in
    the script: a failed capture leaves the CUDA RNG unusable for the rest of the process."""
    try:
        graphed = torch.cuda.make_graphed_callables(CoatLlamaLayer(layer), (x,))
        r = measure("COAT, CUDA-graphed fwd+bwd (time only)", graphed, x, params, iters)
        r["saved_mib"] = float("nan")
        rows.append(r)
    except Exception:
        log(f"graphed COAT: FAILED\n{traceback.format_exc()}")


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
        ax.barh(names, [0.0 if math.isnan(r[key]) else r[key] for r in rows], color=["C3" if n.startswith("COAT") else "C0" for n in names])
        ax.set_xlabel(label)
        ax.invert_yaxis()
        for i, r in enumerate(rows):
            ax.text(0.0 if math.isnan(r[key]) else r[key], i, f" {r[key]:.1f}", va="center")
    axes[1].set_yticklabels([])
    fig.suptitle("Llama-2-7B decoder layer, batch 4 x seq 2048, " + torch.cuda.get_device_name())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"chart: {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip", default="", help="comma list: checks,bandwidth,compile,torchao,te")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    log(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}")
    bsz, seq, h, ffn, heads = (2, 256, 1024, 2816, 8) if args.quick else (4, 2048, 4096, 11008, 32)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [bsz, seq, h, ffn, heads]}
    if "checks" not in skip:
        try:
            results["kernel_checks"] = kernel_checks(dev)
        except Exception:
            log(traceback.format_exc())
    torch.manual_seed(0)
    base = LlamaLayer(h, ffn, heads, seq).to(dev)
    with torch.no_grad():
        for lin in (base.qkv, base.o, base.fc1, base.fc2):
            lin.weight.normal_(0, 0.02)
        base.ln1.weight.uniform_(0.8, 1.2)
        base.ln2.weight.uniform_(0.8, 1.2)
    ref32 = base  # fp32 copy for error measurement, then the bf16 layer
    layer = LlamaLayer(h, ffn, heads, seq).to(dev).to(torch.bfloat16)
    layer.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref32.state_dict().items()})
    x = (torch.randn(bsz, seq, h, device=dev) * 1.0).to(torch.bfloat16).requires_grad_()
    params = list(layer.parameters())
    named = [(n, p) for n, p in layer.named_parameters()]
    rows = []
    coat = CoatLlamaLayer(layer)
    try:  # outside the flash-only context: the fp32 reference needs another SDPA backend
        errs = {"BF16 eager": layer_errors(ref32, layer, named, list(ref32.parameters()), x),
                "COAT": layer_errors(ref32, coat, named, list(ref32.parameters()), x)}
        os.environ["COAT_ACT_BACKEND"] = "torch"  # the torch references on the GPU: separates kernel bugs from FP8
        try:
            errs["COAT torch-ref"] = layer_errors(ref32, coat, named, list(ref32.parameters()), x)
        finally:
            del os.environ["COAT_ACT_BACKEND"]
        results["errors_vs_fp32"] = errs
        log("Relative L2 error vs the fp32 layer (same weights/inputs):")
        for k, v in errs.items():
            log(f"  {k:12s} " + "  ".join(f"{n}={e:.4f}" for n, e in v.items()))
    except Exception:
        log(traceback.format_exc())
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            results["coat_saved_by_dtype_MiB"] = saved_by_dtype(coat, x)
            log(f"COAT saved-for-backward by dtype (MiB, via saved_tensors_hooks): {results['coat_saved_by_dtype_MiB']}")
            log(f"  COAT reuses the flash output as the o-proj input: {coat.reuse_attn_out}")
        except Exception:
            log(traceback.format_exc())
        for p in ref32.parameters():
            p.grad = None
        del ref32, base
        torch.cuda.empty_cache()
        coat_cached = CoatLlamaLayer(layer, weight_cache=True)
        first = [("COAT (weights quantized every step)", coat),
                 ("COAT + warm WeightCache (micro-batch >= 2)", coat_cached), ("BF16 eager", layer)]
        run_variants(first, x, params, args.iters, rows)
        if "profile" not in skip:
            try:
                profile_coat(coat, x, os.path.join(OUT, "coat_profile.txt"))
            except Exception:
                log(traceback.format_exc())
    if "sweep" not in skip:
        try:
            results["sweep"] = sweep(dev)
        except Exception:
            log(traceback.format_exc())
    if "bandwidth" not in skip:
        try:
            results["bandwidth"] = bandwidth(dev)
        except Exception:
            log(traceback.format_exc())
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        later = []
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
        if "te" not in skip:
            try:
                import transformer_engine.pytorch as te  # noqa: F401
                log("TransformerEngine: importable, but its variants are not wired into this script yet")
            except Exception as exc:
                log(f"TransformerEngine: skipped (not importable: {type(exc).__name__})")
        run_variants(later, x, params, args.iters, rows)
        if "graph" not in skip:
            graphed_coat(layer, x, params, args.iters, rows)
    results["layer"] = rows
    chart(rows, os.path.join(OUT, "llama_layer.png"))
    with open(os.path.join(OUT, "bench_llama_layer.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    log("\n| variant | fwd+bwd ms | saved MiB |\n|---|---|---|")
    for r in rows:
        mib = "n/a" if math.isnan(r["saved_mib"]) else f"{r['saved_mib']:.0f}"
        log(f"| {r['variant']} | {r['ms']:.2f} | {mib} |")
    if "bandwidth" in results:
        log(f"copy {results['bandwidth']['copy_GBs']:.0f} GB/s; " + "; ".join(
            f"{k['kernel'].split(' [')[0]} {k['pct_copy']:.0f}%" for k in results["bandwidth"]["kernels"]))


if __name__ == "__main__":
    main()
