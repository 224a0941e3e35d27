"""Tables, JSON and loss curves from the logs of launch/megatron_compare.sh; and its largest-micro-batch prediction.

    python -m launch.megatron_report OUT_DIR [--skip N]        -> OUT_DIR/results.md, results.json, loss.png
    python -m launch.megatron_report --predict-max LOG [LOG ...]

Speed: the mean of the logged ms/iteration (each the mean of its log interval) over the intervals ending after
iteration --skip (default: 10, past warm-up and CUDA-graph capture); tokens/s = micro-batch x sequence x
data-parallel ranks / that time. Memory: the peak allocated on rank 0. "x TE BF16": tokens/s over those of the TE BF16
arm of the same layout (the arm name's tail: tp1, tp2_sp, dp2, tp2_dp2; te_bf16_tp2_sp for coat_tp2_sp) at the same
micro-batch; "x TE BF16 TP=1": over te_bf16_tp1's (one GPU), for the arms of other layouts; "x TE blockwise": tokens/s
and peak memory over those of the TE FP8 blockwise arm of the same layout at the same micro-batch. "best": each arm's
fastest run over the micro-batches it ran, against the fastest of the TE BF16 arm of its layout. "largest": each arm at
the largest micro-batch it finished, against the fastest TE arm (te_*) of its layout, each TE arm at its own largest.
"DP scaling": an X_dpN arm's tokens/s over N times those of X_tp1 at the same micro-batch. loss.png: the loss over
the iterations of COAT (coat_*), TE FP8 blockwise and TE BF16 at each arm's smallest micro-batch (every arm when none
of them ran).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re

ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|.*?elapsed time per iteration \(ms\):\s*([\d.]+)")
LOSS = re.compile(r"lm loss:\s*([\d.E+-]+)")
ARG = re.compile(r"^\s*(\w+) \.+ (.*)$")
PEAK = re.compile(r"\[coat_megatron\] rank 0 peak memory allocated: ([\d.]+) GiB")
HELD = re.compile(r"\[coat_megatron\] rank 0 memory allocated after training: ([\d.]+) GiB of ([\d.]+) GiB")
STATE = re.compile(r"\[coat_megatron\] rank 0 optimizer state: (\S+) ([\d.]+) MiB .*\(([\d.]+) B/element\)")
BASELINE = "te_bf16_tp1"
BLOCKWISE = "te_fp8_blockwise"
LOSS_FAMILIES = ("coat", BLOCKWISE, "te_bf16")  # the arms of loss.png, by the name before the layout
LAYOUT = re.compile(r"_((?:tp\d+_dp\d+)|(?:tp\d+(?:_sp)?)|(?:dp\d+))$")
# What a run that does not fit says (case-insensitive; megatron_compare.sh's search reads it from here): PyTorch's
# allocator, cuBLAS (ALLOC_FAILED), the CUDA runtime, cuDNN, NCCL (its own small allocations fail first when the card
# is full: "Failed to CUDA calloc").
OUT_OF_MEMORY = (r"out of memory|OutOfMemoryError|ALLOC_FAILED|cudaErrorMemoryAllocation"
                 r"|CUDNN_STATUS_(ALLOC|INTERNAL|EXECUTION)|Failed to CUDA calloc")
MEMORY_BUDGET = 0.88  # of the card, for the largest micro-batch: allocator fragmentation and transient buffers


def parse_log(path: str) -> dict:
    name = os.path.basename(path)[:-len(".log")]
    arm = name.rsplit("_mb", 1)[0]
    with open(path, errors="replace") as f:
        text = f.read()
    args = {}
    for line in text.splitlines():
        m = ARG.match(line)
        if m:
            args.setdefault(m.group(1), m.group(2).strip())
    points = []
    for line in text.splitlines():
        m = ITERATION.search(line)
        if m:
            loss = LOSS.search(line)
            points.append((int(m.group(1)), float(m.group(3)), float(loss.group(1)) if loss else math.nan))
    run = {"arm": arm, "log": os.path.basename(path), "points": points,
           "micro": int(args["micro_batch_size"]) if "micro_batch_size" in args else None,
           "seq": int(args["seq_length"]) if "seq_length" in args else None,
           "dp": int(args.get("data_parallel_size", 1) or 1),
           "finished": bool(points) and points[-1][0] == int(args.get("train_iters", -1)),
           "oom": bool(re.search(OUT_OF_MEMORY, text, re.I))}
    if m := PEAK.search(text):
        run["peak_gib"] = float(m.group(1))
    if m := HELD.search(text):
        run["held_gib"], run["card_gib"] = float(m.group(1)), float(m.group(2))
    if m := STATE.search(text):
        run["optimizer"], run["state_mib"], run["state_bytes_per_element"] = m.group(1), float(m.group(2)), \
            float(m.group(3))
    return run


def layout_of(arm: str) -> str:
    """The layout tail of an arm's name (tp1 for a name without one)."""
    m = LAYOUT.search(arm)
    return m.group(1) if m else "tp1"


