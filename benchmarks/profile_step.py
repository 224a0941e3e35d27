"""A one-step kernel timeline of a layer's fwd+bwd (torch profiler, CUDA activities): busy time (union of kernel
intervals), idle time inside the step, the largest gaps with their neighbours, and time per kernel category and per
kernel. Used by bench_llama_layer.py --profile."""
from __future__ import annotations

import json

import torch

from layer_common import clear_grads, log
from trace_summary import category as _category


def profile_step(layer, x, path, steps=3):
    """Kernel timeline of single fwd+bwd steps: busy (union of kernel intervals), idle inside the step, the largest
    gaps (with their neighbours), time per kernel category and per kernel."""
    from torch.autograd import DeviceType

    dy = torch.randn_like(x)
    for _ in range(2):
        layer(x).backward(dy)
    per = []
    for i in range(steps):
        clear_grads(list(layer.parameters()), x)
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
