"""One optimizer step on ~1e9 fp32 parameters (60 x 4096 x 4096, fp32 grads): CoatFP8AdamW vs
torch.optim.AdamW(fused=True) vs AdamW with bf16 moments (launch/bf16_moment_adamw.py, compiled) vs torchao AdamWFp8
and FlashOptim's FlashAdamW (when importable; FlashOptim on bf16 copies of the parameters with bf16 gradients and
24-bit masters, its recipe). Prints ms/step, achieved GB/s (the bytes each must move once) and state bytes/param.
`--family lion`: CoatFP8Lion with its momentum in fp32, bf16 and FP8. `--family muon`: torch.optim.Muon against
CoatFP8Muon with fp32, bf16 and FP8 momentum, each also with `ns_steps=0` (the step without Newton-Schulz: what the
momentum's storage costs on its own).
Usage: python benchmarks/bench_optimizer.py [--tensors 60] [--family adamw|lion|muon]
"""
import argparse
import gc
import os
import sys

import torch

from coat_kernels.optim import CoatFP8AdamW, CoatFP8Lion, CoatFP8Muon

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root: `launch`
from launch.bf16_moment_adamw import BF16MomentAdamW  # noqa: E402
from launch.optimizer_arms import value_bytes  # noqa: E402


def state_bytes(opt):
    return sum(value_bytes(t) for s in opt.state.values() for t in s.values())