def family_of(arm: str) -> str:
    """An arm's name without its layout tail."""
    m = LAYOUT.search(arm)
    return arm[:m.start()] if m else arm


def baseline_of(arm: str, family: str = "te_bf16") -> str:
    """The arm of `family` (TE BF16 unless given) in this arm's layout."""
    return f"{family}_{layout_of(arm)}"


def speed(run: dict, skip: int) -> None:
    times = [ms for it, ms, _ in run["points"] if it > skip]
    if times and run["micro"] and run["seq"]:
        run["ms_per_iteration"] = sum(times) / len(times)
        run["tokens_per_s"] = run["micro"] * run["seq"] * run["dp"] * 1000.0 / run["ms_per_iteration"]
    losses = [loss for _, _, loss in run["points"] if not math.isnan(loss)]
    run["final_loss"] = losses[-1] if losses else None


def predict_max(logs: list) -> int:
    """The largest micro-batch whose peak fits MEMORY_BUDGET of the card, from finished runs of one arm.

    With runs at two or more sizes, the peak's growth per sample is the slope between the two largest; with one
    run, it is that run's peak above the memory held between iterations, over its micro-batch. One run
    underestimates the growth where that run's peak came before memory held later was allocated (optimizer state
    created at the first step, FP8 weight copies), so a second size makes the prediction reliable.
    """
    runs = []
    for log in logs:
        if not os.path.exists(log):
            raise SystemExit(f"{log}: no such log (the run at that micro-batch did not start)")
        run = parse_log(log)
        if "peak_gib" not in run or "held_gib" not in run or not run["micro"]:
            raise SystemExit(f"{log}: no memory report (the run did not finish)")
        runs.append(run)
    if not runs:
        raise SystemExit("no log to predict from")
    runs.sort(key=lambda r: r["micro"])
    top = runs[-1]
    budget = MEMORY_BUDGET * top["card_gib"]
    below = [r for r in runs if r["micro"] < top["micro"]]
    if below:
        low = below[-1]
        per_sample = (top["peak_gib"] - low["peak_gib"]) / (top["micro"] - low["micro"])
        if per_sample <= 0:
            raise SystemExit(f"{top['log']}: peak {top['peak_gib']} GiB not above {low['log']}'s "
                             f"{low['peak_gib']} GiB")
        return max(1, top["micro"] + int((budget - top["peak_gib"]) / per_sample))
    per_sample = (top["peak_gib"] - top["held_gib"]) / top["micro"]
    if per_sample <= 0:
        raise SystemExit(f"{top['log']}: peak {top['peak_gib']} GiB not above the memory held {top['held_gib']} GiB")
    return max(1, int((budget - top["held_gib"]) / per_sample))


def ratio(value, reference) -> str:
    return f"{value / reference:.2f}x" if value and reference else ""


