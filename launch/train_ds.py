"""DeepSpeed training of a Hugging Face causal LM (a Llama, OLMo-2 or Gemma 3 shape from MODELS, built from its config,
no downloads) on synthetic data or real text.

    torchrun --nproc_per_node 2 launch/train_ds.py --ds-config configs/ds_zero2_coat.json --model tinyllama-1b
    deepspeed --num_gpus 2 launch/train_ds.py --ds-config configs/ds_zero2_coat.json
    python launch/train_ds.py --ds-config configs/ds_zero2_coat.json --model tiny --steps 20     # CPU smoke run

Prints per step: loss (mean over ranks), step time, tokens/s; after the first step the optimizer-state bytes of
every rank; at the end peak memory per rank and a JSON summary line (`SUMMARY {...}`: also the median time of
`engine.step()` alone and rank 0's peak CPU resident set, which holds the optimizer states under ZeRO-Offload). `--csv`
writes the curve. `--profile-step STEP [--profile-out DIR]` runs that step under torch.profiler and writes, per rank,
its chrome trace and a table of the host ops by self CPU time with the step's kernel launch count (the step is left
out of the timing medians): where a host-bound step's time goes. `--probe-step STEP` (repeatable) runs that step's
micro-batch, before its forward, through the model and through the same weights unconverted and prints `PROBE {...}`
(rank 0; launch/fp8_probe.py): where FP8 activations change the forward, and what a per-tensor E4M3 scale does to
each GEMM input.
The optimizer, ZeRO stage and precision come from the DeepSpeed config; this script only sets the batch sizes
(`--global-batch` sequences per step, split over the data-parallel ranks) and, with `--lr`, the peak learning rate.

Batches (`--batching`, launch/batches.py): `fixed` (default) samples of --seq-len tokens; `padded` samples of lengths
drawn in [--min-len, --seq-len], padded to the longest of each micro-batch (DataCollatorWithPadding); `packed` rows of
--seq-len tokens packed with such samples, position ids restarting at each (DataCollatorWithFlattening per row).
tokens/s counts real tokens (not padding).

Data (`--data`, launch/token_data.py): `bigram` (default), sequences from a fixed random bigram language (each token
has 8 possible successors with Zipf weights, about 1.7 nats of entropy); `corpus`, windows of real text: the Python
standard library's sources and documentation (launch.corpus: BPE 8192, built once and cached; needs a model
vocabulary of at least 8192). Either is a deterministic function of (seed, global sample index): with the same
--global-batch, runs on 1 and on 2 GPUs see identical global batches, so their loss curves are comparable step by
step.

Checkpoints (DeepSpeed's own `save_checkpoint` / `load_checkpoint`):
    --save-dir DIR [--save-at STEP]   after step STEP (default: the last, --steps) save DIR/stepSTEP; the client state
                                      holds DeepSpeed's universal-checkpoint info (so `python -m coat_ds.to_universal`
                                      can convert it) and this script's position in the data (step, samples, seed,
                                      sequence length, model)
    --resume DIR[:TAG]                load DIR/TAG (without TAG: the tag DIR/latest names, DIR/latest_universal with
                                      --universal) and go on with the step after the saved one, up to --steps; the
                                      data continue at the saved sample index, so the resumed run sees the batches the
                                      uninterrupted one saw, and the printout and --csv carry the true step numbers
    --universal                       load a universal checkpoint (`"checkpoint": {"load_universal": true}`): the
                                      way to resume on another number of ranks; --global-batch is split over them,
                                      so keep it as saved to see the same batches
A rigid checkpoint loads only on the number of ranks it was saved on; convert it first:
    python -m coat_ds.to_universal --input_folder DIR/step100 --output_folder DIR/step100_universal
    torchrun --nproc_per_node 1 launch/train_ds.py ... --resume DIR:step100_universal --universal
A missing directory or tag, a rigid checkpoint of another rank count, a universal folder without --universal (or the
reverse), another --seed or --seq-len than saved, or --save-at / --profile-step outside the steps this run trains is
an error before training. `--deterministic` makes GPU runs bit-reproducible (flash attention's backward accumulates
with atomics otherwise): a run resumed on as many ranks repeats the uninterrupted one's losses bit for bit (--csv
writes them exactly). On another number of ranks the losses differ a little, as a run on that many ranks from the
start would: FP8 activation scales are per micro-batch, gradients are summed in another order, and the optimizer's
FP8 groups are cut at other partition edges.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # run as a script: `launch` importable
from launch import batches, ds_memory  # noqa: E402
from launch.model_shapes import MODELS, build_model, decoder_layer_classes, params_label  # noqa: E402
from launch.step_profile import start_profiler, write_profile  # noqa: E402
from launch.token_data import BigramData, CorpusData  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ds-config", required=True, help="DeepSpeed config JSON (optimizer, ZeRO stage, precision)")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step, over all data-parallel ranks")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (overrides the config's)")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=None,
                   help="ZeRO stage (overrides the config's zero_optimization.stage)")
    p.add_argument("--zero", action="append", default=[], metavar="KEY=VALUE", type=zero_option,
                   help="set zero_optimization.KEY to VALUE (JSON: true, 5e7, ...) over the config's; repeatable, "
                        'e.g. --zero contiguous_gradients=false (the stage: --zero-stage)')
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", choices=("bigram", "corpus"), default="bigram",
                   help="synthetic bigram sequences, or the standard library corpus (real text)")
    p.add_argument("--batching", choices=batches.BATCHING, default="fixed",
                   help="fixed-length samples, samples of varying length padded to the longest of each micro-batch "
                        "(DataCollatorWithPadding), or rows packed with samples of varying length "
                        "(DataCollatorWithFlattening per row); launch/batches.py")
    p.add_argument("--min-len", type=int, default=None,
                   help="padded / packed: sample lengths are drawn uniformly from [min-len, seq-len] "
                        "(default seq-len // 2)")
    p.add_argument("--pad-to-multiple-of", type=int, default=1,
                   help="padded: round each micro-batch's length up to a multiple of this (FP8 GEMMs of torchao "
                        "need 16)")
    p.add_argument("--csv", default=None, help="write step,loss,step_s,tokens_per_s here (rank 0; loss exact)")
    p.add_argument("--label", default=None, help="name of the run in the summary")
    p.add_argument("--compile-layers", action="store_true", help="torch.compile each decoder layer (in place)")
    p.add_argument("--grad-checkpointing", action="store_true",
                   help="Hugging Face gradient checkpointing (each decoder layer recomputed in backward)")
    p.add_argument("--torchao-float8", action="store_true",
                   help="torchao convert_to_float8_training (tensorwise; lm_head excluded) before DeepSpeed")
    p.add_argument("--save-dir", default=None, help="save a DeepSpeed checkpoint here (tag stepSTEP)")
    p.add_argument("--save-at", type=int, default=None,
                   help="the step after which to save (1-based; default: the last step); needs --save-dir")
    p.add_argument("--resume", default=None, metavar="DIR[:TAG]",
                   help="continue from a DeepSpeed checkpoint (TAG default: the one DIR/latest names)")
    p.add_argument("--universal", action="store_true",
                   help="--resume loads a universal checkpoint (coat_ds.to_universal): any number of ranks")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms: bit-reproducible GPU runs (slower attention backward)")
    p.add_argument("--profile-step", type=int, default=None, metavar="STEP",
                   help="profile this step (counted from the start of training) with torch.profiler; it is left out "
                        "of the timing medians")
    p.add_argument("--profile-out", default="profile",
                   help="where --profile-step writes rankR_stepS.json.gz (chrome trace) and rankR_stepS_host_ops.txt")
    p.add_argument("--probe-step", type=int, action="append", default=[], metavar="STEP",
                   help="before this step's forward, run its micro-batch through the model and through the same "
                        "weights unconverted (launch/fp8_probe.py) and print PROBE {json} (rank 0); repeatable")
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = p.parse_args(argv)
    check_checkpoint_args(p, args)
    if args.min_len is None:
        args.min_len = max(1, args.seq_len // 2)
    if not 1 <= args.min_len <= args.seq_len:
        p.error(f"--min-len {args.min_len} must be between 1 and --seq-len {args.seq_len}")
    if args.profile_step is not None and not 1 <= args.profile_step <= args.steps:
        p.error(f"--profile-step {args.profile_step} is not one of the steps 1..{args.steps} this run trains")
    for step in args.probe_step:
        if not 1 <= step <= args.steps:
            p.error(f"--probe-step {step} is not one of the steps 1..{args.steps} this run trains")
    return args


def zero_option(text: str) -> tuple:
    """KEY=VALUE of --zero, VALUE parsed as JSON."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    if key == "stage":
        raise argparse.ArgumentTypeError("the ZeRO stage is set with --zero-stage")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"the value of {key} is not JSON (true, false, a number, ...): "
                                         f"{value!r}") from None


