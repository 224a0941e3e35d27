"""One optimizer step on CPU tensors, ms per 1e8 parameters: CoatFP8AdamW (its C++ step), torch.optim.AdamW
(foreach), DeepSpeed's DeepSpeedCPUAdam (its C++ op, built by DeepSpeed's op builder), and CoatFP8AdamW's torch
reference step (on a smaller tensor, scaled), at 1 thread and at all cores, in one process. fp32 parameters and
gradients, 10 tensors; median of `--steps` steps after 2 warm-up steps. `--compare-source OLD.cpp` (repeatable) adds
CoatFP8AdamW with the library built from another version of cpu_adamw.cpp; `--rounds R` runs the arms R times in turn
(interleaved: machines shared with other work drift) and reports each arm's median over the rounds.

    python benchmarks/bench_cpu_step.py [--params 1e8] [--threads 1,all] [--compare-source old.cpp] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

from coat_kernels.optim import CoatFP8AdamW, cpu_step


def make_params(total, tensors, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(tensors):
        p = torch.nn.Parameter(torch.randn(total // tensors, generator=g) * 0.02)
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
        params.append(p)
    return params


def time_steps(opt, steps):
    for _ in range(2):
        opt.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def deepspeed_cpu_adam():
    """DeepSpeedCPUAdam's class, or the reason it is unavailable."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])  # builds (or loads) the op
        return DeepSpeedCPUAdam, None
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return None, f"{type(exc).__name__}: {str(exc)[:160]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--tensors", type=int, default=10)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", default="1,all")
    ap.add_argument("--reference-params", type=float, default=2e6, help="size for the slow torch reference step")
    ap.add_argument("--compare-source", action="append", default=[], help="another cpu_adamw.cpp to build and time")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-reference", action="store_true", help="skip the slow torch reference step")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    total = int(args.params)
    cores = os.cpu_count()
    ds_adam, ds_why = deepspeed_cpu_adam()
    print(f"CPU: {cores} cores, torch {torch.__version__}; {total / 1e6:.0f}M parameters in {args.tensors} tensors"
          + ("" if ds_adam else f"; DeepSpeedCPUAdam unavailable ({ds_why})"))
    others = {f"CoatFP8AdamW (C++ step, {os.path.basename(path)})": cpu_step.load(cpu_step.build(source=path))
              for path in args.compare_source}
    rows = []
    for spec in args.threads.split(","):
        threads = cores if spec == "all" else int(spec)
        torch.set_num_threads(threads)
        arms = [("CoatFP8AdamW (C++ step)", lambda ps: CoatFP8AdamW(ps, lr=1e-4), total, None)]
        arms += [(name, lambda ps: CoatFP8AdamW(ps, lr=1e-4), total, lib) for name, lib in others.items()]
        arms.append(("torch AdamW (foreach)", lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True), total, None))
        if ds_adam is not None:
            arms.append(("DeepSpeedCPUAdam", lambda ps: ds_adam(ps, lr=1e-4, adamw_mode=True), total, None))
        if not args.no_reference:
            arms.append(("CoatFP8AdamW torch reference (scaled)", lambda ps: _reference(ps),
                         int(args.reference_params), None))
        measured = {name: [] for name, *_ in arms}
        for _ in range(args.rounds):
            for name, make, n, lib in arms:
                default_library = cpu_step.library
                if lib is not None:
                    cpu_step.library = lambda lib=lib: lib
                try:
                    params = make_params(n, args.tensors)
                    seconds = time_steps(make(params), args.steps if n == total else 2)
                finally:
                    cpu_step.library = default_library
                measured[name].append(seconds * 1e3 * 1e8 / n)
                print(f"  threads {threads:3d}  {name:40s} {measured[name][-1]:9.1f} ms per 1e8 params", flush=True)
                del params
        rows += [(threads, name, statistics.median(ms)) for name, ms in measured.items()]
    print("\n| threads | optimizer | ms per step per 1e8 params | x DeepSpeedCPUAdam | x torch AdamW |")
    print("|---|---|---|---|---|")
    for threads, name, ms in rows:
        ref = {n: m for t, n, m in rows if t == threads}
        ds = ref.get("DeepSpeedCPUAdam")
        print(f"| {threads} | {name} | {ms:.1f} | {ms / ds:.2f} |" if ds else f"| {threads} | {name} | {ms:.1f} | |",
              f" {ms / ref['torch AdamW (foreach)']:.2f} |")


def _reference(params):
    """CoatFP8AdamW stepping with its torch reference on the CPU (the path without the C++ library)."""
    return CoatFP8AdamW(params, lr=1e-4, backend="torch")


if __name__ == "__main__":
    main()