def runs_table(runs: list, speeds: dict, peaks: dict) -> list:
    lines = ["| arm | micro-batch | ms/iteration | tokens/s | x TE BF16 (same layout and micro-batch) | "
             "x TE BF16 TP=1 | peak GiB | optimizer state (B/element) | last loss | x TE blockwise tokens/s | "
             "x TE blockwise peak |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (r["arm"], r["micro"] or 0)):
        if not r.get("tokens_per_s") or not r["finished"]:
            lines.append(f"| {r['arm']} | {r['micro']} | {'out of memory' if r['oom'] else 'did not finish'} "
                         f"| | | | | | | | |")
            continue
        same = ratio(r["tokens_per_s"], speeds.get((baseline_of(r["arm"]), r["micro"])))
        one_gpu = "" if baseline_of(r["arm"]) == BASELINE else ratio(r["tokens_per_s"],
                                                                     speeds.get((BASELINE, r["micro"])))
        blockwise = (baseline_of(r["arm"], BLOCKWISE), r["micro"])
        state = f"{r.get('optimizer', '')} ({r.get('state_bytes_per_element', 0):.2f})"
        lines.append(f"| {r['arm']} | {r['micro']} | {r['ms_per_iteration']:.1f} | {r['tokens_per_s']:,.0f} | {same} "
                     f"| {one_gpu} | {r.get('peak_gib', float('nan')):.2f} | {state} | {r['final_loss']:.4f} "
                     f"| {ratio(r['tokens_per_s'], speeds.get(blockwise))} "
                     f"| {ratio(r.get('peak_gib'), peaks.get(blockwise))} |")
    return lines


def largest_runs(ok: list) -> dict:
    """{arm: its finished run at the largest micro-batch}."""
    largest = {}
    for r in ok:
        if r["micro"] > largest.get(r["arm"], {}).get("micro", 0):
            largest[r["arm"]] = r
    return largest


def largest_table(largest: dict) -> tuple[list, list]:
    """Each arm at its largest micro-batch against the fastest TE arm of its layout, each at its own largest."""
    lines = ["| arm | largest micro-batch | tokens/s | peak GiB | fastest TE arm at its largest (micro-batch) | "
             "x that TE arm |", "|---|---|---|---|---|---|"]
    rows = []
    for arm, r in sorted(largest.items()):
        te = [t for name, t in largest.items() if name.startswith("te_") and layout_of(name) == layout_of(arm)]
        best_te = max(te, key=lambda t: t["tokens_per_s"], default=None)
        versus = ratio(r["tokens_per_s"], best_te["tokens_per_s"]) if best_te else ""
        rows.append({"arm": arm, "micro": r["micro"], "tokens_per_s": r["tokens_per_s"], "peak_gib": r.get("peak_gib"),
                     "best_te_arm": best_te["arm"] if best_te else None, "x_best_te": versus})
        named = f"{best_te['arm']} ({best_te['micro']})" if best_te else ""
        lines.append(f"| {arm} | {r['micro']} | {r['tokens_per_s']:,.0f} | {r.get('peak_gib', 0):.2f} | {named} "
                     f"| {versus} |")
    return lines, rows


def scaling_table(ok: list, speeds: dict) -> tuple[list, list]:
    """X_dpN's tokens/s over N x X_tp1's at the same micro-batch."""
    lines = ["| arm | micro-batch | tokens/s | one GPU (X_tp1) tokens/s | DP scaling |", "|---|---|---|---|---|"]
    rows = []
    for r in sorted(ok, key=lambda r: (r["arm"], r["micro"])):
        m = re.fullmatch(r"(.+)_dp(\d+)", r["arm"])
        one = speeds.get((f"{m.group(1)}_tp1", r["micro"])) if m else None
        if one:
            efficiency = r["tokens_per_s"] / (int(m.group(2)) * one)
            rows.append({"arm": r["arm"], "micro": r["micro"], "efficiency": efficiency})
            lines.append(f"| {r['arm']} | {r['micro']} | {r['tokens_per_s']:,.0f} | {one:,.0f} | {efficiency:.1%} |")
    return lines, rows


def report(out: str, skip: int) -> dict:
    runs = [parse_log(p) for p in sorted(glob.glob(os.path.join(out, "*_mb*.log"))) if not p.endswith("_oom.log")]
    for run in runs:
        speed(run, skip)
    ok = [r for r in runs if r.get("tokens_per_s") and r["finished"]]
    speeds = {(r["arm"], r["micro"]): r["tokens_per_s"] for r in ok}
    peaks = {(r["arm"], r["micro"]): r.get("peak_gib") for r in ok}
    best = {}
    for r in ok:
        if r["tokens_per_s"] > best.get(r["arm"], {}).get("tokens_per_s", 0):
            best[r["arm"]] = r
    lines = runs_table(runs, speeds, peaks)
    lines += ["", "| arm | best micro-batch | tokens/s | x TE BF16's best (same layout) | peak GiB |",
              "|---|---|---|---|---|"]
    for arm, r in sorted(best.items()):
        reference = best.get(baseline_of(arm), {}).get("tokens_per_s")
        lines.append(f"| {arm} | {r['micro']} | {r['tokens_per_s']:,.0f} | {ratio(r['tokens_per_s'], reference)} | "
                     f"{r.get('peak_gib', 0):.2f} |")
    largest_lines, largest = largest_table(largest_runs(ok))
    scaling_lines, scaling = scaling_table(ok, speeds)
    lines += [""] + largest_lines + ([""] + scaling_lines if scaling else [])
    table = "\n".join(lines)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"runs": runs, "skip": skip, "largest": largest, "dp_scaling": scaling}, f, indent=1)
    plotted = plot(runs, os.path.join(out, "loss.png"))
    print(table)
    return {"runs": runs, "largest": largest, "dp_scaling": scaling, "loss_plot_arms": plotted}


def plot(runs, path) -> list:
    """The loss of COAT, TE FP8 blockwise and TE BF16 (every arm when none of them ran), each at its smallest
    micro-batch; returns the arms plotted."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    runs = [r for r in runs if r["micro"] and any(not math.isnan(p[2]) for p in r["points"])]
    chosen = [r for r in runs if family_of(r["arm"]) in LOSS_FAMILIES] or runs
    smallest = {}
    for r in chosen:
        if r["micro"] < smallest.get(r["arm"], {}).get("micro", math.inf):
            smallest[r["arm"]] = r
    if not smallest:
        return []
    fig, ax = plt.subplots(figsize=(8, 5))
    for arm, r in sorted(smallest.items()):
        ax.plot([p[0] for p in r["points"]], [p[2] for p in r["points"]], label=f"{arm} (micro-batch {r['micro']})",
                lw=1.2)
    ax.set(xlabel="iteration", ylabel="lm loss", yscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return sorted(smallest)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--skip", type=int, default=10, help="iterations left out of the speed (warm-up, graph capture)")
    ap.add_argument("--predict-max", metavar="LOG", nargs="+",
                    help="finished logs of one arm at fixed micro-batches: print the largest micro-batch predicted")
    args = ap.parse_args()
    if args.predict_max:
        print(predict_max(args.predict_max))
        return
    if not args.out:
        ap.error("OUT_DIR or --predict-max")
    report(args.out, args.skip)


if __name__ == "__main__":
    main()
