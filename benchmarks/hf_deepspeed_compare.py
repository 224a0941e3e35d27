"""Hugging Face causal LMs under DeepSpeed ZeRO-2 (or 3) bf16, one process per arm, same data and seed: tokens/s, peak
memory, a measured memory breakdown and loss curves, at one micro-batch and then at each arm's largest micro-batch.
--model is one of launch/model_shapes.py's MODELS (Llama shapes up to llama2-13b, olmo2-1b, gemma3-1b, tiny variants):
each is built with its own transformers class, and the COAT arms convert it through the ds_config's "coat" section.

Arms (each is `launch/train_ds.py` with a ds_config and, for the peers, one flag):
  bf16          "type": "AdamW" (torch fused)                     configs/ds_zero2_adamw_bf16.json
  bf16_compile  the same, each decoder layer under torch.compile  + --compile-layers
  coat_optim    "type": "CoatFP8AdamW" (optimizer half only)      configs/ds_zero2_coat.json
  coat          CoatFP8AdamW + "coat": {"fp8_activations": true}  configs/ds_zero2_coat_full.json
  coat_graphs   coat + "cuda_graphs": true (per-layer CUDA graphs) configs/ds_zero2_coat_graphs.json
                (with "contiguous_gradients": false: gradients stay in .grad until the step)
  coat_remainders  coat + bf16 masters with 16-bit remainders     configs/ds_zero2_coat_remainders.json
  coat_graphs_remainders  coat_graphs with bf16 masters + remainders  configs/ds_zero2_coat_graphs_remainders.json
  torchao       torchao float8 tensorwise + compile + AdamW       configs/ds_zero2_adamw_bf16.json + --torchao-float8
  coat_graphs_contiguous  coat_graphs with ZeRO-2's contiguous gradient buffers (DeepSpeed's default)
                + --zero contiguous_gradients=true
  bf16_ckpt, coat_ckpt      bf16 / coat with Hugging Face gradient checkpointing (--grad-checkpointing)
  bf16_offload  ZeRO-Offload: AdamW on the CPU (DeepSpeedCPUAdam)  configs/ds_zero2_adamw_offload.json
  coat_offload  ZeRO-Offload: CoatFP8AdamW's C++ step on the CPU   configs/ds_zero2_coat_offload.json
                (both offload arms keep BF16 activations: they compare the optimizers alone)
The default --arms are the ones above coat_graphs_contiguous.

    python benchmarks/hf_deepspeed_compare.py [--model tinyllama-1b] [--micro-batch 8 | --micro-batches 1,2,4,8]
        [--steps 30] [--curve-steps 200] [--curve-arms bf16,coat] [--arms ARM[:MB],...] [--max-batch] [--out DIR]
        [--gpus N] [--zero-stage 2|3] [--data bigram|corpus] [--batching fixed|padded|packed] [--min-len N]
        [--seed S] [--profile-step STEP] [--port-base P] [--time-budget S] [--max-micro-batch N]

`--arms coat_ckpt:16,bf16_ckpt:4` gives an arm its own first micro-batch (default --micro-batch).

--gpus N runs each arm on N ranks (data parallel, micro-batch per rank, so the global batch is N x micro-batch);
--zero-stage overrides the configs' ZeRO stage (ZeRO-3 partitions the bf16 weights too). --batching padded / packed
feed samples of varying length (launch/batches.py: lengths uniform in [--min-len, --seq-len], padded to the longest
of each micro-batch, or packed into rows with position ids restarting); tokens/s then counts real tokens.
--profile-step STEP profiles that step of every run (train_ds.py's flag): a chrome trace and the host ops by self CPU
time in DIR/profile_<run>/. Peak reserved memory is what the caching allocator holds, CUDA-graph pools included (the
per-layer graphs keep using memory they gave back to their pool, which "peak" no longer counts as allocated).

Largest micro-batch (--max-batch), after every arm's first run (arms in --arms order): a run's last step gives the
memory held between steps (before its forward) and what forward + backward add per sequence (their peak over the
held memory, divided by the micro-batch: fixed buffers counted in, so the prediction errs small); the optimizer
step's own peak does not grow with the batch. The largest micro-batch whose forward + backward fit in
--memory-fraction of the GPU (kept in results.json as "predicted_largest"; at most --max-micro-batch, below any
micro-batch that ran out of memory) runs --max-batch-steps steps; on out-of-memory 10% smaller. A first run out of
memory is repeated at half its micro-batch. Each arm gets at most --max-batch-tries runs after its first; a micro-batch
below --max-batch-min-gain times the first run's runs nothing more (the first run counts as the arm's largest), nor
does one whose expected time (the first run's start-up and its median step scaled by the micro-batch) exceeds the
time left.
Time: --time-budget S bounds the whole invocation (each run's timeout is what is left; a run killed at it, its
process group with it, is an error row; no run starts with less than --min-run-time left), and DIR/results.json and
DIR/results.md are rewritten after every run, so a call stopped from outside keeps what finished.
Columns: tokens/s, its ratio to bf16 at the same micro-batch (bf16_ckpt for a *_ckpt arm), the median step, the host
time until forward and backward are issued (close to the step time when the host is the bottleneck), peak memory and
its breakdown. Below the table, the steps where a run's loss exceeds bf16's on the same batch by more than
LOSS_OUTLIER (single-step outliers that a final or mean loss can hide).
Writes DIR/results.json, DIR/results.md, DIR/loss.png (matplotlib) and one log + CSV per run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ARMS = {
    "bf16": ("configs/ds_zero2_adamw_bf16.json", []),
    "bf16_compile": ("configs/ds_zero2_adamw_bf16.json", ["--compile-layers"]),
    "coat_optim": ("configs/ds_zero2_coat.json", []),
    "coat": ("configs/ds_zero2_coat_full.json", []),
    "coat_graphs": ("configs/ds_zero2_coat_graphs.json", []),
    "coat_remainders": ("configs/ds_zero2_coat_remainders.json", []),
    "coat_graphs_remainders": ("configs/ds_zero2_coat_graphs_remainders.json", []),
    "torchao": ("configs/ds_zero2_adamw_bf16.json", ["--torchao-float8"]),
}
DEFAULT_ARMS = list(ARMS)
ARMS.update({
    "coat_graphs_contiguous": ("configs/ds_zero2_coat_graphs.json", ["--zero", "contiguous_gradients=true"]),
    "bf16_ckpt": ("configs/ds_zero2_adamw_bf16.json", ["--grad-checkpointing"]),
    "coat_ckpt": ("configs/ds_zero2_coat_full.json", ["--grad-checkpointing"]),
    "bf16_offload": ("configs/ds_zero2_adamw_offload.json", []),
    "coat_offload": ("configs/ds_zero2_coat_offload.json", []),
})


class Clock:
    """The invocation's time budget (--time-budget): how long the next run may take."""

    def __init__(self, budget_s: float | None, run_timeout_s: float, min_run_s: float):
        self.deadline = None if budget_s is None else time.monotonic() + budget_s
        self.run_timeout_s, self.min_run_s = run_timeout_s, min_run_s

    def timeout(self) -> float | None:
        """Seconds the next run may take, or None when too little is left to start one."""
        if self.deadline is None:
            return self.run_timeout_s
        left = self.deadline - time.monotonic()
        return min(self.run_timeout_s, left) if left >= self.min_run_s else None

    def fits(self, seconds: float) -> bool:
        """Whether a run expected to take `seconds` can finish within the budget and the run timeout."""
        timeout = self.timeout()
        return timeout is not None and seconds <= timeout


