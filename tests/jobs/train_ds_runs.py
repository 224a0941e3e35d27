"""launch/train_ds.py checkpoints across data-parallel sizes, run as a user would: torchrun subprocesses of the
script, `python -m coat_ds.to_universal` between them, the loss curves read back from --csv (exact values).

Shared by the CPU test (tests/deepspeed/test_train_ds_checkpoints.py: gloo) and the GPU one
(tests/gpu/test_ds_checkpoint_sizes_gpu.py: NCCL). The script and configs are found beside tests/ (REPO/launch,
REPO/configs), not through the installed package.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rank_helpers import free_port

REPO = Path(__file__).resolve().parents[2]
TRAIN_DS = REPO / "launch" / "train_ds.py"
CONFIGS = REPO / "configs"
SAVE_AT = 3


@dataclass
class Training:
    """One training setup: train_ds.py flags shared by every run of a flow, and the environment of its processes."""
    flags: list[str]
    env: dict[str, str]
    steps: int = 6
    timeout_s: int = 600

    def run(self, ranks: int, csv: Path, *extra: str) -> dict[int, float]:
        """Losses by step (the true step numbers the script writes) of one torchrun job of `ranks` processes."""
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(free_port()), str(TRAIN_DS), *self.flags, "--steps", str(self.steps), "--csv", str(csv), *extra]
        proc = run_checked(cmd, self.env, self.timeout_s)
        assert "SUMMARY" in proc.stdout, proc.stdout[-3000:]
        return read_losses(csv)

    def fails(self, ranks: int, *extra: str) -> str:
        """The output of a job that must stop before training; asserts that it did."""
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(free_port()), str(TRAIN_DS), *self.flags, "--steps", str(self.steps), *extra]
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=self.timeout_s)
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0 and "[train_ds] step" not in output, output[-3000:]
        return output


@dataclass
class Curves:
    """Loss curves of one flow, by run name, and the largest |difference| of the runs compared with a tolerance."""
    losses: dict[str, dict[int, float]] = field(default_factory=dict)
    noise: float = 0.0


def run_checked(cmd: list[str], env: dict[str, str], timeout_s: int) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, " ".join(cmd) + "\n" + proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def read_losses(csv: Path) -> dict[int, float]:
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("step,loss,"), lines[:2]
    return {int(step): float(loss) for step, loss, *_ in (line.split(",") for line in lines[1:])}


def to_universal(tag_dir: Path, env: dict[str, str]) -> Path:
    out = tag_dir.parent / f"{tag_dir.name}_universal"
    cmd = [sys.executable, "-m", "coat_ds.to_universal", "--input_folder", str(tag_dir), "--output_folder", str(out),
           "--num_extract_workers", "1", "--num_merge_workers", "1"]
    proc = run_checked(cmd, env, 600)
    assert "dequantized" in proc.stdout + proc.stderr, proc.stdout[-2000:]
    return out


def max_difference(a: dict[int, float], b: dict[int, float], steps) -> float:
    return max(abs(a[s] - b[s]) for s in steps)


def resume_across_sizes(training: Training, tmp: Path, one_to_two: bool) -> Curves:
    """The flow, each resumed run checked against the uninterrupted run it continues:

    - 2 ranks, uninterrupted, saving after step SAVE_AT; 1 rank, uninterrupted (saving too when `one_to_two`): the
      difference of these two curves is what the rank count alone makes (`noise`);
    - 2 -> 2 from the rigid checkpoint and 2 -> 2 through the universal one: the steps after SAVE_AT bit for bit;
    - 2 -> 1 through the universal checkpoint (and 1 -> 2 when `one_to_two`): the curves are returned for the caller
      to compare within its tolerance.
    """
    curves = Curves()
    after = range(SAVE_AT + 1, training.steps + 1)
    two, one = tmp / "two_ranks", tmp / "one_rank"
    curves.losses["2"] = training.run(2, tmp / "full2.csv", "--save-dir", str(two), "--save-at", str(SAVE_AT))
    curves.losses["1"] = training.run(1, tmp / "full1.csv", *(
        ("--save-dir", str(one), "--save-at", str(SAVE_AT)) if one_to_two else ()))
    assert sorted(curves.losses["2"]) == list(range(1, training.steps + 1)), curves.losses["2"]
    curves.noise = max_difference(curves.losses["1"], curves.losses["2"], range(1, training.steps + 1))

    curves.losses["2->2"] = training.run(2, tmp / "resume2.csv", "--resume", f"{two}:step{SAVE_AT}")
    universal = to_universal(two / f"step{SAVE_AT}", training.env)
    curves.losses["2->2 universal"] = training.run(2, tmp / "universal2.csv", "--resume", f"{two}:{universal.name}",
                                                   "--universal")
    for name in ("2->2", "2->2 universal"):
        assert sorted(curves.losses[name]) == list(after), (name, curves.losses[name])
        assert all(curves.losses[name][s] == curves.losses["2"][s] for s in after), \
            f"{name}: steps {list(after)} {curves.losses[name]} differ from the uninterrupted {curves.losses['2']}"
    curves.losses["2->1"] = training.run(1, tmp / "universal1.csv", "--resume", f"{two}:{universal.name}",
                                         "--universal")
    if one_to_two:
        universal = to_universal(one / f"step{SAVE_AT}", training.env)
        curves.losses["1->2"] = training.run(2, tmp / "universal1to2.csv", "--resume", f"{one}:{universal.name}",
                                             "--universal")
    for name in ("2->1", "1->2") if one_to_two else ("2->1",):
        assert sorted(curves.losses[name]) == list(after), (name, curves.losses[name])
    return curves


def report(curves: Curves, stage: int, steps: int) -> dict[str, float]:
    """Max |loss difference| over the resumed steps of each size change against the run it continues, printed."""
    after = range(SAVE_AT + 1, steps + 1)
    diffs = {"2->1": max_difference(curves.losses["2->1"], curves.losses["2"], after)}
    if "1->2" in curves.losses:
        diffs["1->2"] = max_difference(curves.losses["1->2"], curves.losses["1"], after)
    print(f"\nZeRO-{stage}: 2 -> 2 (rigid and universal) bit-exact on steps {list(after)}; 1 rank vs 2 ranks from the "
          f"start: max |loss difference| {curves.noise:.3g}; " +
          ", ".join(f"{name} through universal: max |loss difference| {d:.3g}" for name, d in diffs.items()))
    for name, losses in curves.losses.items():
        print(f"  {name:>15}: " + " ".join(f"{s}:{losses[s]:.6f}" for s in sorted(losses)))
    return diffs


def check_size_changes(curves: Curves, diffs: dict[str, float], noise_bound: float, floor: float) -> float:
    """Each size change within twice the difference the rank count makes from the start (`noise`), at least `floor`;
    the rank count itself changes training by less than `noise_bound`; and training moves the loss by more than the
    tolerance from step to step, so a resumed run one batch or one update off would fail. Returns the tolerance."""
    tolerance = max(2 * curves.noise, floor)
    losses = curves.losses["2"]
    moved = min(abs(losses[s] - losses[s - 1]) for s in range(SAVE_AT + 1, max(losses) + 1))
    print(f"  tolerance {tolerance:.3g}; smallest step-to-step loss change after the save {moved:.3g}")
    assert 0 < curves.noise < noise_bound, (curves.noise, curves.losses)
    assert moved > tolerance, (moved, tolerance, losses)
    for name, diff in diffs.items():
        assert diff <= tolerance, f"{name}: max |loss difference| {diff:.3g} > {tolerance:.3g}: {curves.losses}"
    return tolerance


def environment(cpu: bool) -> dict[str, str]:
    """This process's environment for the jobs: on CPU DeepSpeed's CPU accelerator (gloo) and one thread per rank;
    on GPUs DeepSpeed's choice (CUDA, NCCL)."""
    env = dict(os.environ)
    env.pop("DS_ACCELERATOR", None)
    if cpu:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env
