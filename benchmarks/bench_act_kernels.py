"""Bandwidth of the FP8 activation kernels at the Llama-2-7B layer's shapes (8192 tokens, H 4096, FFN 11008) against
a device copy, three ways: triton's do_bench (L2 flushed by a 256 MB zero-fill before each call, so each call also
pays the write-back of dirty lines), CUDA events after a clean-L2 read, and steady state (one CUDA graph of
back-to-back calls over rotating input sets larger than L2, as in a training step). Bytes = each input read once and
each output written once.

    python benchmarks/bench_act_kernels.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from layer_common import log, save_json  # noqa: E402

from coat_kernels.act import group_quant as GQ  # noqa: E402
from coat_kernels.act import norm as N  # noqa: E402
from coat_kernels.act import pointwise as P  # noqa: E402
from coat_kernels.act import rope as R  # noqa: E402
from coat_kernels.act import swiglu as S  # noqa: E402
from coat_kernels.act import tensor_quant as TQ  # noqa: E402
from coat_kernels.act.scaling import ScaleTickets, finalize_scale  # noqa: E402
from coat_kernels.formats import E4M3, E5M2  # noqa: E402

TICKETS = ScaleTickets()


class Inputs:
    """One set of kernel inputs and what the kernels under test read (FP8 copies, scales, statistics)."""

    def __init__(self, m, h, f, seq, hd):
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        self.x, self.res = torch.randn(m, h, **bf16), torch.randn(m, h, **bf16)
        self.gu, self.dp, self.qkv = torch.randn(m, 2 * f, **bf16), torch.randn(m, f, **bf16), torch.randn(m, 3 * h,
                                                                                                          **bf16)
        self.cos, self.sin = R.rope_tables(seq, hd, device="cuda")
        self.w = 1 + 0.1 * torch.randn(h, **bf16)
        self.hd, self.kv = hd, h // hd
        self.s = TQ.tensor_scale(self.x, E4M3, True)
        self.q8, self.e8 = GQ.group_quantize(self.x, E4M3, True)
        _, self.q, self.e, self.mean, self.rstd, _ = N.norm_forward(self.x, self.w, None, True, residual=self.res)
        self.gq, self.ge, amax, _ = S.swiglu_forward(self.gu, True)
        self.gs = finalize_scale(amax, E4M3, True)


def cases(n, n2, nqkv):
    """(name, fn(inputs), bytes moved)."""
    t = dict(tickets=TICKETS)
    return [
        ("group_quantize e4m3", lambda i: GQ.group_quantize(i.x, E4M3, True), n * (2 + 1 + 1 / 8)),
        ("group_quantize e5m2 +partials", lambda i: GQ.group_quantize(i.x, E5M2, True, partial_amax=True),
         n * (2 + 1 + 1 / 8)),
        ("group_dequantize", lambda i: GQ.group_dequantize(i.q8, i.e8, True), n * (1 + 1 / 8 + 2)),
        ("amax + scale", lambda i: TQ.amax_partials(i.x, True, E4M3, TICKETS), n * 2),
        ("torch x.amax() (a read-only reference)", lambda i: i.x.amax(), n * 2),
        ("cast e4m3 row", lambda i: TQ.cast(i.x, i.s, E4M3, True), n * 3),
        ("cast e5m2 row+T", lambda i: TQ.cast(i.x, i.s, E5M2, True, write_t=True), n * 4),
        ("cast e4m3 T", lambda i: TQ.cast(i.x, i.s, E4M3, True, write_row=False, write_t=True), n * 3),
        ("norm_forward+residual", lambda i: N.norm_forward(i.x, i.w, None, True, residual=i.res, **t),
         n * (2 + 2 + 2 + 1 + 1 / 8)),
        ("norm_cast row", lambda i: N.norm_cast(i.q, i.e, i.mean, i.rstd, i.w, None, i.s, True), n * (2 + 1 / 8)),
        ("norm_cast T", lambda i: N.norm_cast(i.q, i.e, i.mean, i.rstd, i.w, None, i.s, True, write_row=False,
                                              write_t=True), n * (2 + 1 / 8)),
        ("norm_backward(+dres)", lambda i: N.norm_backward(i.q, i.e, i.mean, i.rstd, i.w, i.res, True, dres=i.x,
                                                           partial_amax=True, **t), n * (1 + 1 / 8 + 2 + 2 + 2)),
        ("swiglu_forward", lambda i: S.swiglu_forward(i.gu, True, **t), n2 * (2 + 1 + 1 / 8)),
        ("swiglu_cast row", lambda i: S.swiglu_cast(i.gq, i.ge, i.gs, True), n2 * (1 + 1 / 8) + n2 // 2),
        ("swiglu_cast T", lambda i: S.swiglu_cast(i.gq, i.ge, i.gs, True, write_row=False, write_t=True),
         n2 * (1 + 1 / 8) + n2 // 2),
        ("swiglu_backward (bf16 out)", lambda i: S.swiglu_backward(i.gq, i.ge, i.dp, True, **t),
         n2 * (1 + 1 / 8 + 1 + 2)),
        ("swiglu_backward_amax", lambda i: S.swiglu_backward_amax(i.gq, i.ge, i.dp, True, **t),
         n2 * (1 + 1 / 8 + 1)),
        ("swiglu_backward_amax + product T", lambda i: S.swiglu_backward_amax(i.gq, i.ge, i.dp, True,
                                                                               product_scale=i.gs, **t),
         n2 * (1 + 1 / 8 + 1) + n2 // 2),
        ("swiglu_backward_cast row+T", lambda i: S.swiglu_backward_cast(i.gq, i.ge, i.dp, i.gs, True),
         n2 * (1 + 1 / 8 + 1 + 2)),
        ("rope_split fwd", lambda i: R.rope_split(i.qkv, i.cos, i.sin, i.hd, i.kv, True), nqkv * 4),
        ("gelu fwd", lambda i: P.act_forward(i.x, "gelu", True), n * (2 + 1 + 1 / 8 + 2)),
    ]


def make_timers():
    """(do_bench, clean-L2) median-ms timers."""
    from triton.testing import do_bench

    flush = torch.empty(2**26, dtype=torch.float32, device="cuda").fill_(1.0)

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


def steady(fn, sets, graph_reps=2, replays=5):
    """Median ms per call over back-to-back calls on rotating input sets, in one CUDA graph."""
    for i in sets:
        fn(i)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
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
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    m, h, f, seq, hd = (1024, 1024, 2816, 512, 128) if args.quick else (8192, 4096, 11008, 2048, 128)
    sets = [Inputs(m, h, f, seq, hd) for _ in range(4)]
    dirty, clean = make_timers()

    def copy_rates(nbytes):
        pairs = [(torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16),
                  torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)) for _ in range(4)]
        src, dst = pairs[0]
        rates = [2 * nbytes / t(lambda: dst.copy_(src)) / 1e6 for t in (dirty, clean)]
        return rates + [2 * nbytes / steady(lambda pr: pr[1].copy_(pr[0]), pairs) / 1e6]

    copy = copy_rates(min(2**29, 8 * m * h))
    log(f"{torch.cuda.get_device_name()}: device copy (512 MiB) {copy[0]:.0f} / {copy[1]:.0f} / {copy[2]:.0f} GB/s "
        "(do_bench / clean L2 / steady)", name="bench_act_kernels.log")
    rows = []
    for name, fn, nbytes in cases(m * h, m * 2 * f, m * 3 * h):
        ms = (dirty(lambda: fn(sets[0])), clean(lambda: fn(sets[0])), steady(fn, sets))
        pct = [100 * nbytes / t / 1e6 / c for t, c in zip(ms, copy)]
        rows.append({"kernel": name, "us": [round(t * 1e3, 1) for t in ms], "pct_copy": [round(p, 1) for p in pct]})
        log(f"  {name:40s} " + "  ".join(f"{t * 1e3:7.1f} us {p:5.1f}%" for t, p in zip(ms, pct)),
            name="bench_act_kernels.log")
    save_json({"device": torch.cuda.get_device_name(), "copy_GBs": copy, "kernels": rows}, "bench_act_kernels.json")


if __name__ == "__main__":
    main()
