"""Where a profiled training step's GPU time goes, from a torch-profiler chrome trace (as Megatron's `--profile
--use-pytorch-profiler` writes it: `<tensorboard-dir>/../torch_profile/rank-0.json.gz`): per step, the span from the
first to the last kernel, the busy time (union of kernel intervals), the idle time (the GPU waiting, mostly on the
host), time per kernel category and the largest kernels.

    python benchmarks/trace_summary.py TRACE [TRACE ...] [--steps N] [--top K]
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json


def category(name: str) -> str:
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n or "sdpa" in n:
        return "attention"
    if "nvjet" in n or "gemm" in n or "cutlass" in n or "xmma" in n or "scaled_mm" in n or "sm90" in n:
        return "GEMM"
    if "multi_tensor" in n or "adam" in n or "_fused_adamw" in n:
        return "optimizer"
    if "nccl" in n:
        return "communication"
    if name.startswith("_") and "kernel" in n:
        return "Triton (COAT)"
    if "memset" in n or "memcpy" in n:
        return "memset/memcpy"
    return "other elementwise/reduce (torch, TE)"


def kernels(path: str) -> list[tuple[float, float, str]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    out = [(e["ts"], e["ts"] + e.get("dur", 0.0), e["name"]) for e in events
           if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e]
    return sorted(out)


def summary(path: str, steps: int, top: int) -> str:
    ks = kernels(path)
    if not ks:
        return f"{path}: no GPU kernels in the trace"
    span = ks[-1][1] - ks[0][0]
    busy, end = 0.0, ks[0][0]
    for start, stop, _ in ks:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    per_cat, per_name = collections.Counter(), collections.Counter()
    for start, stop, name in ks:
        per_cat[category(name)] += stop - start
        per_name[name] += stop - start
    ms = 1e-3 / steps
    lines = [f"{path}: {len(ks)} kernels over {steps} step(s); per step: span {span * ms:.1f} ms, GPU busy "
             f"{busy * ms:.1f} ms, idle {(span - busy) * ms:.1f} ms ({100 * (span - busy) / span:.0f}%)"]
    lines += [f"  {cat:40s} {t * ms:8.2f} ms" for cat, t in per_cat.most_common()]
    lines += [f"    {t * ms:8.2f} ms  {name[:110]}" for name, t in per_name.most_common(top)]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--steps", type=int, default=1, help="profiled steps in each trace")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    for path in args.traces:
        print(summary(path, args.steps, args.top))


if __name__ == "__main__":
    main()
