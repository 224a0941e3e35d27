"""Optimizers at equal quality on real text: the same Llama trained by each optimizer of launch/optimizer_arms.py
(fp32 moments, bf16 moments, CoatFP8AdamW with and without Dynamic Range Expansion, torchao AdamWFp8, FlashOptim's
FlashAdamW) on the Python standard library corpus (launch/corpus.py), from one initialisation and one data order per
size, bf16 autocast in every arm: only the optimizer differs. fp32 seeds 1 and 2 change the initialisation and the
data order and give the seed-to-seed spread.

One process per arm, each writes <out>/<arm>-seed<seed>.json after every evaluation (a run cut short still reports
how far it got; an arm that cannot run here writes why instead). Measured in the run: validation loss every
--eval-every steps, the bytes of master weights, optimizer state and gradients (from the tensors), and the optimizer
step's time (CUDA-synchronized before and after, every step after the first ten, median). `--moment-error-every N`
(fp32 arm): every N steps the error each storage scheme of launch/moment_schemes.py puts into the update direction
m/(sqrt(v)+eps) of the run's own moments. The report (launch/optimizer_report.py) builds the table (results.md),
curves.png and moment_error.png from these files.

On a GPU machine, one arm per GPU (8 GPUs: all eight runs side by side; with 4, two runs share each GPU). The
peers come from their wheels (`pip install --no-deps torchao==0.18.0 flashoptim==0.1.4`, or the local wheels), the
corpus is built once before the arms start:

    python -c "from launch import corpus; corpus.load(vocab_size=8192)"
    ARMS="fp32:0 fp32:1 fp32:2 bf16_moments:0 coat:0 coat_noexp:0 torchao_fp8:0 flashoptim:0"
    run_all() {  # run_all SIZE OUT [extra options]
      local size=$1 out=$2 gpu=0; shift 2
      for a in $ARMS; do
        CUDA_VISIBLE_DEVICES=$gpu python -m launch.optimizer_parity --arm ${a%:*} --seed ${a#*:} --size $size \\
          --out $out --no-progress "$@" > $out.${a%:*}-${a#*:}.log 2>&1 &
        gpu=$(( (gpu + 1) % $(nvidia-smi -L | wc -l) ))
      done; wait
    }
    mkdir -p runs; run_all parity runs/opt152m --moment-error-every 100   # 152M, 2,000 steps of 8 x 512 tokens
    run_all 1b runs/opt1b --moment-error-every 50                          # 1.0B, 500 steps of 8 x 1,024 tokens
    python -m launch.optimizer_report runs/opt152m runs/opt1b             # results.md, curves.png, moment_error.png

(--moment-error-every only acts on the fp32 arm; with fewer GPUs than arms, two arms share a GPU and their step
times are not the lone-GPU figures.) Expected wall time of one arm alone on an H100, from the batch sizes: 152M,
8.2M tokens at 60-100k tokens/s (host-bound eager Llama at 4,096 tokens per step) 1.5-2.5 min, plus 20 evaluations
of 32 batches, start-up and, for torchao and the BF16 moments, one compilation per tensor shape: about 3 min (at
most 4); 1.0B, 4.1M tokens at about 35-40k tokens/s (BF16 AdamW on a 1.1B Llama ran 43.5k tokens/s at 16k tokens per
step under DeepSpeed) about 2 min, plus model init, 10 evaluations of 16 batches and, on the fp32 arms, ten moment
error snapshots: about 4 min (at most 6); peak memory about 40 GiB (fp32 arm).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

from launch.loss_parity import write_record
from launch.main import add_run_args, build_model, evaluate, lr_at, prepare_data, resolve_size, set_cpu_threads
from launch.moment_schemes import relative_errors
from launch.optimizer_arms import ARMS, ArmContext, Hyper, optimizer_side_bytes, set_lr

TIMING_WARMUP = 10  # steps before the optimizer step is timed (compilation, autotuning, first allocations)
BETAS, EPS, WEIGHT_DECAY, CLIP = (0.9, 0.95), 1e-8, 0.1, 1.0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", choices=sorted(ARMS), required=True)
    add_run_args(ap, "parity", os.path.join("runs", "optimizers"))
    ap.add_argument("--moment-error-every", type=int, default=0, metavar="N",
                    help="fp32 arm: every N steps, the error of each moment storage scheme on this run's moments")
    ap.add_argument("--eager-steps", action="store_true",
                    help="run the steps torchao and the BF16-moment arm would torch.compile eagerly (the CPU default)")
    args = ap.parse_args(argv)
    if args.moment_error_every < 0:
        ap.error("--moment-error-every must be >= 0")
    return args


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def fp32_moments(optimizer):
    """(exp_avg, exp_avg_sq) of every tensor of a torch.optim.AdamW, and the step count."""
    states = [s for s in optimizer.state.values() if "exp_avg" in s]
    return [(s["exp_avg"], s["exp_avg_sq"]) for s in states], int(states[0]["step"])


def train(argv=None):
    args = parse_args(argv)
    device = resolve_size(args)
    threads = set_cpu_threads(args, device, os.environ.get("OMP_NUM_THREADS"))
    args.threads = threads.threads if threads else None
    warnings.filterwarnings("ignore", category=UserWarning)
    os.makedirs(args.out, exist_ok=True)
    arm = ARMS[args.arm]
    path = os.path.join(args.out, f"{args.arm}-seed{args.seed}.json")
    record = dict(arm=args.arm, label=arm.label, moments=arm.moments, seed=args.seed, args=vars(args),
                  device=device_name(device), unavailable=arm.unavailable(device), finished=False, params=None)
    if record["unavailable"]:
        write_record(path, record)
        print(f"{args.arm}: not run here: {record['unavailable']} -> {path}", flush=True)
        return record
    data, batches, val_batches = prepare_data(args)
    model = build_model(args, data.vocab_size).to(device)
    record.update(params=sum(p.numel() for p in model.parameters()), corpus=data.meta)
    context = ArmContext(device, Hyper(args.lr, BETAS, EPS, WEIGHT_DECAY),
                         compile_steps=device.type == "cuda" and not args.eager_steps)
    optimizer = arm.build(model, context)
    record["optimizer"] = type(optimizer).__name__
    train_curve, val_curve, step_ms, moment_error = [], [], [], []
    record.update(train=train_curve, val=val_curve, moment_error=moment_error)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model.train()
    start, train_seconds = time.time(), 0.0
    for step in range(args.steps):
        t0 = time.perf_counter()
        set_lr(optimizer, lr_at(step, args) * arm.lr_scale)
        tokens = batches[step].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if step == 0:
            gradient_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                                 if p.grad is not None)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        timed = step >= TIMING_WARMUP
        if timed:
            synchronize(device)
            step_start = time.perf_counter()
        optimizer.step()
        if timed:
            synchronize(device)
            step_ms.append((time.perf_counter() - step_start) * 1e3)
        if args.moment_error_every and args.arm == "fp32" and (step + 1) % args.moment_error_every == 0:
            moments, count = fp32_moments(optimizer)
            moment_error.append(dict(step=step + 1, **relative_errors(moments, count, BETAS, EPS)))
        if step == 0:
            record["bytes"] = optimizer_side_bytes(model, optimizer, gradient_bytes)
        optimizer.zero_grad(set_to_none=True)
        train_curve.append((step + 1, loss.item()))
        train_seconds += time.perf_counter() - t0
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val_curve.append((step + 1, evaluate(model, val_batches, device)))
            record.update(_timing(step_ms, record["params"], step + 1, tokens.numel(), train_seconds),
                          seconds=time.time() - start)
            write_record(path, record)
            if not args.no_progress:
                print(f"{args.arm}/{args.seed} step {step + 1}: train {train_curve[-1][1]:.4f}, validation "
                      f"{val_curve[-1][1]:.4f}", flush=True)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None
    record.update(finished=True, peak_gib=peak)
    write_record(path, record)
    step_time = f"{record['step_ms_median']:.2f} ms" if record["step_ms_median"] is not None else "not timed"
    print(f"{args.arm} seed {args.seed}: final validation loss {val_curve[-1][1]:.4f}, optimizer step {step_time}, "
          f"{record['tokens_per_s']:,.0f} tokens/s -> {path}", flush=True)
    return record


def _timing(step_ms, params, steps, tokens_per_step, train_seconds):
    median = statistics.median(step_ms) if step_ms else None
    return dict(step_ms_median=median, step_ms_per_1e9_params=median * 1e9 / params if step_ms else None,
                timed_steps=len(step_ms), tokens_per_s=steps * tokens_per_step / train_seconds)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    train()
