"""Host (CPU) time of one decoder layer's forward + backward, with the GPU held busy so the host never waits: COAT
(Hugging Face's Llama layer converted by coat_hf: what users run), the same layer in BF16, and TransformerEngine's
`TransformerLayer` (BF16 and FP8 delayed scaling) when `transformer_engine` imports. Also: the host time per step
with steps issued back to back and no sleep kernel (what a training loop sees; the sleep kernel inflates a
launch-heavy layer such as BF16's, so compare variants by this column), launches per layer step (CUDA kernel
launches counted by the profiler), the step's GPU time with the host ahead, its synchronised wall time, and
(--cprofile) each eager variant's Python cost grouped by code (coat_kernels, Triton, torch, ...) and its top
functions.

Default shape: TinyLlama 1.1B's layer (hidden 2048, FFN 5632, 32 heads, 4 key/value heads), micro-batch 1 x 2048.

    python benchmarks/layer_host_time.py [--batch 1] [--seq 2048] [--cprofile] [--variants coat,coat_cached,bf16,te]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layer_common as lc  # noqa: E402
from host_overhead import bound_launches, host_times, per_call_us  # noqa: E402

from coat_kernels.act import ActivationConfig  # noqa: E402

BUSY_CYCLES = 1_000_000_000  # ~0.5 s of GPU sleep: longer than any host work measured here
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


def step(layer, x, dy, params):
    for p in params:
        p.grad = None
    x.grad = None
    out = layer(x)
    out.backward(dy)


def gpu_and_wall_ms(layer, x, dy, params, reps=10):
    """(GPU ms with the host ahead, synchronised wall ms), medians."""
    ahead, wall = [], []
    for _ in range(reps):
        torch.cuda._sleep(BUSY_CYCLES // 20)
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        step(layer, x, dy, params)
        t1.record()
        torch.cuda.synchronize()
        ahead.append(t0.elapsed_time(t1))
        t = time.perf_counter()
        step(layer, x, dy, params)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t) * 1e3)
    return sorted(ahead)[reps // 2], sorted(wall)[reps // 2]


def host_back_to_back_ms(layer, x, dy, params, reps=10):
    """Host ms per step with `reps` steps issued one after another and no sleep kernel in front (one synchronize
    at the end): the host's pace as a training loop sees it. Where the layer is host-bound this is also its wall
    time per step; where the GPU is slower the host runs ahead until the steps' memory or the launch queue stops it."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        step(layer, x, dy, params)
    host = (time.perf_counter() - t) / reps
    torch.cuda.synchronize()
    return host * 1e3


def launches(layer, x, dy, params):
    """CUDA kernel launches (and graph launches) of one forward + backward."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(layer, x, dy, params)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.name in LAUNCHES)


def python_profile(layer, x, dy, params, reps=5):
    torch.cuda._sleep(BUSY_CYCLES)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        step(layer, x, dy, params)
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    out.write(grouped_profile(prof, reps) + "\n\n")
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(45)
    return out.getvalue()


def code_group(filename: str, function: str) -> str:
    """Where a profiled function's own time belongs: the package of a Python function, or the C call it is."""
    for package in ("coat_kernels", "coat_hf", "triton", "transformers", "torch"):
        if f"/{package}/" in filename:
            return f"{package} (Python)"
    if filename == "~":
        if "triton" in function or "__triton_launcher" in function:
            return "Triton (C): " + function[:60]
        if "torch" in function or "TensorBase" in function or "_EngineBase" in function:
            return "torch (C): " + function[:60]
        return "Python built-ins"
    return "other Python: " + os.path.basename(filename)


def grouped_profile(prof: cProfile.Profile, reps: int, top: int = 16) -> str:
    """Own (tottime) ms and calls per step, grouped by code_group."""
    own, calls = {}, {}
    for (filename, _, function), (_, ncalls, tottime, _, _) in pstats.Stats(prof).stats.items():
        group = code_group(filename, function)
        own[group] = own.get(group, 0.0) + tottime
        calls[group] = calls.get(group, 0) + ncalls
    total = sum(own.values())
    lines = [f"per step, cProfile's overhead included: {total * 1e3 / reps:.2f} ms, "
             f"{sum(calls.values()) / reps:.0f} calls"]
    for group in sorted(own, key=own.get, reverse=True)[:top]:
        lines.append(f"  {own[group] * 1e3 / reps:7.3f} ms {calls[group] / reps:7.1f} calls  {group}")
    return "\n".join(lines)


class TeLayer(torch.nn.Module):
    """TransformerEngine's TransformerLayer (RMSNorm, SwiGLU, GQA, RoPE, causal), BF16 or under an FP8 recipe."""

    def __init__(self, cfg, recipe):
        super().__init__()
        import transformer_engine.pytorch as te

        self.te, self.recipe = te, recipe
        self.layer = te.TransformerLayer(
            cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
            num_gqa_groups=cfg.num_key_value_heads, layernorm_epsilon=1e-5, hidden_dropout=0.0,
            attention_dropout=0.0, self_attn_mask_type="causal", normalization="RMSNorm", activation="swiglu",
            bias=False, attn_input_format="bshd", params_dtype=torch.bfloat16, fuse_qkv_params=True).cuda()
        try:
            from transformer_engine.pytorch.attention import RotaryPositionEmbedding
        except ImportError:
            from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding
        self.rope = RotaryPositionEmbedding(cfg.hidden_size // cfg.num_attention_heads)(
            cfg.max_position_embeddings).cuda()

    def forward(self, x):
        with self.te.autocast(enabled=self.recipe is not None, recipe=self.recipe):
            return self.layer(x, rotary_pos_emb=self.rope[: x.shape[1]])


