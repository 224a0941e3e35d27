"""Where a profiled training step's GPU time goes, from a torch-profiler chrome trace (as Megatron's `--profile
--use-pytorch-profiler` writes it: `<tensorboard-dir>/../torch_profile/rank-0.json.gz`): per step, the span from the
first to the last kernel, the busy time (union of kernel intervals), the idle time (the GPU waiting, mostly on the
host), time per kernel category and the largest kernels; where NCCL kernels ran, each collective's duration (minimum,
median, maximum: a median far above the minimum is time spent waiting for the other ranks, not moving bytes) and the
part of them no compute kernel overlaps.

--host (one profiled training step, as `launch/train_ds.py --profile-step` writes it): where the host's time goes.
The step in three phases (forward: until the autograd engine runs its first node; backward: until its last; after
backward: the optimizer step and whatever the training loop does after it), the largest top-level host ops of each,
and the time inside autograd Functions written in Python (names matching --functions) split into what they call:
Triton launches (cuLaunchKernelEx), torch._scaled_mm, allocations, other torch ops and CUDA runtime calls, and the
rest, which is Python (the Function's own code and Triton's launch binder).

    python benchmarks/trace_summary.py TRACE [TRACE ...] [--steps N] [--top K] [--host] [--functions REGEX]
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics


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


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def kernels(path: str) -> list[tuple[float, float, str]]:
    out = [(e["ts"], e["ts"] + e.get("dur", 0.0), e["name"]) for e in load(path)
           if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e]
    return sorted(out)


def union(intervals) -> list[list[float]]:
    """The intervals merged where they overlap or touch, sorted."""
    out = []
    for start, stop in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return out


def covered(merged: list[list[float]]) -> float:
    return sum(stop - start for start, stop in merged)


def overlap(a: list[list[float]], b: list[list[float]]) -> float:
    """Time covered by both of two sorted, disjoint interval lists."""
    i = j = 0
    both = 0.0
    while i < len(a) and j < len(b):
        both += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both


def collectives(ks, steps: int) -> list[str]:
    """Lines on the NCCL kernels: their time per step, the part no compute kernel overlaps, and each collective's
    count per step and minimum / median / maximum duration."""
    comm = [(s, t, n) for s, t, n in ks if category(n) == "communication"]
    if not comm:
        return []
    per_name = collections.defaultdict(list)
    for s, t, n in comm:
        per_name[n.split("(")[0]].append(t - s)
    comm_u = union((s, t) for s, t, _ in comm)
    compute_u = union((s, t) for s, t, n in ks if category(n) != "communication")
    total = covered(comm_u)
    hidden = overlap(comm_u, compute_u)
    lines = [f"  collectives: {total / 1e3 / steps:.2f} ms per step, {(total - hidden) / 1e3 / steps:.2f} ms of it "
             "with no compute kernel running beside it"]
    for name, d in sorted(per_name.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"    {name[:60]:60s} {len(d) / steps:6.1f} per step, us min {min(d):8.1f} median "
                     f"{statistics.median(d):8.1f} max {max(d):8.1f}")
    return lines


def summary(path: str, steps: int, top: int) -> str:
    ks = kernels(path)
    if not ks:
        return f"{path}: no GPU kernels in the trace"
    span = max(stop for _, stop, _ in ks) - ks[0][0]
    busy = covered(union((start, stop) for start, stop, _ in ks))
    per_cat, per_name = collections.Counter(), collections.Counter()
    for start, stop, name in ks:
        per_cat[category(name)] += stop - start
        per_name[name] += stop - start
    ms = 1e-3 / steps
    lines = [f"{path}: {len(ks)} kernels over {steps} step(s); per step: span {span * ms:.1f} ms, GPU busy "
             f"{busy * ms:.1f} ms, idle {(span - busy) * ms:.1f} ms ({100 * (span - busy) / span:.0f}%)"]
    lines += [f"  {cat:40s} {t * ms:8.2f} ms" for cat, t in per_cat.most_common()]
    lines += [f"    {t * ms:8.2f} ms  {name[:110]}" for name, t in per_name.most_common(top)]
    lines += collectives(ks, steps)
    return "\n".join(lines)


def top_level(events: list[dict]) -> list[dict]:
    """The events not nested in another one of the list (one thread's)."""
    out, end = [], float("-inf")
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def piece(name: str) -> str:
    if name == "cuLaunchKernelEx":
        return "Triton launches (driver call)"
    if name == "aten::_scaled_mm":
        return "torch._scaled_mm"
    if name in ("aten::empty", "aten::empty_strided"):
        return "allocations"
    return "other torch ops, CUDA runtime calls"


def host_summary(path: str, top: int, functions: str) -> str:
    """One profiled step's host time: phases, top-level ops per phase, and the autograd Functions' insides."""
    events = [e for e in load(path) if "dur" in e and e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime",
                                                                      "cuda_driver")]
    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    engine = [e for e in ops if e["name"].startswith("autograd::engine::evaluate_function")]
    if not engine:
        return f"{path}: no backward (autograd engine) events in the trace"
    # The backward runs from the autograd engine's first node to its last; on a GPU in the engine's own thread,
    # on a CPU in the thread that called backward.
    b0, b1 = min(e["ts"] for e in engine), max(e["ts"] + e["dur"] for e in engine)
    t0, t1 = min(e["ts"] for e in ops), max(e["ts"] + e["dur"] for e in ops)
    phases = (("forward", lambda e: e["ts"] < b0, b0 - t0), ("backward", lambda e: b0 <= e["ts"] < b1, b1 - b0),
              ("after backward", lambda e: e["ts"] >= b1, t1 - b1))
    lines = [f"{path}: host span {(t1 - t0) / 1e3:.1f} ms"]
    for name, inside, span in phases:
        tops = [e for tid in {e["tid"] for e in ops}
                for e in top_level([e for e in ops if e["tid"] == tid and inside(e)])]
        per, count = collections.Counter(), collections.Counter()
        for e in tops:
            per[e["name"]] += e["dur"]
            count[e["name"]] += 1
        lines.append(f"  {name}: {span / 1e3:.1f} ms, {len(tops)} top-level ops taking "
                     f"{sum(per.values()) / 1e3:.1f} ms")
        lines += [f"    {t / 1e3:8.2f} ms {count[n]:6d}x  {n[:90]}" for n, t in per.most_common(top)]
    pattern = re.compile(functions)
    fns = [e for e in ops if e.get("cat") == "cpu_op" and pattern.search(e["name"])]
    if fns:
        by_thread = collections.defaultdict(list)
        for e in events:
            by_thread[e["tid"]].append(e)
        split, calls = collections.Counter(), collections.Counter()
        for f in fns:
            inside = [e for e in by_thread[f["tid"]] if f["ts"] <= e["ts"] < f["ts"] + f["dur"] and e is not f]
            direct = top_level(inside)
            for e in direct:
                split[piece(e["name"])] += e["dur"]
                calls[piece(e["name"])] += 1
            split["Python (the Functions' code, Triton's binder)"] += f["dur"] - sum(e["dur"] for e in direct)
        total = sum(split.values())
        lines.append(f"  inside {len(fns)} autograd Function calls matching {functions!r}: {total / 1e3:.1f} ms")
        lines += [f"    {t / 1e3:8.2f} ms {calls[n]:6d}x  {n}" for n, t in split.most_common()]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--steps", type=int, default=1, help="profiled steps in each trace")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--host", action="store_true", help="the host's time in one profiled training step")
    ap.add_argument("--functions", default=r"^_[A-Z]\w*$",
                    help="regex naming the autograd Functions whose insides --host splits (default: Python "
                         "Function classes named _CamelCase, as coat_kernels' are)")
    args = ap.parse_args()
    for path in args.traces:
        print(host_summary(path, args.top, args.functions) if args.host else summary(path, args.steps, args.top))


if __name__ == "__main__":
    main()
