"""Hugging Face Llama under DeepSpeed ZeRO-2 bf16, one process per arm, same data and seed: tokens/s, peak memory,
a measured memory breakdown and loss curves, at one micro-batch and then at each arm's largest micro-batch.

Arms (each is `launch/train_ds.py` with a ds_config and, for the peers, one flag):
  bf16          "type": "AdamW" (torch fused)                     configs/ds_zero2_adamw_bf16.json
  bf16_compile  the same, each decoder layer under torch.compile  + --compile-layers
  coat_optim    "type": "CoatFP8AdamW" (optimizer half only)      configs/ds_zero2_coat.json
  coat          CoatFP8AdamW + "coat": {"fp8_activations": true}  configs/ds_zero2_coat_full.json
  coat_graphs   coat + "cuda_graphs": true (per-layer CUDA graphs) configs/ds_zero2_coat_graphs.json
  coat_remainders  coat + bf16 masters with 16-bit remainders     configs/ds_zero2_coat_remainders.json
  coat_graphs_remainders  coat_graphs with bf16 masters + remainders  configs/ds_zero2_coat_graphs_remainders.json
  torchao       torchao float8 tensorwise + compile + AdamW       configs/ds_zero2_adamw_bf16.json + --torchao-float8
  bf16_ckpt, coat_ckpt      bf16 / coat with Hugging Face gradient checkpointing (--grad-checkpointing)
  bf16_offload  ZeRO-Offload: AdamW on the CPU (DeepSpeedCPUAdam)  configs/ds_zero2_adamw_offload.json
  coat_offload  ZeRO-Offload: CoatFP8AdamW's C++ step on the CPU   configs/ds_zero2_coat_offload.json
                (both offload arms keep BF16 activations: they compare the optimizers alone)
The default --arms are the ones above the checkpointing and offload lines.

    python benchmarks/hf_deepspeed_compare.py [--model tinyllama-1b] [--micro-batch 8 | --micro-batches 1,2,4,8]
        [--steps 30] [--curve-steps 200] [--curve-arms bf16,coat] [--arms ...] [--max-batch] [--out DIR]
        [--gpus N] [--zero-stage 2|3] [--data bigram|corpus] [--batching fixed|padded|packed] [--min-len N]
        [--seed S] [--profile-step STEP] [--port-base P]

--gpus N runs each arm on N ranks (data parallel, micro-batch per rank, so the global batch is N x micro-batch);
--zero-stage overrides the configs' ZeRO stage (ZeRO-3 partitions the bf16 weights too). --batching padded / packed
feed samples of varying length (launch/batches.py: lengths uniform in [--min-len, --seq-len], padded to the longest
of each micro-batch, or packed into rows with position ids restarting); tokens/s then counts real tokens.
--profile-step STEP profiles that step of every run (train_ds.py's flag): a chrome trace and the host ops by self CPU
time in DIR/profile_<run>/. Peak reserved memory is what the caching allocator holds, CUDA-graph pools included (the
per-layer graphs keep using memory they gave back to their pool, which "peak" no longer counts as allocated).

Largest micro-batch: the first run's breakdown gives the memory held between steps and what a step adds per
sequence; the predicted largest batch is run for a few steps, and on out-of-memory 10% smaller, until one fits.
Columns: tokens/s, its ratio to bf16 at the same micro-batch, the median step, the host time until forward and
backward are issued (close to the step time when the host is the bottleneck), peak memory and its breakdown.
Writes DIR/results.json, DIR/results.md, DIR/loss.png (matplotlib) and one log + CSV per run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

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
    "bf16_ckpt": ("configs/ds_zero2_adamw_bf16.json", ["--grad-checkpointing"]),
    "coat_ckpt": ("configs/ds_zero2_coat_full.json", ["--grad-checkpointing"]),
    "bf16_offload": ("configs/ds_zero2_adamw_offload.json", []),
    "coat_offload": ("configs/ds_zero2_coat_offload.json", []),
})


def run_arm(arm, args, micro_batch, steps, tag, port):
    """One training process; returns its SUMMARY dict, or {"error": ...}."""
    config, flags = ARMS[arm]
    name = f"{arm}_mb{micro_batch}_{tag}" + (f"_g{args.gpus}" if args.gpus > 1 else "") + (
        f"_z{args.zero_stage}" if args.zero_stage else "") + ("" if args.batching == "fixed" else f"_{args.batching}")
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
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=args.run_timeout)
    text = open(log).read()
    summary = next((json.loads(line[8:]) for line in text.splitlines() if line.startswith("SUMMARY ")), None)
    if summary is not None:
        curve = [tuple(float(v) for v in line.split(",")[:2]) for line in open(csv).read().splitlines()[1:]]
        summary.update(arm=arm, micro_batch=micro_batch, csv=csv, curve=[(int(s), loss) for s, loss in curve])
        print(f"   {summary['tokens_per_s']:,.0f} tokens/s, peak {max(summary['peak_memory_gib']):.2f} GiB "
              f"(reserved {max(summary.get('peak_reserved_gib') or [0]):.2f}), "
              f"final loss {summary['final_loss']:.4f}", flush=True)
        return summary
    oom = "OutOfMemoryError" in text or "CUDA out of memory" in text
    error = "out of memory" if oom else f"exit {proc.returncode}: " + " | ".join(text.strip().splitlines()[-3:])
    print(f"   {error}", flush=True)
    return {"arm": arm, "micro_batch": micro_batch, "error": error, "oom": oom}


def total_gib():
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2 ** 30 if torch.cuda.is_available() else math.inf


def largest_batch(arm, first, args, port):
    """Predicted from the first run's breakdown, verified by a short run (10% smaller after an out-of-memory)."""
    b = first.get("memory_breakdown_gib") or {}
    if not b:
        return None
    per_sequence = b["step_transient"] / first["micro_batch"]
    held = b["step_peak"] - b["step_transient"]
    budget = total_gib() * args.memory_fraction
    mb = max(first["micro_batch"], int((budget - held) / per_sequence))
    for _ in range(args.max_batch_tries):
        result = run_arm(arm, args, mb, args.max_batch_steps, "max", port)
        if "error" not in result:
            result["predicted_from"] = first["micro_batch"]
            return result
        if not result.get("oom") or mb <= first["micro_batch"]:
            return result
        mb = max(first["micro_batch"], int(mb * 0.9))
    return result


