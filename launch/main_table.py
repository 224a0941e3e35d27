"""BENCHMARKS.md's table of the main job (`python -m launch.main`), written from the job's own results files.

    python -m launch.main_table            # rewrite the table from benchmarks/main_job/*.json
    python -m launch.main_table --check    # exit 1 if BENCHMARKS.md's table is not what the files give

A row per results file: the `results.json` a run of the main job writes, copied to benchmarks/main_job/<name>.json
(rows in file-name order). The table sits between MARKERS in BENCHMARKS.md; tests/launch/test_main_table.py checks
that it matches the files, so a number in it cannot be typed by hand or go stale.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "main_job"
BENCHMARKS = ROOT / "BENCHMARKS.md"
MARKERS = ("<!-- main-job table: written by python -m launch.main_table from benchmarks/main_job/*.json -->",
           "<!-- end of the main-job table -->")
HEADER = ["| machine | command | BF16 + AdamW | COAT | whole job |", "|---|---|---|---|---|"]


def duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def machine_cell(machine: dict) -> str:
    if machine["device"] != "cpu":
        return machine["device"]
    load = ", ".join(f"{x:.2f}" for x in machine["load_average_at_end"])
    instructions = f" ({machine['cpu']})" if "cpu" in machine else ""
    return (f"CPU{instructions}, {machine['threads']} thread(s) ({machine['threads_reason']} at start; load average "
            f"{load} at the end)")


def arm_cell(arm: dict, reference: dict | None) -> str:
    val = arm["val"][-1][1]
    parts = [f"val {val:.4f}"]
    if reference is not None:
        parts[0] += f" ({(val - reference['val'][-1][1]) / reference['val'][-1][1] * 100:+.2f}%)"
    tokens = f"{arm['tokens_per_s']:,.0f} tok/s"
    if reference is not None:
        tokens += f" ({arm['tokens_per_s'] / reference['tokens_per_s']:.2f}x)"
    parts.append(tokens)
    if arm.get("peak_gib") is not None:
        parts.append(f"{arm['peak_gib']:.2f} GiB peak")
    parts.append(f"{arm['seconds']:.0f} s")
    return ", ".join(parts)


def row(results: dict) -> str:
    args, (bf16, coat) = results["args"], results["results"]
    command = (f"`python -m launch.main` ({results['parameters'] / 1e6:.1f}M parameters, {args['steps']} steps of "
               f"{args['batch']} x {args['seq']} tokens)")
    return (f"| {machine_cell(results['machine'])} | {command} | {arm_cell(bf16, None)} | {arm_cell(coat, bf16)} | "
            f"{duration(results['machine']['seconds'])} |")


def table(paths) -> str:
    return "\n".join(HEADER + [row(json.loads(Path(p).read_text())) for p in paths])


def with_table(text: str, new_table: str) -> str:
    """`text` with the part between MARKERS replaced by `new_table`."""
    start, end = text.find(MARKERS[0]), text.find(MARKERS[1])
    if start < 0 or end < start:
        raise ValueError(f"BENCHMARKS.md lacks the main-job table's markers: {MARKERS[0]} ... {MARKERS[1]}")
    return text[:start + len(MARKERS[0])] + "\n" + new_table + "\n" + text[end:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when the table differs")
    args = ap.parse_args(argv)
    text = BENCHMARKS.read_text()
    updated = with_table(text, table(sorted(RESULTS_DIR.glob("*.json"))))
    if args.check:
        if updated != text:
            print("BENCHMARKS.md's main-job table differs from benchmarks/main_job/*.json: "
                  "run python -m launch.main_table", file=sys.stderr)
            return 1
        return 0
    BENCHMARKS.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
