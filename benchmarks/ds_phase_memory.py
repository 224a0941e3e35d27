"""Reserved and allocated GPU memory around each forward, backward and optimizer step of launch/train_ds.py, and the
CUDA-graph pool's segments: where a run's peak memory comes from, step by step.

Runs launch/train_ds.py in this process (one rank; pass its arguments) with DeepSpeedEngine.forward, backward and
step timed by memory: after each, a line `[phase] <name> reserved <before> -> <after> max <peak reserved> alloc max
<peak allocated> pool segs <GiB of the model's graph pool>` (GiB). With per-layer CUDA graphs it also prints each
loan of the graph pool to the ZeRO step (`[phase] loan ...`: bytes lent, bytes that needed new memory, the pool's
reserve) and each reset of the pool; `--no-loans` runs the same steps with the ZeRO step's own allocations instead.
At the end, one summary line: the largest reserved memory of the first step, of the later steps, of the whole run.

    torchrun --nproc_per_node 1 benchmarks/ds_phase_memory.py --ds-config configs/ds_zero2_coat_graphs.json \\
        --model tinyllama-1b --seq-len 2048 --global-batch 8 --steps 7 --data corpus --batching padded
"""
from __future__ import annotations

import os
import runpy
import sys
from contextlib import contextmanager

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2 ** 30


def pool_of(engine):
    from coat_hf import coat_runtime

    runtime = coat_runtime(engine.module)
    return None if runtime is None else runtime.graph_pool


class StepPeaks:
    """The largest reserved memory of each training step (forward, backward and step phases), for the summary line."""

    def __init__(self):
        self.peaks = [0]

    def add(self, phase: str, reserved: int) -> None:
        self.peaks[-1] = max(self.peaks[-1], reserved)
        if phase == "step":
            self.peaks.append(0)

    def summary(self) -> str:
        peaks = [p for p in self.peaks if p]
        if not peaks:
            return "[phase] summary: no step ran"
        later = max(peaks[1:], default=0)
        return (f"[phase] summary: max reserved GiB: first step {peaks[0] / GIB:.2f}, later steps {later / GIB:.2f}, "
                f"whole run {max(peaks) / GIB:.2f} ({len(peaks)} steps)")


def traced(name, original, peaks: StepPeaks):
    def run(self, *args, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_reserved()
        out = original(self, *args, **kwargs)
        torch.cuda.synchronize()
        peaks.add(name, torch.cuda.max_memory_reserved())
        pool = pool_of(self)
        segments = pool.segment_bytes() / GIB if pool is not None else 0.0
        print(f"[phase] {name:8s} reserved {before / GIB:6.2f} -> {torch.cuda.memory_reserved() / GIB:6.2f} max "
              f"{torch.cuda.max_memory_reserved() / GIB:6.2f} alloc max {torch.cuda.max_memory_allocated() / GIB:6.2f} "
              f"pool segs {segments:6.2f}", flush=True)
        return out
    return run


def main():
    import coat_ds.graph_pool_step as graph_pool_step
    from coat_kernels.act.graph_pool import GraphPool
    from deepspeed.runtime.engine import DeepSpeedEngine

    argv = sys.argv[1:]
    no_loans = "--no-loans" in argv
    argv = [a for a in argv if a != "--no-loans"]
    lend = graph_pool_step.lend

    @contextmanager
    def reported_lend(pool):
        if no_loans:
            yield None
            return
        with lend(pool) as loan:
            yield loan
            if loan is not None:
                print(f"[phase] loan     {loan.bytes / GIB:.2f} GiB lent, {loan.outside / GIB:.2f} GiB in new memory, "
                      f"pool reserve {pool.reserve_bytes / GIB:.2f}", flush=True)

    graph_pool_step.lend = reported_lend
    reset = GraphPool.reset

    def reported_reset(self):
        before = torch.cuda.memory_reserved()
        reset(self)
        print(f"[phase] pool reset: reserved {before / GIB:.2f} -> {torch.cuda.memory_reserved() / GIB:.2f}",
              flush=True)

    GraphPool.reset = reported_reset
    peaks = StepPeaks()
    for name in ("forward", "backward", "step"):
        setattr(DeepSpeedEngine, name, traced(name, getattr(DeepSpeedEngine, name), peaks))
    sys.argv = ["train_ds.py"] + argv
    try:
        runpy.run_path(os.path.join(ROOT, "launch", "train_ds.py"), run_name="__main__")
    finally:
        print(peaks.summary(), flush=True)


if __name__ == "__main__":
    main()
