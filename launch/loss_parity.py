"""Loss parity on real text: the same Llama (about 150M parameters by default) trained on the Python standard
library corpus (launch/corpus.py) in several arms from one initialisation and one data order, plus BF16 with other
seeds to show seed-to-seed noise.

One process per arm (they may run side by side on one GPU); each writes <out>/<arm>-seed<seed>.json after every
evaluation, so a run cut short still reports how far it got:

    python -m launch.loss_parity --arm bf16 --seed 0 --out runs/parity   # arms: bf16 coat_optim coat_act coat torchao
    python -m launch.loss_parity --report runs/parity                         # table (results.md) and curves.png

The report compares final validation losses with BF16 seed 0 (same initialisation and batches as every other arm)
and puts the gaps beside the spread of the BF16 seeds.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import time
import warnings
from dataclasses import asdict

import torch

from launch.main import (ARMS, add_run_args, build_model, make_arm, prepare_data, resolve_size, run_arm,
                         set_cpu_threads)


def train(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", choices=sorted(ARMS), required=True)
    add_run_args(ap, "parity", os.path.join("runs", "parity"))
    args = ap.parse_args(argv)
    device = resolve_size(args)
    threads = set_cpu_threads(args, device, os.environ.get("OMP_NUM_THREADS"))
    args.threads = threads.threads if threads else None
    warnings.filterwarnings("ignore", category=UserWarning)
    os.makedirs(args.out, exist_ok=True)
    data, batches, val_batches = prepare_data(args)
    base = build_model(args, data.vocab_size)
    n_params = sum(p.numel() for p in base.parameters())
    path = os.path.join(args.out, f"{args.arm}-seed{args.seed}.json")
    start = time.time()

    def save(train_curve, val_curve, result=None):
        record = dict(arm=args.arm, label=ARMS[args.arm], seed=args.seed, params=n_params, args=vars(args),
                      corpus=data.meta, train=train_curve, val=val_curve, seconds=time.time() - start,
                      device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      result=asdict(result) if result is not None else None)
        write_record(path, record)

    model, optimizer = make_arm(args.arm, base, args, device)
    del base
    # torchao's float8 training is meant to run under torch.compile (its eager casts are separate kernels)
    result = run_arm(f"{args.arm}/{args.seed}", model, optimizer, batches, val_batches, args, device,
                     not args.no_progress, on_eval=save, compile_layers=args.arm == "torchao" and device.type == "cuda")
    save(result.train, result.val, result)
    print(f"{args.arm} seed {args.seed}: final validation loss {result.val[-1][1]:.4f}, "
          f"{result.tokens_per_s:,.0f} tokens/s -> {path}", flush=True)


def write_record(path, record):
    """Write a run's record as JSON, atomically: a report reading it meanwhile sees the old or the new one."""
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def report(out):
    records = []
    for path in sorted(glob.glob(os.path.join(out, "*-seed*.json"))):
        with open(path) as f:
            records.append(json.load(f))
    if not records:
        raise SystemExit(f"no results in {out}")
    reference = next((r for r in records if r["arm"] == "bf16" and r["seed"] == 0), None)
    ref_val = dict((s, v) for s, v in reference["val"]) if reference else {}
    lines = [f"Final validation loss of each run, and its gap to BF16 seed 0 at the same step (same initialisation and "
             f"batches); model {records[0]['params'] / 1e6:.0f}M parameters, {records[0]['device']}", "",
             "| arm | seed | steps run | validation loss | perplexity | gap vs BF16 seed 0 | tokens/s | peak GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (list(ARMS).index(r["arm"]), r["seed"])):
        res = r["result"] or {}
        tps = f"{res['tokens_per_s']:,.0f}" if res else "(cut short)"
        peak = f"{res['peak_gib']:.2f}" if res.get("peak_gib") else "-"
        if not r["val"]:
            lines.append(f"| {r['label']} | {r['seed']} | 0 | - | - | - | {tps} | {peak} |")
            continue
        step, loss = r["val"][-1]
        gap = f"{(loss - ref_val[step]) / ref_val[step] * 100:+.3f}%" if step in ref_val else "-"
        lines.append(f"| {r['label']} | {r['seed']} | {step} | {loss:.4f} | {math.exp(loss):.2f} | {gap} | {tps} | "
                     f"{peak} |")
    finals = {}
    for r in records:
        if r["arm"] == "bf16" and r["val"]:
            finals.setdefault(r["val"][-1][0], []).append(r["val"][-1][1])
    for step, losses in sorted(finals.items()):
        if len(losses) >= 2 and step in ref_val:
            lines += ["", f"BF16 seed-to-seed at step {step}: {len(losses)} seeds, spread (max - min) "
                          f"{(max(losses) - min(losses)) / ref_val[step] * 100:.3f}% of BF16 seed 0, standard "
                          f"deviation {statistics.stdev(losses) / ref_val[step] * 100:.3f}%"]
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table + "\n")
    _plot(records, os.path.join(out, "curves.png"))


def _plot(records, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_all, ax_end) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = {arm: f"C{i}" for i, arm in enumerate(ARMS)}
    for r in records:
        if not r["val"]:
            continue
        style = "-" if r["seed"] == 0 else ":"
        label = f"{r['label']}" + (f" (seed {r['seed']})" if r["arm"] == "bf16" else "")
        steps, losses = zip(*r["val"])
        ax_all.plot(steps, losses, style, color=colors[r["arm"]], label=label)
        tail = [(s, v) for s, v in r["val"] if s >= steps[-1] / 2]
        ax_end.plot(*zip(*tail), style + "o", color=colors[r["arm"]], label=label, markersize=3)
    for ax, title in ((ax_all, "validation loss"), (ax_end, "validation loss, second half")):
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(title)
    ax_end.legend(fontsize=8)
    fig.suptitle("Llama on the Python standard library: COAT vs BF16 and torchao float8")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"curves: {path}")


def main(argv=None):
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--report"]:
        if len(argv) != 2:
            raise SystemExit("usage: python -m launch.loss_parity --report DIR")
        report(argv[1])
    else:
        train(argv)


if __name__ == "__main__":
    main()