def bench(name, make_opt, params, bytes_per_param, steps=20, warmup=3):
    opt = make_opt(params)
    for _ in range(warmup):
        opt.step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(steps):
        start.record()
        opt.step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    start.record()  # back to back: the host's work per step overlaps the previous step's kernels
    for _ in range(steps):
        opt.step()
    end.record()
    end.synchronize()
    ms_b2b = start.elapsed_time(end) / steps
    n = sum(p.numel() for p in params)
    row = (name, ms, ms_b2b, bytes_per_param * n / ms_b2b / 1e6, state_bytes(opt) / n)
    del opt
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=60)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--sweep", action="store_true", help="also time other groups-per-program / warps settings")
    ap.add_argument("--family", choices=("adamw", "lion", "muon"), default="adamw")
    args = ap.parse_args()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(args.dim, args.dim, device="cuda") * 0.02) for _ in range(args.tensors)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    x = torch.empty(n // 4, device="cuda")
    y = torch.empty_like(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        y.copy_(x)
    start.record(); [y.copy_(x) for _ in range(10)]; end.record(); end.synchronize()
    copy_gbs = 2 * x.numel() * 4 * 10 / start.elapsed_time(end) / 1e6
    del x, y
    print(f"device: {torch.cuda.get_device_name()}, params: {n / 1e9:.3f}e9, copy bandwidth {copy_gbs:.0f} GB/s")
    if args.family != "adamw":
        print_rows(momentum_rows(args.family, params))
        return
    rows = [bench("torch AdamW fused=True", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), params, 28)]
    rows.append(bench("CoatFP8AdamW (Triton)", lambda ps: CoatFP8AdamW(ps, lr=1e-4), params, 16))
    if args.sweep:
        from coat_kernels.optim import dre_triton
        knobs = ("GROUPS_PER_PROGRAM", "NUM_WARPS", "THREADS_PER_GROUP", "MAX_REGISTERS")
        default = tuple(getattr(dre_triton, k) for k in knobs)
        for setting in ((4, 2, 16, None), (4, 2, 16, 80), (8, 4, 16, 64), (8, 2, 8, 64)):
            for k, v in zip(knobs, setting):
                setattr(dre_triton, k, v)
            rows.append(bench("  Coat groups/warps/threads per group/regs={}/{}/{}/{}".format(*setting),
                              lambda ps: CoatFP8AdamW(ps, lr=1e-4), params, 16))
        for k, v in zip(knobs, default):
            setattr(dre_triton, k, v)
        entry = dre_triton.fused_adamw_kernel
        dre_triton.fused_adamw_kernel = lambda: dre_triton._fused_adamw_kernel
        rows.append(bench("  Coat, Triton kernel (not Gluon)", lambda ps: CoatFP8AdamW(ps, lr=1e-4), params, 16))
        dre_triton.fused_adamw_kernel = entry
        rows.append(bench("  Coat no expansion", lambda ps: CoatFP8AdamW(ps, lr=1e-4, expand_exp_avg=False,
                                                                      expand_exp_avg_sq=False), params, 16))
    # read and write p (4 + 4) and the moments (4 + 4), read the gradient (4): 20 B/param
    rows.append(bench("AdamW, bf16 moments (compiled per tensor)",
                      lambda ps: BF16MomentAdamW(ps, lr=1e-4, compile_step=True), params, 20))
    try:
        from torchao.optim import AdamWFp8
        rows.append(bench("torchao AdamWFp8", lambda ps: AdamWFp8(ps, lr=1e-4), params, 16))
    except Exception as e:  # noqa: BLE001 - report any import/runtime failure of the baseline
        print(f"torchao AdamWFp8: skipped ({type(e).__name__}: {e})")
    try:
        from flashoptim import FlashAdamW
        bf16_params = [torch.nn.Parameter(p.detach().bfloat16()) for p in params]
        for p, q in zip(bf16_params, params):
            p.grad = q.grad.bfloat16()
        del params
        gc.collect()
        # read and write p (2), error bits (1), moments (2 x 1.0625), read the gradient (2): 12.25 B/param
        rows.append(bench("FlashOptim FlashAdamW (bf16 params, 24-bit masters)",
                          lambda ps: FlashAdamW(ps, lr=1e-4, master_weight_bits=24), bf16_params, 12.25))
    except Exception as e:  # noqa: BLE001 - report any import/runtime failure of the baseline
        print(f"FlashOptim FlashAdamW: skipped ({type(e).__name__}: {e})")
    print_rows(rows)


def momentum_rows(family, params):
    """Lion or Muon: the fp32-momentum step first (the ratios' base), then bf16 and FP8 momentum. Bytes per parameter
    moved by the elementwise part: read and write p (8), read the gradient (4), read and write the momentum."""
    rows = []
    for state_dtype, momentum_bytes in (("fp32", 8), ("bf16", 4), ("fp8", 2.19)):
        if family == "lion":
            rows.append(bench(f"CoatFP8Lion, {state_dtype} momentum",
                              lambda ps, d=state_dtype: CoatFP8Lion(ps, lr=1e-5, weight_decay=1.0, state_dtype=d),
                              params, 12 + momentum_bytes))
            continue
        if state_dtype == "fp32":
            for ns_steps in (5, 0):
                rows.append(bench(f"torch.optim.Muon, ns_steps={ns_steps}",
                                  lambda ps, k=ns_steps: torch.optim.Muon(ps, lr=1e-3, ns_steps=k),
                                  params, 12 + momentum_bytes))
        for ns_steps in (5, 0):
            rows.append(bench(f"CoatFP8Muon, {state_dtype} momentum, ns_steps={ns_steps}",
                              lambda ps, d=state_dtype, k=ns_steps: CoatFP8Muon(ps, lr=1e-3, ns_steps=k, state_dtype=d),
                              params, 12 + momentum_bytes))
    return rows


def print_rows(rows):
    base, base_b2b = rows[0][1], rows[0][2]
    print("ms/step: median of single steps (synchronised each); b2b: mean of back-to-back steps; GB/s from b2b")
    print(f"{'optimizer':<48} {'ms/step':>8} {'x first':>8} {'b2b ms':>8} {'x first':>8} {'GB/s':>7} "
          f"{'state B/param':>14}")
    for name, ms, ms_b2b, gbs, bpp in rows:
        print(f"{name:<48} {ms:8.2f} {ms / base:8.2f} {ms_b2b:8.2f} {ms_b2b / base_b2b:8.2f} {gbs:7.0f} {bpp:14.3f}")


if __name__ == "__main__":
    main()
