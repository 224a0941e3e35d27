"""launch/train_ds.py's checkpoints across 4 -> 2 -> 4 data-parallel ranks, run as a user would: torchrun jobs of
the script, `python -m coat_ds.to_universal` between them, the loss curves read back from --csv (exact values).

The flow (6 steps): 4 ranks uninterrupted, saving after step 2; 2 ranks uninterrupted (what the rank count alone
changes: `noise`); the 4-rank checkpoint converted to a universal one and resumed on 2 ranks, which train steps 3-6
and save after step 4; that checkpoint converted and resumed on 4 ranks for steps 5-6. Each hop's resumed steps are
compared with the uninterrupted 4-rank run: the hop must stay within twice `noise` (and at least a floor), and
training must move the loss from step to step by more than that, so a resumed run one batch or one update off
fails.

Shared by the GPU test (tests/gpu/test_ds_checkpoint_sizes_gpu.py, 4 GPUs, NCCL) and, as a script, the CPU run
(gloo, 4 ranks on any CPU; about 4 minutes per ZeRO stage on 2 cores, so not in CI):

    python tests/jobs/train_ds_four_two_four.py --stage 2      # and --stage 3; exit status 1 if a check fails
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import train_ds_runs as runs

FIRST_SAVE, SECOND_SAVE = 2, 4
STEPS = 6


@dataclass
class Hops:
    """Loss curves by run name ("4", "2", "4->2", "4->2->4"), the 4-rank vs 2-rank difference from the start, and
    each hop's largest |loss difference| from the uninterrupted 4-rank run over the steps it trained."""
    losses: dict[str, dict[int, float]] = field(default_factory=dict)
    noise: float = 0.0
    diffs: dict[str, float] = field(default_factory=dict)


def cpu_training(stage: int) -> runs.Training:
    """The CPU setup of tests/deepspeed/test_train_ds_checkpoints.py: the tiny FP8 Llama, COAT optimizer + FP8
    activations, global batch 4 (1 sequence per rank on 4 ranks, 2 on 2)."""
    flags = ["--ds-config", str(runs.CONFIGS / "ds_zero2_coat_full.json"), "--zero-stage", str(stage),
             "--model", "tiny-fp8", "--seq-len", "32", "--global-batch", "4", "--lr", "3e-3", "--deterministic"]
    return runs.Training(flags=flags, env=runs.environment(cpu=True), steps=STEPS, timeout_s=600)


def gpu_training(stage: int) -> runs.Training:
    """The GPU setup of tests/gpu/test_ds_checkpoint_sizes_gpu.py: the `small` Llama at sequence length 512, global
    batch 8 (2 sequences per rank on 4 GPUs, 4 on 2)."""
    flags = ["--ds-config", str(runs.CONFIGS / "ds_zero2_coat_full.json"), "--zero-stage", str(stage),
             "--model", "small", "--seq-len", "512", "--global-batch", "8", "--lr", "3e-3", "--deterministic"]
    return runs.Training(flags=flags, env=runs.environment(cpu=False), steps=STEPS, timeout_s=600)


def four_two_four(training: runs.Training, tmp: Path) -> Hops:
    """The flow of the module docstring; asserts that every run trained the steps it should."""
    assert training.steps == STEPS, training.steps
    hops = Hops()
    four, two = tmp / "four_ranks", tmp / "four_to_two"
    hops.losses["4"] = training.run(4, tmp / "full4.csv", "--save-dir", str(four), "--save-at", str(FIRST_SAVE))
    hops.losses["2"] = training.run(2, tmp / "full2.csv")
    for name in ("4", "2"):
        assert sorted(hops.losses[name]) == list(range(1, STEPS + 1)), (name, hops.losses[name])
    hops.noise = runs.max_difference(hops.losses["4"], hops.losses["2"], range(1, STEPS + 1))

    universal = runs.to_universal(four / f"step{FIRST_SAVE}", training.env)
    hops.losses["4->2"] = training.run(2, tmp / "hop2.csv", "--resume", f"{four}:{universal.name}", "--universal",
                                       "--save-dir", str(two), "--save-at", str(SECOND_SAVE))
    universal = runs.to_universal(two / f"step{SECOND_SAVE}", training.env)
    hops.losses["4->2->4"] = training.run(4, tmp / "hop4.csv", "--resume", f"{two}:{universal.name}", "--universal")
    for name, first in (("4->2", FIRST_SAVE + 1), ("4->2->4", SECOND_SAVE + 1)):
        steps = range(first, STEPS + 1)
        assert sorted(hops.losses[name]) == list(steps), (name, hops.losses[name])
        hops.diffs[name] = runs.max_difference(hops.losses[name], hops.losses["4"], steps)
    return hops


def report(hops: Hops, stage: int) -> None:
    first = {"4->2": FIRST_SAVE + 1, "4->2->4": SECOND_SAVE + 1}
    print(f"\nZeRO-{stage}, 4 -> 2 -> 4 through universal checkpoints: 4 ranks vs 2 ranks from the start: max |loss "
          f"difference| {hops.noise:.3g}; " + ", ".join(f"{name} (steps {first[name]}-{STEPS}): max |loss difference| "
                                                        f"{d:.3g}" for name, d in hops.diffs.items()))
    for name, losses in hops.losses.items():
        print(f"  {name:>8}: " + " ".join(f"{s}:{losses[s]:.6f}" for s in sorted(losses)))


def check(hops: Hops, noise_bound: float, floor: float) -> float:
    """Each hop within max(2 x noise, floor); the rank count changes training by less than `noise_bound`; the loss
    moves by more than the tolerance at every step after the first save. Returns the tolerance."""
    tolerance = max(2 * hops.noise, floor)
    losses = hops.losses["4"]
    moved = min(abs(losses[s] - losses[s - 1]) for s in range(FIRST_SAVE + 1, STEPS + 1))
    print(f"  tolerance {tolerance:.3g}; smallest step-to-step loss change after the first save {moved:.3g}")
    assert 0 < hops.noise < noise_bound, (hops.noise, hops.losses)
    assert moved > tolerance, (moved, tolerance, losses)
    for name, diff in hops.diffs.items():
        assert diff <= tolerance, f"{name}: max |loss difference| {diff:.3g} > {tolerance:.3g}: {hops.losses}"
    return tolerance


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="4 -> 2 -> 4 ranks through universal checkpoints, on CPU (gloo)")
    p.add_argument("--stage", type=int, choices=(2, 3), required=True, help="ZeRO stage")
    p.add_argument("--keep", default=None, help="keep the checkpoints and CSVs in this directory")
    args = p.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.keep or tmp)
        directory.mkdir(parents=True, exist_ok=True)
        hops = four_two_four(cpu_training(args.stage), directory)
        report(hops, args.stage)
        try:
            # the CPU test's bounds (tests/deepspeed/test_train_ds_checkpoints.py)
            check(hops, noise_bound=1e-2, floor=5e-4)
        except AssertionError as error:
            print(f"FAILED: {error}")
            return 1
    print(f"passed in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
