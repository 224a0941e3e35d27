"""Host (CPU) time of the COAT Llama-2-7B layer (bench_llama_layer's shape) on the GPU machine.

A layer step is GPU-bound once the host is ahead, but at the start of a step the GPU waits for the host to launch the
first short kernels, so host time there is step time. This script measures, with the GPU held busy by a long
`torch.cuda._sleep` (so the host never waits on it):
- host ms per forward / backward;
- when each launch (Triton kernel, FP8 GEMM, flash attention) leaves the host in one step, relative to its start;
- per-call host costs of the pieces (torch.empty, a Triton launch, torch._scaled_mm, an empty autograd Function),
  and of the same Triton kernel launched without `JITFunction.run`: through the compiled kernel's launcher with the
  specialisation looked up once (what a launcher bound per call site and shape would cost at the least).

    python benchmarks/host_overhead.py
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layer_common as lc  # noqa: E402

from coat_hf import decoder  # noqa: E402
from coat_hf.families import llama  # noqa: E402
from coat_kernels.act import block_bodies, block_parts, functional, fused_mlp, gemm, norm, rope, rope_kernel, scaling, swiglu  # noqa: E402,E501
from coat_kernels.act import tensor_quant as TQ  # noqa: E402

BUSY_CYCLES = 400_000_000  # ~0.2 s of GPU sleep: longer than any host work measured here


@contextmanager
def launch_marks(marks):
    """Append (perf_counter, name) after every Triton launch, FP8 GEMM and SDPA call."""
    from triton.runtime.jit import JITFunction

    orig_launch, orig_gemm, orig_sdpa = JITFunction.run, gemm.fp8_gemm, torch.nn.functional.scaled_dot_product_attention

    def launch(self, *args, **kwargs):
        r = orig_launch(self, *args, **kwargs)
        marks.append((time.perf_counter(), self.fn.__name__))
        return r

    def gemm_marked(*a, **k):
        r = orig_gemm(*a, **k)
        marks.append((time.perf_counter(), "fp8_gemm"))
        return r

    def sdpa(*a, **k):
        r = orig_sdpa(*a, **k)
        marks.append((time.perf_counter(), "sdpa"))
        return r

    gemm_users = (block_bodies,)
    JITFunction.run, torch.nn.functional.scaled_dot_product_attention = launch, sdpa
    for mod in gemm_users:
        mod.fp8_gemm = gemm_marked
    try:
        yield
    finally:
        JITFunction.run, torch.nn.functional.scaled_dot_product_attention = orig_launch, orig_sdpa
        for mod in gemm_users:
            mod.fp8_gemm = orig_gemm


def host_times(layer, x, dy, params, reps=8):
    """Median host ms of forward and backward with the GPU busy."""
    fwd, bwd = [], []
    for _ in range(reps):
        for p in params:
            p.grad = None
        x.grad = None
        torch.cuda._sleep(BUSY_CYCLES)
        t0 = time.perf_counter()
        out = layer(x)
        t1 = time.perf_counter()
        out.backward(dy)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return sorted(fwd)[reps // 2] * 1e3, sorted(bwd)[reps // 2] * 1e3


def traced_forward(layer, x, params):
    """Inclusive and self host time per function of one forward (GPU busy): every function of the coat_kernels
    modules and autograd Function.apply wrapped by a timer (~1 us each), plus the torch calls they make."""
    import collections
    import inspect

    stack, totals = [], collections.defaultdict(lambda: [0, 0.0, 0.0])  # name -> [calls, inclusive, self]

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            stack.append(0.0)
            try:
                return fn(*a, **k)
            finally:
                d = time.perf_counter() - t
                child = stack.pop()
                if stack:
                    stack[-1] += d
                e = totals[name]
                e[0] += 1
                e[1] += d
                e[2] += d - child
        return wrapper

    patched = []
    for mod in (TQ, scaling, norm, swiglu, rope, rope_kernel, gemm, block_parts, block_bodies, functional, fused_mlp,
                decoder, llama):
        for name, fn in list(vars(mod).items()):
            if inspect.isfunction(fn) and fn.__module__ == mod.__name__:
                patched.append((mod, name, fn))
                setattr(mod, name, timed(f"{mod.__name__.split('.')[-1]}.{name}", fn))
    for mod, name in ((torch, "empty"), (torch, "_scaled_mm"), (torch.nn.functional, "scaled_dot_product_attention")):
        fn = getattr(mod, name)
        patched.append((mod, name, fn))
        setattr(mod, name, timed(f"torch.{name}", fn))
    apply = torch.autograd.Function.__dict__["apply"]  # a classmethod: restored as one
    patched.append((torch.autograd.Function, "apply", apply))
    torch.autograd.Function.apply = classmethod(timed("Function.apply", apply.__func__))
    try:
        for p in params:
            p.grad = None
        x.grad = None
        torch.cuda._sleep(BUSY_CYCLES)
        t = time.perf_counter()
        out = timed("forward", layer)(x)
        total = time.perf_counter() - t
    finally:
        for mod, name, fn in patched:
            setattr(mod, name, fn)
    out.sum().backward()
    torch.cuda.synchronize()
    print(f"  traced forward: {total * 1e3:.2f} ms host; per function (calls, inclusive us, self us), by self time:")
    for name, (n, inc, own) in sorted(totals.items(), key=lambda kv: -kv[1][2])[:30]:
        print(f"    {name:42s} {n:4d} {inc * 1e6:9.1f} {own * 1e6:9.1f}")


def print_timeline(layer, x, dy, params):
    marks = []
    for p in params:
        p.grad = None
    x.grad = None
    torch.cuda._sleep(BUSY_CYCLES)
    with launch_marks(marks):
        t0 = time.perf_counter()
        out = layer(x)
        n_fwd = len(marks)
        out.backward(dy)
    torch.cuda.synchronize()
    prev = t0
    print("  launch left the host at (us since the step started, + since the previous launch):")
    for i, (t, name) in enumerate(marks):
        print(f"    {'fwd' if i < n_fwd else 'bwd'} {1e6 * (t - t0):8.1f}  +{1e6 * (t - prev):6.1f}  {name}")
        prev = t


def per_call_us(fn, n=1000):
    """Host us per call of fn in a tight loop behind a GPU sleep, after three calls that may compile, pick cuBLAS
    heuristics or allocate a workspace (and synchronise)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def bound_launches(jit_fn, grid, args, kwargs):
    """Two zero-argument launches of jit_fn[grid](*args, **kwargs) that skip JITFunction.run: (through the compiled
    kernel's CudaLauncher, through the C launch function itself), the kernel and stream looked up once."""
    kernel = jit_fn[grid](*args, **kwargs)  # JITFunction.run returns the compiled kernel it launched
    kernel._init_handles()
    stream = torch.cuda.current_stream().cuda_stream
    names = list(jit_fn.arg_names)
    values = [kwargs.get(n, args[i] if i < len(args) else None) for i, n in enumerate(names)]
    g = tuple(grid) + (1,) * (3 - len(grid))
    launcher = kernel.run

    def through_launcher():
        launcher(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *values)

    def through_c():
        launcher.launch(g[0], g[1], g[2], stream, kernel.function, launcher.launch_cooperative_grid,
                        launcher.launch_pdl, None, None, kernel.packed_metadata, None, None, None, *values)

    return through_launcher, through_c