def check_checkpoint_args(parser, args):
    """Checkpoint flags that cannot work together fail here, before anything is built."""
    if args.save_at is not None and args.save_dir is None:
        parser.error("--save-at needs --save-dir (where to save)")
    if args.save_dir is not None:
        if args.save_at is None:
            args.save_at = args.steps
        if not 1 <= args.save_at <= args.steps:
            parser.error(f"--save-at {args.save_at} is not one of the steps 1..{args.steps} this run trains "
                         "(--steps counts from the start of training, also when resuming)")
    if args.universal and args.resume is None:
        parser.error("--universal says how to load --resume DIR[:TAG]: give --resume")


def load_config(args, world: int) -> dict:
    with open(args.ds_config) as f:
        config = json.load(f)
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of the {world} ranks")
    config.update(train_batch_size=args.global_batch, train_micro_batch_size_per_gpu=args.global_batch // world,
                  gradient_accumulation_steps=1)
    if args.zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    if args.zero:
        config.setdefault("zero_optimization", {}).update(args.zero)
    if args.universal:
        config.setdefault("checkpoint", {})["load_universal"] = True
    if args.lr is not None:
        config["optimizer"]["params"]["lr"] = args.lr
        if "scheduler" in config and "warmup_max_lr" in config["scheduler"].get("params", {}):
            config["scheduler"]["params"]["warmup_max_lr"] = args.lr
    return config