def variants(args, ref):
    out = []
    if "coat" in args.variants:
        out.append(("COAT (weights quantized every forward)", lc.coat_layer(ref)))
    if "coat_graphs" in args.variants:
        out.append(("COAT + per-layer CUDA graphs (cuda_graphs=True)",
                    lc.coat_layer(ref, ActivationConfig(cache_weights=False, cuda_graphs=True))))
    if "coat_cached" in args.variants:
        out.append(("COAT, warm weight cache (micro-batch >= 2 of a step)", lc.coat_layer(ref, warm_cache=True)))
    if "bf16" in args.variants:
        out.append(("BF16 (Hugging Face layer, SDPA)", ref))
    if "te" in args.variants:
        try:
            from transformer_engine.common.recipe import DelayedScaling, Format

            cfg = ref.model.config
            out.append(("TE TransformerLayer BF16", TeLayer(cfg, None)))
            out.append(("TE TransformerLayer FP8 delayed", TeLayer(cfg, DelayedScaling(fp8_format=Format.HYBRID))))
        except Exception as exc:  # noqa: BLE001 - reported, the other rows still run
            lc.log(f"TransformerEngine rows skipped: {type(exc).__name__}: {str(exc)[:200]}")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--variants", default="coat,coat_graphs,coat_cached,bf16,te")
    p.add_argument("--pieces", action="store_true", help="also the host cost of single calls (_scaled_mm, a launch)")
    p.add_argument("--cprofile", action="store_true")
    args = p.parse_args()
    lc.log(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  shape: batch {args.batch} x seq "
           f"{args.seq}, hidden {args.hidden}, ffn {args.ffn}, heads {args.heads}/{args.kv_heads}", name="host.log")
    _, ref = lc.make_layers("cuda", args.batch, args.seq, args.hidden, args.ffn, args.heads, args.kv_heads)
    ref = ref.cuda()
    x = torch.randn(args.batch, args.seq, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    rows = []
    for name, layer in variants(args, ref):
        params = list(layer.parameters())
        for _ in range(3):
            step(layer, x, dy, params)
        torch.cuda.synchronize()
        fwd, bwd = host_times(layer, x, dy, params, reps=10)
        back_to_back = host_back_to_back_ms(layer, x, dy, params)
        gpu, wall = gpu_and_wall_ms(layer, x, dy, params)
        n = launches(layer, x, dy, params)
        row = dict(variant=name, host_fwd_ms=fwd, host_bwd_ms=bwd, host_ms=fwd + bwd,
                   host_back_to_back_ms=back_to_back, gpu_ms=gpu, wall_ms=wall, launches=n)
        rows.append(row)
        lc.log(f"{name:55s} host {fwd + bwd:6.2f} ms (fwd {fwd:5.2f}, bwd {bwd:5.2f}; back to back {back_to_back:5.2f})"
               f"  GPU {gpu:6.2f} ms  wall {wall:6.2f} ms  launches {n}", name="host.log")
        if args.cprofile and not name.startswith(("COAT +", "TE")):
            lc.log(python_profile(layer, x, dy, params), name="host_cprofile.log")
        del layer
        torch.cuda.empty_cache()
    if args.pieces:
        rows.append(dict(pieces=piece_costs()))
    lc.save_json(dict(args=vars(args), rows=rows), "layer_host_time.json")


def piece_costs():
    """Host us per call of the pieces a COAT layer step is made of, in a tight loop with the GPU busy."""
    from coat_kernels.act import tensor_quant as TQ

    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5632, 2048, device="cuda", dtype=torch.bfloat16)
    scale = TQ.tensor_scale(a, "e4m3", True)
    a8, w8 = TQ.cast(a, scale, "e4m3", True)[0], TQ.cast(w, scale, "e4m3", True)[0]
    grid = (triton.cdiv(2048, TQ.CAST_BM), triton.cdiv(2048, TQ.CAST_BN))
    q = torch.empty_like(a8)
    kw = dict(WRITE_ROW=True, WRITE_T=False, E5M2_OUT=False, BM=TQ.CAST_BM, BN=TQ.CAST_BN, num_warps=TQ.CAST_WARPS)
    cast_args = (a, scale, q, None, 2048, 2048, 2048)
    via_launcher, via_c = bound_launches(TQ._cast_kernel, grid, cast_args, kw)
    costs = {
        "torch.empty [2048, 2048] fp8": lambda: torch.empty(2048, 2048, device="cuda", dtype=torch.float8_e4m3fn),
        "torch._scaled_mm [2048,2048]x[2048,5632]": lambda: torch._scaled_mm(
            a8, w8.t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16),
        "torch.matmul bf16 [2048,2048]x[2048,5632]": lambda: a @ w.t(),
        "cast kernel launch": lambda: TQ._cast_kernel[grid](*cast_args, **kw),
        "cast kernel, compiled kernel's launcher": via_launcher,
        "cast kernel, C launch function": via_c,
        "TQ.cast (allocation + launch)": lambda: TQ.cast(a, scale, "e4m3", True),
    }
    out = {k: per_call_us(f, n=300) for k, f in costs.items()}
    for k, v in out.items():
        lc.log(f"  host us per call: {k:45s} {v:7.1f}", name="host.log")
    return out


if __name__ == "__main__":
    main()