def expected_seconds(first: dict, micro_batch: int, steps: int) -> float:
    """How long a run of `steps` steps at `micro_batch` should take, from an earlier run of the arm: its start (its
    wall time less its steps at the median step time: start-up, the slower first steps) and its median step scaled
    by the micro-batch. 0 for a run that did not record its wall time (an earlier results.json)."""
    if "wall_s" not in first:
        return 0.0
    step_s = first["median_step_ms"] / 1e3
    start_s = max(0.0, first["wall_s"] - len(first["curve"]) * step_s)
    return start_s + steps * step_s * micro_batch / first["micro_batch"]


def parse_arms(spec: str, micro_batch: int) -> list[tuple[str, int]]:
    """`ARM[:MB],...` -> [(arm, first micro-batch)]; an unknown arm or a bad micro-batch is an error naming it."""
    arms = []
    for item in (a for a in spec.split(",") if a):
        arm, sep, mb = item.partition(":")
        if arm not in ARMS:
            raise SystemExit(f"unknown arm {arm!r}; choose from {sorted(ARMS)}")
        if sep and not (mb.isdigit() and int(mb) >= 1):
            raise SystemExit(f"--arms {item}: the micro-batch after ':' must be a positive integer")
        arms.append((arm, int(mb) if sep else micro_batch))
    return arms


