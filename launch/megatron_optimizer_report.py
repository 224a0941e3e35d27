"""Table and JSON from the logs of launch/megatron_optimizer_compare.sh: optimizer state, peak memory, the memory held
between iterations, the optimizer's own time per iteration, final validation loss with BF16's seed spread.

    python -m launch.megatron_optimizer_report OUT_DIR [--skip N]   -> OUT_DIR/results.md, OUT_DIR/results.json

The optimizer's time: the median over log intervals ending after iteration --skip of Megatron's `optimizer` timer
(`optimizer.step()` as megatron.training times it: gradient norm and clipping, the inner step, parameter copies;
--timing-log-level 1, the maximum across ranks, per iteration) and, where logged, `optimizer-inner-step` (the inner
optimizer alone). Validation loss: the last evaluation of the training loop (`validation loss at iteration N |
...`, every --eval-interval); the evaluations megatron.training runs after training (`... on validation set`,
`... on test set`) read other batches, whose choice depends on the seed, so they are left out. BF16's spread:
max - min over the `bf16_s*` arms, in % of bf16_s0's.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics

from launch.megatron_report import parse_log, speed

VALIDATION = re.compile(r"validation loss at iteration (\d+) \|\s*lm loss value:\s*([\d.E+-]+)")
TIMER = re.compile(r"^\s+(optimizer|optimizer-inner-step) \.+: \(?([\d.]+)")
ITERATION_NUMBER = re.compile(r"iteration\s+(\d+)/")
BASELINE = "bf16_s0"


def parse_optimizer_log(path: str, skip: int) -> dict:
    run = parse_log(path)
    speed(run, skip)
    timers: dict[str, list[float]] = {}
    validation = []
    iteration = 0
    with open(path, errors="replace") as f:
        for line in f:
            if m := ITERATION_NUMBER.search(line):
                iteration = int(m.group(1))
            if m := VALIDATION.search(line):
                validation.append((int(m.group(1)), float(m.group(2))))
            if (m := TIMER.match(line)) and iteration > skip:
                timers.setdefault(m.group(1), []).append(float(m.group(2)))
    run["validation"] = validation
    run["final_validation_loss"] = validation[-1][1] if validation else None
    run["optimizer_ms"] = {name: statistics.median(values) for name, values in timers.items()}
    return run


def report(out: str, skip: int) -> dict:
    runs = [parse_optimizer_log(p, skip) for p in sorted(glob.glob(os.path.join(out, "*.log")))]
    for run in runs:
        run["arm"] = os.path.basename(run["log"])[:-len(".log")]
    base = next((r["final_validation_loss"] for r in runs if r["arm"] == BASELINE), None)
    seeds = [r["final_validation_loss"] for r in runs if r["arm"].startswith("bf16_s") and r["final_validation_loss"]]
    lines = ["| arm | optimizer state | B/element | peak GiB | held between iterations GiB | optimizer ms | inner step "
             "ms | ms/iteration | validation loss | vs bf16_s0 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        loss = r["final_validation_loss"]
        gap = f"{(loss / base - 1) * 100:+.3f}%" if loss and base else ""
        timers = r["optimizer_ms"]
        cells = [r.get("optimizer", ""), f"{r.get('state_bytes_per_element', float('nan')):.3f}",
                 f"{r.get('peak_gib', float('nan')):.2f}", f"{r.get('held_gib', float('nan')):.2f}",
                 f"{timers['optimizer']:.2f}" if "optimizer" in timers else "",
                 f"{timers['optimizer-inner-step']:.2f}" if "optimizer-inner-step" in timers else "",
                 f"{r['ms_per_iteration']:.1f}" if "ms_per_iteration" in r else "",
                 f"{loss:.4f}" if loss else ("did not finish" if not r["finished"] else ""), gap]
        lines.append(f"| {r['arm']} | " + " | ".join(cells) + " |")
    concurrent = os.path.join(out, "concurrent.txt")
    if os.path.exists(concurrent):
        lines += ["", "Timings of concurrent runs (" + open(concurrent).read().strip() + "): compare the losses and "
                  "memory here, the optimizer times in a run of one arm at a time."]
    if len(seeds) > 1 and base:
        lines += ["", f"BF16 seed spread (max - min over {len(seeds)} seeds): "
                      f"{(max(seeds) - min(seeds)) / base * 100:.3f}% of bf16_s0"]
    table = "\n".join(lines)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"runs": runs, "skip": skip}, f, indent=1)
    print(table)
    return {"runs": runs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--skip", type=int, default=20, help="iterations left out of the timings (warm-up)")
    args = ap.parse_args()
    report(args.out, args.skip)


if __name__ == "__main__":
    main()
