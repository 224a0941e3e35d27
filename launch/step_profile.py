"""One training step under torch.profiler (train_ds.py --profile-step): its chrome trace and its host ops by self CPU
time, with the kernel launches the step made."""
from __future__ import annotations

import os

KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


def start_profiler(device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def write_profile(profiler, out_dir, rank, step, host_s):
    """Stop the profiler of one step and write its chrome trace and its host ops by self CPU time."""
    profiler.stop()
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"rank{rank}_step{step}")
    profiler.export_chrome_trace(stem + ".json.gz")
    events = profiler.key_averages()
    launches = sum(e.count for e in events if e.key in KERNEL_LAUNCHES)
    with open(stem + "_host_ops.txt", "w") as f:
        f.write(f"step {step}: forward + backward issued in {host_s * 1e3:.1f} ms (profiled), {launches} kernel "
                f"launches in the step\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=40))
    print(f"[train_ds] step {step} profiled: {stem}.json.gz, {stem}_host_ops.txt ({launches} kernel launches)",
          flush=True)
