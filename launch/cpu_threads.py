"""How many CPU threads a CPU run should use: as many as there are cores left idle by the other processes.

torch's intra-op threads (and CoatFP8AdamW's C++ step, which uses torch.get_num_threads()) wait for each other at
the end of every parallel operation, so one thread on a core another process keeps busy holds up all of them: with
more threads than idle cores a run is slower, often several times, than with one thread per idle core. `idle_cores`
measures the idle share of the machine from /proc/stat over a short window (Linux); elsewhere nothing is measured
and the choice is every usable core.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class CpuTimes:
    idle: int  # jiffies idle or waiting for I/O, all CPUs together
    total: int
    online: int  # CPUs counted in the totals


def parse_proc_stat(text: str) -> CpuTimes | None:
    """The machine-wide line of /proc/stat ("cpu user nice system idle iowait irq softirq steal ..."), or None."""
    lines = text.splitlines()
    fields = lines[0].split() if lines else []
    if len(fields) < 5 or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])  # guest time is already counted in user time
    online = sum(1 for line in lines[1:] if line.startswith("cpu") and line[3:4].isdigit())
    return CpuTimes(idle, total, max(1, online))


def idle_between(first: CpuTimes, second: CpuTimes) -> float | None:
    """Cores idle on average between two samples (idle share of the machine x online CPUs)."""
    if second.total <= first.total:
        return None
    return (second.idle - first.idle) / (second.total - first.total) * second.online


def idle_cores(seconds: float = 0.5, stat_path: str = "/proc/stat") -> float | None:
    """Cores left idle by every process over the next `seconds`, or None where /proc/stat cannot be read."""
    def sample():
        try:
            with open(stat_path) as f:
                return parse_proc_stat(f.read())
        except OSError:
            return None

    first = sample()
    if first is None:
        return None
    time.sleep(seconds)
    second = sample()
    return None if second is None else idle_between(first, second)


def choose_threads(requested: int | None, idle: float | None, usable: int) -> ThreadChoice:
    """`requested` (--threads) wins; otherwise one thread per core idle (rounded to the nearest, at least one, at
    most `usable`); without a measurement, `usable`."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be at least 1, got {requested}")
        return ThreadChoice(requested, "as requested")
    if idle is None:
        return ThreadChoice(usable, f"{usable} usable cores (the idle share of the CPU could not be measured)")
    threads = min(usable, max(1, math.floor(idle + 0.5)))
    return ThreadChoice(threads, f"{idle:.1f} of {usable} usable cores idle")