def run_name(arm, args, micro_batch, tag):
    return f"{arm}_mb{micro_batch}_{tag}" + (f"_g{args.gpus}" if args.gpus > 1 else "") + (
        f"_z{args.zero_stage}" if args.zero_stage else "") + ("" if args.batching == "fixed" else f"_{args.batching}")


def run_arm(arm, args, micro_batch, steps, tag, port, clock):
    """One training process; returns its SUMMARY dict, or {"error": ...} (with "oom" or "timeout" where it applies)."""
    config, flags = ARMS[arm]
    name = run_name(arm, args, micro_batch, tag)
    timeout = clock.timeout()
    if timeout is None:
        print(f"== {name}: not run, the time budget is spent", flush=True)
        return {"arm": arm, "micro_batch": micro_batch, "error": "not run: time budget spent", "skipped": True}
    log, csv = os.path.join(args.out, name + ".log"), os.path.join(args.out, name + ".csv")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.gpus), "--master_port",
           str(port), os.path.join(ROOT, "launch", "train_ds.py"), "--ds-config", os.path.join(ROOT, config),
           "--model", args.model, "--seq-len", str(args.seq_len), "--global-batch", str(micro_batch * args.gpus),
           "--steps", str(steps), "--seed", str(args.seed), "--data", args.data, "--batching", args.batching,
           *(["--min-len", str(args.min_len)] if args.min_len else []),
           "--pad-to-multiple-of", str(args.pad_to_multiple_of), "--label", name, "--csv", csv, *flags,
           *(["--zero-stage", str(args.zero_stage)] if args.zero_stage else []),
           *(["--profile-step", str(args.profile_step), "--profile-out", os.path.join(args.out, "profile_" + name)]
             if args.profile_step else [])]
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    with open(log, "w") as f:
        returncode = run_process_group(cmd, f, timeout)
    wall_s = time.monotonic() - start
    text = open(log).read()
    summary = next((json.loads(line[8:]) for line in text.splitlines() if line.startswith("SUMMARY ")), None)
    if summary is not None:
        curve = [tuple(float(v) for v in line.split(",")[:2]) for line in open(csv).read().splitlines()[1:]]
        summary.update(arm=arm, micro_batch=micro_batch, tag=tag, csv=csv,
                       curve=[(int(s), loss) for s, loss in curve], wall_s=wall_s)
        print(f"   {summary['tokens_per_s']:,.0f} tokens/s, peak {max(summary['peak_memory_gib']):.2f} GiB "
              f"(reserved {max(summary.get('peak_reserved_gib') or [0]):.2f}), "
              f"final loss {summary['final_loss']:.4f}, {wall_s:.0f} s", flush=True)
        return summary
    oom = "OutOfMemoryError" in text or "CUDA out of memory" in text
    if returncode is None:
        done = max(0, len(open(csv).read().splitlines()) - 1) if os.path.exists(csv) else 0
        error = f"timeout after {timeout:.0f} s ({done} of {steps} steps done)"
    else:
        error = "out of memory" if oom else f"exit {returncode}: " + " | ".join(text.strip().splitlines()[-3:])
    print(f"   {error} ({wall_s:.0f} s)", flush=True)
    return {"arm": arm, "micro_batch": micro_batch, "error": error, "oom": oom, "timeout": returncode is None,
            "wall_s": wall_s}


def run_process_group(cmd, log, timeout):
    """Run `cmd` in a process group of its own (torchrun and its ranks; in this session, so whatever ends the
    session's processes ends them too); at `timeout` seconds end the whole group (SIGTERM, then SIGKILL after 15 s)
    so that no rank outlives it holding a GPU. Returns the exit status, or None after a timeout."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, process_group=0)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:  # also when this process is stopped (SIGTERM: see main) while the run goes on
        if proc.poll() is None:
            end_process_group(proc)


def exit_on_sigterm():
    """`timeout` or a job stop sends SIGTERM: exit through the finally of the run in flight, which ends its ranks."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def end_process_group(proc):
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def total_gib():
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2 ** 30 if torch.cuda.is_available() else math.inf