def checkpoint_to_resume(spec: str, universal: bool, world: int) -> tuple[str, str]:
    """(DIR, TAG) of `--resume DIR[:TAG]`, checked on disk: the tag folder exists and is of the kind --universal
    says; a rigid checkpoint was saved by `world` ranks. Raises SystemExit naming what is wrong and what to do."""
    directory, tag = spec, None
    head, sep, tail = spec.rpartition(":")
    if sep and head and tail and os.sep not in tail:
        directory, tag = head, tail
    if not os.path.isdir(directory):
        raise SystemExit(f"--resume {spec}: there is no checkpoint directory {directory}")
    tags = sorted(d for d in os.listdir(directory) if os.path.isdir(os.path.join(directory, d)))
    if tag is None:
        latest = os.path.join(directory, "latest_universal" if universal else "latest")
        if not os.path.isfile(latest):
            raise SystemExit(f"--resume {spec}: {latest} does not exist, so no tag is the latest; name one "
                             f"(--resume {directory}:TAG) among {tags}")
        with open(latest) as f:
            tag = f.read().strip()
    folder = os.path.join(directory, tag)
    if not os.path.isdir(folder):
        raise SystemExit(f"--resume {spec}: there is no checkpoint {folder}; tags in {directory}: {tags}")
    is_universal = os.path.isdir(os.path.join(folder, "zero"))
    convert = (f"python -m coat_ds.to_universal --input_folder {folder} --output_folder {folder}_universal, then "
               f"--resume {directory}:{tag}_universal --universal")
    if universal and not is_universal:
        raise SystemExit(f"--resume {spec} --universal: {folder} is not a universal checkpoint (no zero/ folder); "
                         f"convert it: {convert}, or drop --universal to load it as saved")
    if not universal:
        if is_universal:
            raise SystemExit(f"--resume {spec}: {folder} is a universal checkpoint; add --universal")
        shards = [f for f in os.listdir(folder) if "zero_pp_rank_" in f and f.endswith("_optim_states.pt")]
        if shards and len(shards) != world:
            raise SystemExit(f"--resume {spec}: saved on {len(shards)} data-parallel ranks, this run has {world}; a "
                             f"DeepSpeed checkpoint loads as saved only on as many ranks: convert it: {convert}")
    return directory, tag


