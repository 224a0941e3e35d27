"""Compare the loss curves written by launch/ds_gpu_compare.sh: a table every N steps, the gaps between runs
(mean over the last 20 steps, max over all steps of a 10-step moving average), and loss.png when matplotlib is
importable.  Usage: python launch/ds_curves.py OUT_DIR [EVERY]"""
import csv
import os
import sys


def load(path):
    with open(path) as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}


def smooth(curve, window=10):
    steps = sorted(curve)
    return {s: sum(curve[t] for t in steps[max(0, i - window + 1):i + 1]) / len(steps[max(0, i - window + 1):i + 1])
            for i, s in enumerate(steps)}


def main(out_dir, every=20):
    runs = {os.path.splitext(f)[0]: load(os.path.join(out_dir, f)) for f in sorted(os.listdir(out_dir))
            if f.endswith(".csv")}
    runs = {k: v for k, v in runs.items() if v}
    if not runs:
        sys.exit(f"no curves in {out_dir}")
    names = sorted(runs)
    last = min(max(c) for c in runs.values())
    print("step  " + "  ".join(f"{n:>12}" for n in names))
    for step in sorted(set(range(every, last + 1, every)) | {1, last}):
        print(f"{step:5d} " + "  ".join(f"{runs[n].get(step, float('nan')):12.4f}" for n in names))
    base = "adamw_1gpu" if "adamw_1gpu" in runs else names[0]
    pairs = [(n, base) for n in names if n != base]
    if {"coat_1gpu", "coat_2gpu"} <= set(runs):
        pairs.append(("coat_2gpu", "coat_1gpu"))
    for n, base in pairs:
        common = [s for s in runs[n] if s in runs[base] and s <= last]
        tail = common[-20:]
        gap = sum(runs[n][s] - runs[base][s] for s in tail) / len(tail)
        sa, sb = smooth(runs[n]), smooth(runs[base])
        worst = max(abs(sa[s] - sb[s]) for s in common)
        print(f"{n} - {base}: mean over the last {len(tail)} steps {gap:+.4f}, max |10-step average gap| {worst:.4f}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no loss.png")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for n in names:
        s = smooth(runs[n])
        ax.plot(list(s), list(s.values()), label=n)
    ax.set(xlabel="step", ylabel="loss (10-step moving average)", title=os.path.basename(os.path.abspath(out_dir)))
    ax.legend()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=120, bbox_inches="tight")
    print(f"wrote {os.path.join(out_dir, 'loss.png')}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20)