def predict_largest(run: dict, budget_gib: float) -> int | None:
    """The largest micro-batch whose forward + backward fit in `budget_gib`, from one run's last-step memory phases:
    held = allocated before its forward, per sequence = (backward peak - held) / micro-batch (fixed buffers of the
    forward and backward counted in, so the prediction errs small). None without the phases (a CPU run), or when
    the run's own optimizer-step peak, which the micro-batch does not change, leaves no room."""
    phases = run.get("last_step_phase_peaks_gib") or {}
    if not {"phase_base", "backward_peak"} <= set(phases):
        return None
    held = phases["phase_base"]
    per_sequence = (phases["backward_peak"] - held) / run["micro_batch"]
    if per_sequence <= 0 or phases.get("step_phase_peak", 0) > budget_gib:
        return None
    return int((budget_gib - held) / per_sequence)


def largest_batch(arm, first, args, port, clock, too_big=None, tries=None):
    """The arm's largest micro-batch: predicted from `first` (its run that fit; the prediction is kept in it as
    "predicted_largest"), capped by --max-micro-batch and below `too_big` (a micro-batch that ran out of memory),
    then verified by at most `tries` (default --max-batch-tries) short runs, 10% smaller after each out-of-memory.
    Nothing runs when the micro-batch to try is less than --max-batch-min-gain times the first run's: the first run
    then counts as the arm's largest. Returns the runs made."""
    budget = total_gib() * args.memory_fraction
    predicted = predict_largest(first, budget)
    if predicted is None:
        print(f"   {arm}: no largest-batch search: its first run has no memory phases (a CPU run) or its optimizer "
              "step alone exceeds the budget", flush=True)
        return []
    first["predicted_largest"] = predicted
    mb = min(predicted, args.max_micro_batch or predicted, (too_big or predicted + 1) - 1)
    print(f"   {arm}: largest micro-batch predicted {predicted} from micro-batch {first['micro_batch']} (budget "
          f"{budget:.1f} GiB)" + (f", to run at {mb}" if mb != predicted else ""), flush=True)
    runs = []
    for _ in range(args.max_batch_tries if tries is None else tries):
        if mb < first["micro_batch"] * args.max_batch_min_gain or mb <= first["micro_batch"]:
            print(f"   {arm}: micro-batch {mb} is not worth a run over the first run's {first['micro_batch']}: "
                  "that run counts as the largest", flush=True)
            first["largest"] = True
            break
        expected = expected_seconds(first, mb, args.max_batch_steps)
        if not clock.fits(expected):
            print(f"   {arm}: micro-batch {mb} not run: about {expected:.0f} s, more than the time left", flush=True)
            first["largest_not_run_for_time"] = mb
            break
        result = run_arm(arm, args, mb, args.max_batch_steps, "max", port, clock)
        runs.append(result)
        if "error" not in result:
            result["predicted"] = predicted
            result["predicted_from"] = first["micro_batch"]
            break
        if not result.get("oom"):
            break
        mb = int(mb * 0.9)
    return runs


def first_run(arm, micro, args, steps, port, clock):
    """The arm's first run at `micro`; with --max-batch, out of memory is retried at half the micro-batch (within
    --max-batch-tries). Returns the runs and the smallest micro-batch that ran out of memory (None if none did)."""
    runs, too_big = [run_arm(arm, args, micro, steps, "fixed", port, clock)], None
    while args.max_batch and runs[-1].get("oom") and micro > 1 and len(runs) <= args.max_batch_tries:
        too_big, micro = micro, micro // 2
        runs.append(run_arm(arm, args, micro, steps, "fixed", port, clock))
    if runs[-1].get("oom"):
        too_big = runs[-1]["micro_batch"]
    return runs, too_big


def table(rows, base):
    """Markdown table; `base`: the BF16 arms' tokens/s by (arm, micro-batch): the "x bf16" column compares each run
    with bf16 at the same micro-batch (a *_ckpt arm with bf16_ckpt)."""
    lines = ["| arm | micro-batch | tokens/s | x bf16 | step ms | fwd+bwd host ms | peak GiB | peak reserved GiB | "
             "weights | optimizer state | master + grad buffers | step transient | final loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['arm']} | {r['micro_batch']} | {r['error']} |" + " |" * 10)
            continue
        b = r.get("memory_breakdown_gib") or {}
        ref = base.get(("bf16_ckpt" if r["arm"].endswith("_ckpt") else "bf16", r["micro_batch"]))
        speed = f"{r['tokens_per_s'] / ref:.2f}" if ref else ""
        cells = [f"{b[k]:.2f}" if k in b else "" for k in ("weights", "optimizer_state", "master_and_grad_buffers",
                                                            "step_transient")]
        host = r.get("median_fwd_bwd_host_ms")
        lines.append(f"| {r['arm']} | {r['micro_batch']} | {r['tokens_per_s']:,.0f} | {speed} | "
                     f"{r['median_step_ms']:.1f} | {'' if host is None else f'{host:.1f}'} | "
                     f"{max(r['peak_memory_gib']):.2f} | {max(r.get('peak_reserved_gib') or [0]):.2f} | "
                     + " | ".join(cells) + f" | {r['final_loss']:.4f} |")
    return "\n".join(lines)


