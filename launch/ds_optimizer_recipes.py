"""The optimizer recipes a DeepSpeed user picks in ds_config, side by side under ZeRO-2: each one's model states per
parameter and its loss, from launch/train_ds.py runs on the real-text corpus (same model, seed and batches; bf16
activations in every recipe, only the optimizer side differs).

  adamw_fp32         torch AdamW (fused), fp32 master weights and fp32 moments: `"bf16": {"enabled": true}`
  adamw_bf16_states  the same AdamW with `"bf16": {"bf16_master_weights_and_grads": true,
                     "bf16_optimizer_states": true}`: bf16 master weights, gradients and moments (DeepSpeed requires
                     the bf16 masters for bf16 optimizer states)
  coat               `"type": "CoatFP8AdamW"`: FP8 moments, fp32 master weights
  coat_remainders    CoatFP8AdamW with `"master_remainders": true` over DeepSpeed's bf16 master weights (the same
                     bf16 section): the exact fp32 master kept as bf16 weight + 16-bit remainder

One process (one GPU) per recipe; `run` writes <out>/<recipe>.ds_config.json and runs train_ds.py with it (log in
<out>/<recipe>.log, curve in <out>/<recipe>.csv); `report` reads the SUMMARY lines of the logs and writes
<out>/results.md. On a GPU machine (one recipe per GPU, side by side):

    OUT=runs/ds_recipes; mkdir -p $OUT; gpu=0
    for r in adamw_fp32 adamw_bf16_states coat coat_remainders; do
      CUDA_VISIBLE_DEVICES=$gpu python -m launch.ds_optimizer_recipes run $r --out $OUT --model tinyllama-1b \\
        --steps 500 --seq-len 1024 --global-batch 8 --port $((29650 + gpu)) &
      gpu=$((gpu + 1))
    done; wait
    python -m launch.ds_optimizer_recipes report $OUT
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {
    "gradient_clipping": 1.0,
    "steps_per_print": 1000000,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4,
                                                 "warmup_num_steps": 20}},
}
BF16_STATES = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
RECIPES = {  # name -> (label, changes to BASE: section -> value, optimizer params added)
    "adamw_fp32": ("torch AdamW: fp32 masters, fp32 moments", {}, {"torch_adam": True, "fused": True}),
    "adamw_bf16_states": ("torch AdamW, bf16_optimizer_states: bf16 masters, gradients, moments",
                          {"bf16": BF16_STATES}, {"torch_adam": True, "fused": True}),
    "coat": ("CoatFP8AdamW: fp32 masters, FP8 moments", {"type": "CoatFP8AdamW"}, {}),
    "coat_remainders": ("CoatFP8AdamW, master_remainders: bf16 masters + 16-bit remainders, FP8 moments",
                        {"type": "CoatFP8AdamW", "bf16": BF16_STATES}, {"master_remainders": True}),
}
REFERENCE = "adamw_fp32"


def ds_config(recipe: str) -> dict:
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose from {sorted(RECIPES)}")
    _, changes, optimizer_params = RECIPES[recipe]
    config = copy.deepcopy(BASE)
    if "type" in changes:
        config["optimizer"]["type"] = changes["type"]
    if "bf16" in changes:
        config["bf16"] = dict(changes["bf16"])
    config["optimizer"]["params"].update(optimizer_params)
    return config


def run(argv):
    ap = argparse.ArgumentParser(prog="python -m launch.ds_optimizer_recipes run")
    ap.add_argument("recipe", choices=sorted(RECIPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=29650, help="MASTER_PORT of this single-rank run")
    args, train_args = ap.parse_known_args(argv)
    os.makedirs(args.out, exist_ok=True)
    config_path = os.path.join(args.out, f"{args.recipe}.ds_config.json")
    with open(config_path, "w") as f:
        json.dump(ds_config(args.recipe), f, indent=1)
    command = [sys.executable, os.path.join(ROOT, "launch", "train_ds.py"), "--ds-config", config_path,
               "--label", args.recipe, "--csv", os.path.join(args.out, f"{args.recipe}.csv"), "--data", "corpus",
               *train_args]
    env = dict(os.environ, MASTER_PORT=str(args.port))
    with open(os.path.join(args.out, f"{args.recipe}.log"), "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    print(f"{args.recipe}: exit {code}, log {os.path.join(args.out, args.recipe + '.log')}", flush=True)
    return code


def summaries(out: str) -> dict:
    """{recipe: the SUMMARY of its log} for the recipes whose log holds one."""
    found = {}
    for recipe in RECIPES:
        path = os.path.join(out, f"{recipe}.log")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            lines = [line for line in f if line.startswith("SUMMARY ")]
        if lines:
            found[recipe] = json.loads(lines[-1][len("SUMMARY "):])
    return found


def report(out: str) -> str:
    runs = summaries(out)
    lines = ["Model states held between steps per parameter (rank 0, ZeRO-2), from the run's own measurement "
             "(train_ds.py's memory breakdown, GPU only) and its optimizer-state report; loss: mean of the last 10 "
             "steps' training loss, its gap to torch AdamW's.", "",
             "| recipe | ds_config | optimizer state B/param (with COAT's master remainders) | weights | "
             "master weights | gradients and other buffers | total held B/param | mean loss, last 10 steps | "
             "gap vs fp32 AdamW | optimizer step ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    reference = runs.get(REFERENCE, {}).get("mean_loss_last10")
    for recipe, (label, _, _) in RECIPES.items():
        config = f"{out}/{recipe}.ds_config.json"
        if recipe not in runs:
            lines.append(f"| {label} | {config} | no SUMMARY in {out}/{recipe}.log (not run or failed) "
                         "| | | | | | | |")
            continue
        s = runs[recipe]
        n = s["params"]
        state = s["optimizer_state_bytes"][0] / n
        gib = {k: v * 2 ** 30 / n for k, v in (s.get("memory_breakdown_gib") or {}).items()}
        held = ["-"] * 4 if not gib else [f"{gib['weights']:.2f}", f"{gib['master_weights']:.2f}",
                                          f"{gib['gradient_and_other_buffers']:.2f}",
                                          f"{gib['weights'] + gib['master_and_grad_buffers'] + state:.2f}"]
        loss = s["mean_loss_last10"]
        gap = f"{(loss - reference) / reference * 100:+.3f}%" if reference else "-"
        lines.append(f"| {label} | {config} | {state:.2f} | " + " | ".join(held)
                     + f" | {loss:.4f} | {gap} | {s['median_optimizer_step_ms']:.1f} |")
    first = next(iter(runs.values()), None)
    if first:
        lines.append(f"\n{first['model']} ({first['params'] / 1e6:.0f}M parameters), {first['steps']} steps of "
                     f"{first['global_batch']} x {first['seq_len']} tokens, data {first['data']}, "
                     f"{first['ranks']} rank(s).")
    text = "\n".join(lines)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text + "\n")
    return text


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        raise SystemExit(run(argv[1:]))
    if argv[:1] == ["report"] and len(argv) == 2:
        print(report(argv[1]))
        return
    raise SystemExit("usage: python -m launch.ds_optimizer_recipes run RECIPE --out DIR [train_ds.py options] | "
                     "report DIR")


if __name__ == "__main__":
    main()