def piece_costs(dev):
    a = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(12288, 4096, device=dev, dtype=torch.bfloat16)
    scale = TQ.tensor_scale(a, "e4m3", True)
    a8, w8 = TQ.cast(a, scale, "e4m3", True)[0], TQ.cast(w, scale, "e4m3", True)[0]

    class Noop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t

        @staticmethod
        def backward(ctx, g):
            return g

    leaf = torch.zeros(1, device=dev, requires_grad=True)
    q = torch.empty_like(a8)
    grid = (triton.cdiv(8192, TQ.CAST_BM), triton.cdiv(4096, TQ.CAST_BN))
    cast_args = (a, scale, q, None, 8192, 4096, 8192)
    cast_kw = dict(WRITE_ROW=True, WRITE_T=False, E5M2_OUT=False, BM=TQ.CAST_BM, BN=TQ.CAST_BN, num_warps=TQ.CAST_WARPS)
    tickets = scaling.ScaleTickets()
    via_launcher, via_c = bound_launches(TQ._cast_kernel, grid, cast_args, cast_kw)
    costs = {
        "torch.empty [8192,4096] fp8": lambda: torch.empty(8192, 4096, device=dev, dtype=torch.float8_e4m3fn),
        "cast (allocation + launch)": lambda: TQ.cast(a, scale, "e4m3", True),
        "torch._scaled_mm [8192,4096]x[4096,12288]": lambda: torch._scaled_mm(
            a8, w8.t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16),
        "empty autograd Function": lambda: Noop.apply(leaf),
        "cast kernel launch only": lambda: TQ._cast_kernel[grid](*cast_args, **cast_kw),
        "cast kernel, compiled kernel's launcher": via_launcher,
        "cast kernel, C launch function": via_c,
        "stage-2 ticket arguments": lambda: scaling.stage_two_args(scale.reshape(1), "e4m3", tickets),
    }
    return {k: per_call_us(f, n=200) for k, f in costs.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pieces", action="store_true", help="only the per-call costs of the pieces")
    args = p.parse_args()
    dev = "cuda"
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}")
    if args.pieces:
        for k, v in piece_costs(dev).items():
            print(f"  host us per call: {k:45s} {v:7.1f}")
        return
    _, layer = lc.make_layers(dev, 4, 2048, 4096, 11008, 32)
    coat = lc.coat_layer(layer)
    params = list(coat.parameters())
    x = torch.randn(4, 2048, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(3):
            coat(x).backward(dy)
        torch.cuda.synchronize()
        print("host ms (forward, backward), GPU busy: %.2f, %.2f" % host_times(coat, x, dy, params))
        print_timeline(coat, x, dy, params)
        traced_forward(coat, x, params)
        for k, v in piece_costs(dev).items():
            print(f"  host us per call: {k:45s} {v:7.1f}")


if __name__ == "__main__":
    main()
