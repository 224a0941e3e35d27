"""Host cost of one CoatFP8Muon step on a 12-layer Llama: milliseconds per step, aten operations per step, the
operations that synchronize the host with a GPU, and the Python calls behind them.

The model is launch.main's Llama at a tiny width (the step's host work depends on the number of matrices, not on
their size), gradients are random, and the optimizer is CoatFP8Muon over `muon_param_groups(model)`. Per step:
- host ms (median over --steps timed steps after two warm-up steps; on CUDA each step is synchronized after it);
- aten operations from torch.profiler, and those that synchronize on a GPU: aten::nonzero (boolean indexing),
  aten::_local_scalar_dense (.item(), bool(), float() of a tensor), aten::masked_select, and copies from the host to
  the device (`aten::copy_` whose source is on the CPU while the step runs on CUDA);
- Python calls of the optimizer's own code (cProfile), the layout-to-kernel-rows conversions among them.
On CUDA the synchronizations are also counted by torch.cuda.set_sync_debug_mode("warn").

    python benchmarks/muon_step_host.py                      # CPU, backend auto (reference Muon, C++ AdamW)
    python benchmarks/muon_step_host.py --backend torch      # CPU, torch reference everywhere
    python benchmarks/muon_step_host.py --device cuda --hidden 1024 --ffn 2816   # launch.main's parity size
    python benchmarks/muon_step_host.py --state-dtype fp32   # the fp32-state arm, for comparison
    python benchmarks/muon_step_host.py --ns-steps 0         # without Newton-Schulz (slow in bf16 on some CPUs)
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
import warnings
from collections import Counter
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # launch.main
from coat_kernels.optim import CoatFP8Muon, muon_param_groups  # noqa: E402

SYNC_OPS = ("aten::nonzero", "aten::_local_scalar_dense", "aten::masked_select", "aten::item")


def build(args):
    from launch.main import build_model

    shape = SimpleNamespace(hidden=args.hidden, ffn=args.ffn, layers=args.layers, heads=4, kv_heads=2, seq=64,
                            seed=0)
    model = build_model(shape, vocab=256).to(args.device)
    options = {} if args.state_dtype != "fp8" else dict(backend=args.backend)
    optimizer = CoatFP8Muon(muon_param_groups(model, lr=0.02, ns_steps=args.ns_steps), state_dtype=args.state_dtype,
                            **options)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(args.device)
    return model, optimizer


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def host_ms(optimizer, device, steps: int) -> float:
    for _ in range(2):
        optimizer.step()
    synchronize(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
        synchronize(device)
    return 1e3 * statistics.median(times)


def op_counts(optimizer, device) -> Counter:
    activities = [ProfilerActivity.CPU]
    with profile(activities=activities, record_shapes=False) as prof:
        optimizer.step()
    counts = Counter()
    for event in prof.events():
        counts[event.name] += 1
    return counts


def host_to_device_copies(optimizer, device) -> int:
    """Copies of CPU tensors to `device` during a step (each a blocking copy from pageable memory)."""
    if torch.device(device).type != "cuda":
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            optimizer.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def python_calls(optimizer) -> list[tuple[str, int]]:
    profiler = cProfile.Profile()
    profiler.enable()
    optimizer.step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = [(f"{file.split('kernels/')[-1]}:{name}", calls) for (file, _, name), (calls, *_) in stats.items()
            if "kernels/optim" in file]
    return sorted(rows, key=lambda r: -r[1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "triton", "cpu"))
    ap.add_argument("--state-dtype", default="fp8", choices=("fp8", "fp32", "bf16"))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=176)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ns-steps", type=int, default=5, help="Newton-Schulz iterations (0: the step without them)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, optimizer = build(args)
    matrices = sum(len(g["params"]) for g in optimizer.param_groups if g["use_muon"])
    others = sum(len(g["params"]) for g in optimizer.param_groups if not g["use_muon"])
    ms = host_ms(optimizer, args.device, args.steps)
    counts = op_counts(optimizer, args.device)
    aten = sum(c for name, c in counts.items() if name.startswith("aten::"))
    syncs = {name: counts[name] for name in SYNC_OPS if counts[name]}
    print(f"device {args.device}, backend {args.backend}, state {args.state_dtype}: {matrices} Muon matrices, "
          f"{others} AdamW tensors")
    print(f"host ms per step: {ms:.2f}")
    print(f"aten ops per step: {aten} ({aten / matrices:.1f} per Muon matrix); sync-prone: {syncs or 'none'}")
    if torch.device(args.device).type == "cuda":
        print(f"synchronizing calls per step (sync debug mode): {host_to_device_copies(optimizer, args.device)}")
    top = ", ".join(f"{name} {n}" for name, n in counts.most_common(12))
    print(f"most frequent ops: {top}")
    print("optimizer Python calls per step (most frequent):")
    for name, calls in python_calls(optimizer)[:15]:
        print(f"  {calls:6d}  {name}")


if __name__ == "__main__":
    main()