def table(rows, base):
    """Markdown table; `base`: bf16's tokens/s per micro-batch (the "x bf16" column compares at the same one)."""
    lines = ["| arm | micro-batch | tokens/s | x bf16 | step ms | fwd+bwd host ms | peak GiB | peak reserved GiB | "
             "weights | optimizer state | master + grad buffers | step transient | final loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['arm']} | {r['micro_batch']} | {r['error']} |" + " |" * 10)
            continue
        b = r.get("memory_breakdown_gib") or {}
        ref = base.get(r["micro_batch"])
        speed = f"{r['tokens_per_s'] / ref:.2f}" if ref else ""
        cells = [f"{b[k]:.2f}" if k in b else "" for k in ("weights", "optimizer_state", "master_and_grad_buffers",
                                                            "step_transient")]
        host = r.get("median_fwd_bwd_host_ms")
        lines.append(f"| {r['arm']} | {r['micro_batch']} | {r['tokens_per_s']:,.0f} | {speed} | "
                     f"{r['median_step_ms']:.1f} | {'' if host is None else f'{host:.1f}'} | "
                     f"{max(r['peak_memory_gib']):.2f} | {max(r.get('peak_reserved_gib') or [0]):.2f} | "
                     + " | ".join(cells) + f" | {r['final_loss']:.4f} |")
    return "\n".join(lines)


def plot(rows, path):
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
    ax.set_title("HF Llama under DeepSpeed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tinyllama-1b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--micro-batches", default=None,
                   help="a sweep, e.g. 1,2,4,8: every arm at each (replaces --micro-batch; no loss curves)")
    p.add_argument("--steps", type=int, default=30, help="steps of the arms without a loss curve")
    p.add_argument("--curve-steps", type=int, default=200)
    p.add_argument("--curve-arms", default="bf16,coat")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS))
    p.add_argument("--max-batch", action="store_true", help="also run each arm at its largest micro-batch")
    p.add_argument("--max-batch-from", default=None,
                   help="only the largest-batch runs, predicted from the rows of an earlier results.json")
    p.add_argument("--max-batch-steps", type=int, default=12)
    p.add_argument("--max-batch-tries", type=int, default=3)
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
    p.add_argument("--run-timeout", type=int, default=900)
    p.add_argument("--profile-step", type=int, default=None,
                   help="profile this step of every run (train_ds.py --profile-step; files in OUT/profile_<run>)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--plot", default=None, help="only draw loss.png from a results.json")
    args = p.parse_args(argv)
    if args.plot:
        return plot(json.load(open(args.plot)), os.path.join(os.path.dirname(args.plot), "loss.png"))
    os.makedirs(args.out, exist_ok=True)
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; choose from {sorted(ARMS)}")
    curve_arms = set(args.curve_arms.split(","))
    rows = []
    if args.max_batch_from:
        rows = [r for r in json.load(open(args.max_batch_from)) if r.get("arm") in arms and "error" not in r]
        args.max_batch = True
    elif args.micro_batches:
        port = args.port_base
        for micro in (int(m) for m in args.micro_batches.split(",")):
            for arm in arms:
                port += 1
                rows.append(run_arm(arm, args, micro, args.steps, "sweep", port))
    else:
        for i, arm in enumerate(arms):
            steps = args.curve_steps if arm in curve_arms else args.steps
            rows.append(run_arm(arm, args, args.micro_batch, steps, "fixed", args.port_base + i))
    if args.max_batch:
        for i, first in enumerate(list(rows)):
            if "error" not in first:
                result = largest_batch(first["arm"], first, args, args.port_base + 50 + i)
                if result is not None:
                    rows.append(result)
    base = {r["micro_batch"]: r["tokens_per_s"] for r in rows if r.get("arm") == "bf16" and "error" not in r}
    md = table(rows, base)
    best = {}
    for r in rows:
        if "error" not in r:
            best[r["arm"]] = max(best.get(r["arm"], 0.0), r["tokens_per_s"])
    if "bf16" in best:
        md += "\n\nBest tokens/s per arm (x bf16's best): " + ", ".join(
            f"{a} {v:,.0f} ({v / best['bf16']:.2f}x)" for a, v in best.items())
    print(md, flush=True)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, os.path.join(args.out, "loss.png"))


if __name__ == "__main__":
    main()