def plot(rows, path, title="Hugging Face causal LM under DeepSpeed"):
    """Loss curves of the runs with more than 50 steps (also: python hf_deepspeed_compare.py --plot results.json)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no loss.png", flush=True)
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        if "error" in r:
            continue
        steps, losses = [s for s, _ in r["curve"]], [loss for _, loss in r["curve"]]
        if len(steps) > 50:
            ax.plot(steps, losses, label=f"{r['arm']} (mb {r['micro_batch']})", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


LOSS_OUTLIER = 0.5  # a step's loss this far above BF16's on the same batch is listed in results.md


def loss_outliers(rows, threshold=LOSS_OUTLIER):
    """{(arm, micro-batch): [(step, loss - BF16's loss), ...]}: the steps where a run's loss exceeds that of the bf16
    run at the same micro-batch (the same batches) by more than `threshold`; a *_ckpt arm is held against bf16_ckpt."""
    curves = {(r["arm"], r["micro_batch"]): dict(r["curve"]) for r in rows if "error" not in r and r.get("curve")}
    found = {}
    for (arm, micro), curve in curves.items():
        base = curves.get(("bf16_ckpt" if arm.endswith("_ckpt") else "bf16", micro))
        if base is None or base is curve:
            continue
        steps = [(step, loss - base[step]) for step, loss in sorted(curve.items())
                 if step in base and loss - base[step] > threshold]
        if steps:
            found[(arm, micro)] = steps
    return found


def write_results(rows, args):
    """DIR/results.md (the table, the best tokens/s per arm, the largest micro-batch per arm) and results.json."""
    base = {(r["arm"], r["micro_batch"]): r["tokens_per_s"] for r in rows
            if r.get("arm") in ("bf16", "bf16_ckpt") and "error" not in r}
    md = table(rows, base)
    best, largest = {}, {}
    for r in rows:
        if "error" not in r:
            best[r["arm"]] = max(best.get(r["arm"], 0.0), r["tokens_per_s"])
            if r.get("tag") == "max" or r.get("largest"):
                largest[r["arm"]] = r["micro_batch"]
    reference = max((best[a] for a in ("bf16", "bf16_ckpt") if a in best), default=None)
    if reference:
        md += "\n\nBest tokens/s per arm (x the best of bf16 and bf16_ckpt): " + ", ".join(
            f"{a} {v:,.0f} ({v / reference:.2f}x)" for a, v in best.items())
    if largest:
        md += "\n\nLargest micro-batch that ran, per arm: " + ", ".join(f"{a} {m}" for a, m in largest.items())
    predicted = {r["arm"]: r["predicted_largest"] for r in rows if "predicted_largest" in r}
    if predicted:
        md += "\n\nLargest micro-batch predicted from the first run, per arm: " + ", ".join(
            f"{a} {m}" for a, m in predicted.items())
    outliers = loss_outliers(rows)
    if outliers:
        md += (f"\n\nSteps whose loss exceeds BF16's on the same batch by more than {LOSS_OUTLIER}: " + "; ".join(
            f"{arm} mb {micro}: " + ", ".join(f"step {step} (+{gap:.2f})" for step, gap in steps)
            for (arm, micro), steps in outliers.items()))
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return md


def parse_args(argv=None):
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)  # run as a script: `launch` importable
    from launch.model_shapes import MODELS  # torch: imported only here

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tinyllama-1b", choices=sorted(MODELS), help="launch/model_shapes.py's MODELS")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--micro-batches", default=None,
                   help="a sweep, e.g. 1,2,4,8: every arm at each (replaces --micro-batch; no loss curves)")
    p.add_argument("--steps", type=int, default=30, help="steps of the arms without a loss curve")
    p.add_argument("--curve-steps", type=int, default=200)
    p.add_argument("--curve-arms", default="bf16,coat")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                   help="ARM[:MB],...: the arms in the order they run, each optionally with its own first micro-batch")
    p.add_argument("--max-batch", action="store_true", help="also run each arm at its largest micro-batch")
    p.add_argument("--max-batch-from", default=None,
                   help="only the largest-batch runs, predicted from the rows of an earlier results.json")
    p.add_argument("--max-batch-steps", type=int, default=12)
    p.add_argument("--max-batch-tries", type=int, default=3,
                   help="runs per arm besides its first: the largest-batch runs, and the halvings of a first run out "
                        "of memory")
    p.add_argument("--max-micro-batch", type=int, default=None,
                   help="the largest micro-batch the search runs (bounds the time of its steps)")
    p.add_argument("--max-batch-min-gain", type=float, default=1.0,
                   help="run the largest micro-batch only if it is at least this many times the first run's")
    p.add_argument("--memory-fraction", type=float, default=0.96)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", choices=("bigram", "corpus"), default="bigram",
                   help="launch/train_ds.py's data: synthetic bigram sequences or the standard library corpus")
    p.add_argument("--batching", choices=("fixed", "padded", "packed"), default="fixed",
                   help="launch/train_ds.py's batches: fixed lengths, varying lengths padded per micro-batch, packed")
    p.add_argument("--min-len", type=int, default=None, help="padded / packed: the shortest sample")
    p.add_argument("--pad-to-multiple-of", type=int, default=1, help="padded: each micro-batch's length rounded up")
    p.add_argument("--port-base", type=int, default=29600, help="rendezvous ports from here (parallel sweeps)")
    p.add_argument("--gpus", type=int, default=1, help="ranks per arm (data parallel)")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=None)
    p.add_argument("--run-timeout", type=int, default=900, help="seconds one run may take")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds the whole invocation may take: each run's timeout is what is left")
    p.add_argument("--min-run-time", type=float, default=60,
                   help="with --time-budget: no run starts with fewer seconds left")
    p.add_argument("--profile-step", type=int, default=None,
                   help="profile this step of every run (train_ds.py --profile-step; files in OUT/profile_<run>)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--plot", default=None, help="only draw loss.png from a results.json")
    args = p.parse_args(argv)
    if args.max_micro_batch is not None and args.max_micro_batch < 1:
        p.error("--max-micro-batch must be at least 1")
    if args.max_batch_tries < 1:
        p.error("--max-batch-tries must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    exit_on_sigterm()
    if args.plot:
        return plot(json.load(open(args.plot)), os.path.join(os.path.dirname(args.plot), "loss.png"))
    os.makedirs(args.out, exist_ok=True)
    arms = parse_arms(args.arms, args.micro_batch)
    curve_arms = set(args.curve_arms.split(","))
    clock = Clock(args.time_budget, args.run_timeout, args.min_run_time)
    rows = []

    def add(new_rows):
        rows.extend(new_rows)
        write_results(rows, args)

    if args.max_batch_from:
        names = {arm for arm, _ in arms}
        earlier = [r for r in json.load(open(args.max_batch_from)) if r.get("arm") in names and "error" not in r]
        for i, first in enumerate(earlier):
            rows.append(first)
            add(largest_batch(first["arm"], first, args, args.port_base + 50 + i, clock))
    elif args.micro_batches:
        port = args.port_base
        for micro in (int(m) for m in args.micro_batches.split(",")):
            for arm, _ in arms:
                port += 1
                add([run_arm(arm, args, micro, args.steps, "sweep", port, clock)])
    else:
        searches = []
        for i, (arm, micro) in enumerate(arms):
            steps = args.curve_steps if arm in curve_arms else args.steps
            runs, too_big = first_run(arm, micro, args, steps, args.port_base + i, clock)
            add(runs)
            if "error" not in runs[-1]:
                searches.append((i, arm, runs[-1], too_big, args.max_batch_tries - (len(runs) - 1)))
        for i, arm, first, too_big, tries in searches if args.max_batch else ():  # every arm's first run, then these
            add(largest_batch(arm, first, args, args.port_base + 50 + i, clock, too_big, tries))
    md = write_results(rows, args)
    print(md, flush=True)
    plot(rows, os.path.join(args.out, "loss.png"), f"{args.model} under DeepSpeed")


if __name__ == "__main__":
    main()