def main(argv=None):
    args = parse_args(argv)
    import deepspeed
    import deepspeed.comm as dist

    import coat_ds  # noqa: F401  (registers "CoatFP8AdamW"; the installed .pth hook would do it too)
    from coat_ds.deepspeed_plugin import optimizer_state_report

    if args.deterministic:
        make_deterministic()
    if torch.cuda.is_available():
        torch.cuda.set_device(args.local_rank)
        device = torch.device("cuda", args.local_rank)
    else:
        device = torch.device("cpu")
        if os.environ.get("COAT_DS_SKIP_SHM_BUILD", "1") == "1":  # see docs/deepspeed.md: an 11-minute C++ build
            import importlib
            importlib.import_module("deepspeed.comm.torch")
            sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    single = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    for key, value in single.items():
        os.environ.setdefault(key, value)  # plain `python launch/train_ds.py`: one rank, no launcher
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    resume = checkpoint_to_resume(args.resume, args.universal, world) if args.resume else None
    config = load_config(args, world)
    if args.probe_step and config.get("zero_optimization", {}).get("stage", 0) == 3:
        raise SystemExit("--probe-step needs the whole weights on rank 0, which ZeRO-3 partitions: use stage 1 or 2")
    model = build_model(args.model, args.seq_len, device, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    apply_peer_options(model, args)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    layers = decoder_layer_classes(model)  # after the "coat" section converted them: Coat<Layer> classes
    position = dict(step=0, samples=0, seed=args.seed, seq_len=args.seq_len, data=args.data, model=args.model)
    if resume:
        position = load_checkpoint(engine, *resume, args, rank)
    first_step = position["step"]
    data = (CorpusData if args.data == "corpus" else BigramData)(model.config.vocab_size, args.seq_len, args.seed)
    micro = args.global_batch // world
    tokens_per_step = args.global_batch * args.seq_len
    label = args.label or os.path.splitext(os.path.basename(args.ds_config))[0]
    if rank == 0:
        print(f"[train_ds] {label}: {args.model} ({type(model).__name__}, {params_label(n_params)}; decoder layers "
              f"{', '.join(f'{n} x{c}' for n, c in layers.items())}), {world} rank(s), global batch "
              f"{args.global_batch} x {args.seq_len}, optimizer {type(engine.basic_optimizer).__name__} in "
              f"{type(engine.optimizer).__name__}, device "
              f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}",
              flush=True)

    rows, step_times, optimizer_times, host_times, real_tokens = [], [], [], [], []
    csv = open_csv(args.csv) if rank == 0 and args.csv else None
    memory = {}
    for step in range(first_step, args.steps):
        first_sample = position["samples"] + (step - first_step) * args.global_batch
        batch = batches.micro_batch(data, args.batching, first_sample + rank * micro, micro, args.seq_len,
                                    args.min_len, args.seed, args.pad_to_multiple_of)
        step_tokens = torch.tensor(float(batch.pop("real_tokens")), device=device)
        dist.all_reduce(step_tokens)
        batch = {k: v.to(device) for k, v in batch.items()}
        sync(device)
        if step == first_step + 1 and device.type == "cuda":  # model states are all allocated after the first step
            memory["before_forward"] = torch.cuda.memory_allocated(device)
            memory["first_step_peak"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        if step + 1 in args.probe_step and rank == 0:
            print("PROBE " + json.dumps(dict(step=step + 1, **probe(engine.module, batch, args, device))),
                  flush=True)
        profiler = start_profiler(device) if step + 1 == args.profile_step else None
        phases = device.type == "cuda" and step + 1 == args.steps  # the last step: peak memory per phase
        if phases:
            sync(device)
            memory["phase_base"] = torch.cuda.memory_allocated(device)
            memory["peak_before_phases"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        loss = engine(**batch).loss
        if phases:
            memory["forward_peak"] = torch.cuda.max_memory_allocated(device)
        engine.backward(loss)
        host_s = time.perf_counter() - start  # until the host has issued forward and backward
        sync(device)
        if phases:
            memory["backward_peak"] = torch.cuda.max_memory_allocated(device)
        optimizer_start = time.perf_counter()
        engine.step()
        sync(device)
        if phases:
            memory["step_phase_peak"] = torch.cuda.max_memory_allocated(device)
        optimizer_s = time.perf_counter() - optimizer_start
        step_s = time.perf_counter() - start
        if profiler is not None:
            write_profile(profiler, args.profile_out, rank, step + 1, host_s)
        else:
            host_times.append(host_s)
            optimizer_times.append(optimizer_s)
            step_times.append(step_s)
            real_tokens.append(step_tokens.item())
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss)
        mean_loss = mean_loss.item() / world
        rows.append((step + 1, mean_loss, step_s, step_tokens.item() / step_s))
        if csv:
            csv.write("%d,%r,%.6f,%.1f\n" % rows[-1])  # the loss as Python prints it: the exact value
            csv.flush()
        if step == first_step:
            report_state(engine, optimizer_state_report, rank, world, dist)
        if rank == 0 and (step < first_step + 5 or (step + 1) % 10 == 0 or step + 1 == args.steps):
            print(f"[train_ds] step {step + 1:5d}  loss {mean_loss:.4f}  step {step_s * 1e3:8.1f} ms  "
                  f"{step_tokens.item() / step_s:9.0f} tokens/s", flush=True)
        if args.save_dir and step + 1 == args.save_at:
            save_checkpoint(engine, args, dict(position, step=step + 1, samples=first_sample + args.global_batch),
                            rank)

    if "before_forward" in memory:
        memory["step_peak"] = max(torch.cuda.max_memory_allocated(device), memory.get("peak_before_phases", 0))
    reserved = [None] * world
    dist.all_gather_object(reserved, torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0)
    peaks = [None] * world
    dist.all_gather_object(peaks, max(ds_memory.peak_memory_bytes(device), memory.get("first_step_peak", 0),
                                      memory.get("peak_before_phases", 0)))
    states = [None] * world
    dist.all_gather_object(states, optimizer_state_report(engine))
    model_states = ds_memory.model_state_bytes(engine, device)
    if rank == 0:
        first_steady = min(10, len(step_times) // 2)
        steady = step_times[first_steady:]
        median_s = statistics.median(steady)
        # fixed: the median step's tokens/s; varying lengths: real tokens per second of the median time per real
        # token (robust, like the median step, to the steps that compile or capture graphs for a new length)
        tokens_per_s = (tokens_per_step / median_s if args.batching == "fixed" else 1.0 / statistics.median(
            t / n for t, n in zip(steady, real_tokens[first_steady:])))
        summary = dict(label=label, model=args.model, model_class=type(model).__name__, decoder_layers=layers,
                       params=n_params, ranks=world, global_batch=args.global_batch,
                       seq_len=args.seq_len, data=args.data, batching=args.batching, min_len=args.min_len,
                       steps=args.steps, first_step=first_step + 1,
                       optimizer=states[0]["optimizer"], grad_checkpointing=args.grad_checkpointing,
                       first_loss=rows[0][1], final_loss=rows[-1][1],
                       mean_loss_last10=statistics.fmean(r[1] for r in rows[-10:]),
                       median_step_ms=median_s * 1e3, tokens_per_s=tokens_per_s,
                       real_tokens_per_step=statistics.fmean(real_tokens[first_steady:]),
                       median_optimizer_step_ms=statistics.median(optimizer_times[min(10, len(step_times) // 2):])
                       * 1e3,
                       median_fwd_bwd_host_ms=statistics.median(host_times[min(10, len(step_times) // 2):]) * 1e3,
                       cpu_peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
                       peak_memory_gib=[b / 2 ** 30 for b in peaks],
                       peak_reserved_gib=[b / 2 ** 30 for b in reserved],
                       last_step_phase_peaks_gib={k: memory[k] / 2 ** 30 for k in (
                           "phase_base", "forward_peak", "backward_peak", "step_phase_peak") if k in memory},
                       optimizer_state_bytes=[s["state_bytes"] for s in states],
                       stepped_numel=[s["stepped_numel"] for s in states],
                       state_bytes_per_element=[round(s["bytes_per_element"], 4) for s in states],
                       memory_breakdown_gib=ds_memory.breakdown(
                           memory, model_states, 0 if ds_memory.offloaded(config) else states[0]["state_bytes"]))
        for r in range(world):
            print(f"[train_ds] rank {r}: peak memory {peaks[r] / 2 ** 30:.2f} GiB, optimizer state "
                  f"{states[r]['state_bytes'] / 2 ** 30:.3f} GiB", flush=True)
        print("SUMMARY " + json.dumps(summary), flush=True)
    if csv:
        csv.close()
    dist.barrier()
    dist.destroy_process_group()


def probe(model, batch: dict, args, device) -> dict:
    """launch.fp8_probe.probe_batch against the same weights in an unconverted model of --model."""
    from launch import fp8_probe

    # build_model seeds torch's generators: the run's random state stays as it was
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        reference = fp8_probe.reference_model(model, lambda: build_model(args.model, args.seq_len, device, args.seed))
    try:
        return fp8_probe.probe_batch(model, reference, batch)
    finally:
        del reference
        if device.type == "cuda":
            torch.cuda.empty_cache()


def make_deterministic():
    """Deterministic torch kernels (flash attention's backward then runs without atomics; cuBLAS needs a fixed
    workspace for that, set before its first handle). Memory torch allocates stays uninitialized, as it is
    without this mode: buffers DeepSpeed pads are not filled with NaN."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False


def save_checkpoint(engine, args, position: dict, rank: int):
    """DIR/stepSTEP by DeepSpeed, with the universal-checkpoint info (for coat_ds.to_universal) and where the data
    stand (for --resume)."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    tag = f"step{position['step']}"
    start = time.perf_counter()
    engine.save_checkpoint(args.save_dir, tag=tag, client_state={UNIVERSAL_CHECKPOINT_INFO: {}, "train_ds": position})
    if rank == 0:
        print(f"[train_ds] saved step {position['step']} to {os.path.join(args.save_dir, tag)} in "
              f"{time.perf_counter() - start:.1f} s", flush=True)


def load_checkpoint(engine, directory: str, tag: str, args, rank: int) -> dict:
    """Load DIR/TAG into the engine (weights, optimizer states, LR scheduler, step counters) and return where the
    data stand: the saved step and sample count. The run must draw the same data (seed, sequence length, --data)
    and have steps left to train; otherwise SystemExit says what differs. (Another --model fails in DeepSpeed's
    load.)"""
    start = time.perf_counter()
    load_path, client_state = engine.load_checkpoint(directory, tag=tag)
    if load_path is None:
        raise SystemExit(f"--resume: DeepSpeed loaded nothing from {os.path.join(directory, tag)}")
    saved = client_state.get("train_ds") or dict(step=engine.global_steps, samples=engine.global_samples)
    for key in ("seed", "seq_len", "data"):
        if key in saved and saved[key] != getattr(args, key):
            flag = "--" + key.replace("_", "-")
            raise SystemExit(f"--resume {directory}:{tag} was saved with {flag} {saved[key]}, this run has "
                             f"{getattr(args, key)}: pass {flag} {saved[key]} to continue the same training")
    if saved["step"] >= args.steps:
        raise SystemExit(f"--resume {directory}:{tag} is at step {saved['step']}: nothing to train up to --steps "
                         f"{args.steps} (--steps counts from the start of training)")
    if args.save_dir and args.save_at <= saved["step"]:
        raise SystemExit(f"--save-at {args.save_at} is not after step {saved['step']}, where --resume starts")
    if args.profile_step is not None and args.profile_step <= saved["step"]:
        raise SystemExit(f"--profile-step {args.profile_step} is not after step {saved['step']}, where --resume "
                         "starts")
    if rank == 0:
        print(f"[train_ds] resumed from {load_path} (step {saved['step']}, {saved['samples']} samples) in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    return dict(saved, seed=args.seed, seq_len=args.seq_len, data=args.data, model=args.model)


def apply_peer_options(model, args):
    """The options a Hugging Face user would reach for, applied before DeepSpeed wraps the model."""
    if args.grad_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # transformers releases before the rename
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.torchao_float8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn != "lm_head")
    if args.compile_layers or args.torchao_float8:
        for layer in model.model.layers:
            layer.compile()


def open_csv(path):
    """The loss curve, written row by row (a run cut short still leaves its curve)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    f = open(path, "w")
    f.write("step,loss,step_s,tokens_per_s\n")
    return f


def report_state(engine, optimizer_state_report, rank, world, dist):
    reports = [None] * world
    dist.all_gather_object(reports, optimizer_state_report(engine))
    if rank == 0:
        for r, rep in enumerate(reports):
            print(f"[train_ds] rank {r}: {rep['optimizer']} state {rep['state_bytes']:,} bytes for "
                  f"{rep['stepped_numel']:,} elements = {rep['bytes_per_element']:.3f} bytes/element", flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
