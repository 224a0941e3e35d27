"""One Llama-2-7B decoder layer (H 4096, SwiGLU FFN 11008, 32 heads, batch 4 x seq 2048, RMSNorm, RoPE, causal SDPA
flash attention): fwd+bwd ms and memory saved for backward of every variant, measured the same way in one process.

Variants: COAT (Hugging Face's Llama layer converted by coat_hf) with weights quantized every step, with a warm weight
cache (what micro-batches after the first of a step see), with fast-accumulation forward GEMMs; BF16 eager and
torch.compile; torchao float8 tensorwise + compile; TransformerEngine BF16 / FP8 delayed / FP8 current scaling
(when `transformer_engine` imports); COAT and BF16 replayed as CUDA graphs (captured in child processes, so a failed
capture cannot touch the other rows). Also the output/gradient error of each against an fp32 layer, the dtypes COAT
saves, and (--profile) a one-step kernel timeline. Writes a table, a JSON and a PNG to $OUT (or ./out).

    python benchmarks/bench_llama_layer.py [--skip compile,torchao,te,graph,...] [--profile] [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layer_common as lc  # noqa: E402  (imports TransformerEngine before torch touches CUDA)
import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from coat_kernels.act import ActivationConfig  # noqa: E402

GRAPH_NAMES = {"coat": "COAT, CUDA graph (fwd+bwd replay)", "coat_cached": "COAT + warm weight cache, CUDA graph",
               "bf16": "BF16 eager, CUDA graph"}


def graph_child(kinds, shape, iters):
    """In a child process: capture one whole fwd+bwd step as a CUDA graph (everything made and warmed up on the
    capture stream, grads None at capture so the graph owns them), replay it and time the replays. Prints one
    GRAPH_RESULT line per kind."""
    bsz, seq, h, ffn, heads = shape
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        layer = lc.make_layers("cuda", bsz, seq, h, ffn, heads)[1]
        x = torch.randn(bsz, seq, h, device="cuda").to(torch.bfloat16).requires_grad_()
        dy = torch.randn_like(x)
        for kind in kinds:
            fn = {"coat": lambda: lc.coat_layer(layer), "bf16": lambda: layer,
                  "coat_cached": lambda: lc.coat_layer(layer, warm_cache=True)}[kind]()
            params = list(fn.parameters())
            for _ in range(3):
                lc.clear_grads(params, x)
                fn(x).backward(dy)
            torch.cuda.synchronize()
            eager = [p.grad.clone() for p in params] + [x.grad.clone()]
            lc.clear_grads(params, x)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                fn(x).backward(dy)
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            diff = max(lc.rel(a, b) for a, b in zip([p.grad for p in params] + [x.grad], eager))
            times = []
            for _ in range(iters):
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record(stream)
                g.replay()
                t1.record(stream)
                t1.synchronize()
                times.append(t0.elapsed_time(t1))
            times.sort()
            print("GRAPH_RESULT " + json.dumps({"kind": kind, "ms": times[len(times) // 2], "ms_min": times[0],
                                                "max_rel_grad_diff_vs_eager": diff}), flush=True)
            del g
            lc.clear_grads(params, x)
            torch.cuda.empty_cache()


def graphed_rows(shape, iters, kinds=("coat", "coat_cached", "bf16")):
    """graph_child in fresh processes until every kind has a result or failed (a failed capture ends its process)."""
    rows, left = [], list(kinds)
    while left:
        cmd = [sys.executable, os.path.abspath(__file__), "--graph-child", ",".join(left), "--iters", str(iters),
               "--shape", ",".join(map(str, shape))]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        done = []
        for line in proc.stdout.splitlines():
            if line.startswith("GRAPH_RESULT "):
                r = json.loads(line[len("GRAPH_RESULT "):])
                done.append(r["kind"])
                rows.append({"variant": GRAPH_NAMES[r["kind"]], "ms": r["ms"], "ms_min": r["ms_min"],
                             "saved_mib": math.nan, "max_rel_grad_diff_vs_eager": r["max_rel_grad_diff_vs_eager"]})
                lc.log(f"  {GRAPH_NAMES[r['kind']]:44s} fwd+bwd {r['ms']:7.2f} ms (min {r['ms_min']:.2f})   grads vs "
                       f"eager: max rel diff {r['max_rel_grad_diff_vs_eager']:.1e}")
        left = [k for k in left if k not in done]
        if left:  # the first kind left failed
            lc.log(f"  {GRAPH_NAMES[left[0]]}: FAILED (rc {proc.returncode})\n" + proc.stderr[-3000:])
            left = left[1:]
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip", default="", help="comma list: errors,compile,torchao,te,graph,fastacc")
    ap.add_argument("--profile", action="store_true", help="also a one-step kernel timeline of the COAT layer")
    ap.add_argument("--graph-child", default="")
    ap.add_argument("--shape", default="")
    args = ap.parse_args()
    if args.graph_child:
        return graph_child(args.graph_child.split(","), tuple(int(v) for v in args.shape.split(",")), args.iters)
    skip = set(args.skip.split(","))
    torch.backends.cuda.matmul.allow_tf32 = False
    shape = (2, 256, 1024, 2816, 8) if args.quick else (4, 2048, 4096, 11008, 32)
    bsz, seq, h, ffn, heads = shape
    lc.log(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  shape {shape}  "
           f"skip={sorted(skip - {''})}")
    ref32, layer = lc.make_layers("cuda", bsz, seq, h, ffn, heads)
    x = torch.randn(bsz, seq, h, device="cuda").to(torch.bfloat16).requires_grad_()
    coat = lc.coat_layer(layer)
    results = {"device": torch.cuda.get_device_name(), "shape": list(shape)}
    if "errors" not in skip:  # outside the flash-only context: the fp32 reference needs another SDPA backend
        results["errors_vs_fp32"] = {
            "BF16 eager": lc.layer_errors(ref32, layer, x), "COAT": lc.layer_errors(ref32, coat, x),
            "COAT torch references": lc.layer_errors(ref32, lc.coat_layer(layer, ActivationConfig(backend="torch")),
                                                     x)}
        lc.log("Relative L2 error vs the fp32 layer: " + json.dumps(results["errors_vs_fp32"]))
    del ref32
    rows = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        results["coat_saved_by_dtype_MiB"] = lc.saved_by_dtype(coat, x)
        lc.log(f"COAT saved for backward by dtype (MiB, parameters included): {results['coat_saved_by_dtype_MiB']}")
        variants = [("COAT (weights quantized every step)", coat),
                    ("COAT + warm weight cache (micro-batch >= 2)", lc.coat_layer(layer, warm_cache=True))]
        if "fastacc" not in skip:
            variants.append(("COAT, fast-accumulation forward GEMMs",
                             lc.coat_layer(layer, ActivationConfig(fprop_fast_accum=True, cache_weights=False))))
        variants.append(("BF16 eager", layer))
        lc.run_variants(variants, x, args.iters, rows)
        if args.profile:
            from profile_step import profile_step

            results["coat_timeline"] = profile_step(coat, x, os.path.join(lc.OUT, "coat_timeline.json"))
    if "graph" not in skip:
        rows += graphed_rows(shape, args.iters)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        later = []
        if "te" not in skip:
            te_rows, why = lc.te_variants(layer)
            if why:
                lc.log(f"TransformerEngine: skipped ({why})")
            later += te_rows
        if "compile" not in skip:
            later.append(("BF16 torch.compile", torch.compile(layer)))
        if "torchao" not in skip:
            try:
                later.append(lc.torchao_variant(layer))
            except Exception as exc:
                lc.log(f"torchao: skipped ({type(exc).__name__}: {exc})")
        lc.run_variants(later, x, args.iters, rows)
    results["layer"] = rows
    lc.save_json(results, "bench_llama_layer.json")
    lc.chart(rows, os.path.join(lc.OUT, "llama_layer.png"),
             f"Llama-2-7B decoder layer, batch {bsz} x seq {seq}, {torch.cuda.get_device_name()}")
    lc.log("\n| variant | fwd+bwd ms (median) | min | back to back | host ahead | saved MiB |\n"
           "|---|---|---|---|---|---|")
    for r in rows:
        mib = "n/a" if math.isnan(r["saved_mib"]) else f"{r['saved_mib']:.0f}"
        lc.log(f"| {r['variant']} | {r['ms']:.2f} | {r['ms_min']:.2f} | {r.get('ms_steady', math.nan):.2f} | "
               f"{r.get('ms_host_ahead', math.nan):.2f} | {mib} |")


if __name__ == "__main__":
    t0 = time.time()
    main()
    lc.log(f"[{time.time() - t0:.0f} s]")
