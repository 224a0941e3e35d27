"""The main job: what COAT does on real text. A small Llama (Hugging Face `LlamaForCausalLM`) is trained twice from
one initialisation, on the same batches of the Python standard library's sources and docs (launch/corpus.py):

  BF16: bf16 autocast over fp32 master weights, torch.optim.AdamW;
  COAT: the same model converted with coat_hf.convert_to_coat (everything the decoder layers save for backward is
        FP8) and CoatFP8AdamW (both moments FP8).

At the end: one table (validation loss and perplexity of both, the relative gap, tokens/s, optimizer-state bytes, bytes
saved for backward measured on one micro-batch, peak GPU memory on a GPU) and a PNG of the curves, both in --out.
On a CPU-only machine a small default (a 0.6M-parameter Llama, 300 steps; the torch references of the FP8 kernels
and CoatFP8AdamW's C++ step, on as many threads as there are idle cores: launch.cpu_threads; in both arms the bf16
GEMMs run as fp32 GEMMs of the bf16 operands rounded once to bf16, torch's bf16 arithmetic at fp32 speed:
launch.bf16_gemms): the whole job in about 2 minutes on two cores of an AVX2-only CPU with one busy
(BENCHMARKS.md); with a GPU a bigger default and the Triton kernels.

    python -m launch.main [--steps N] [--device cpu|cuda] [--out runs/main] [--size small|gpu|parity] [--stdlib DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass

import torch

from launch import corpus as corpus_lib

SIZES = {  # model and run defaults
    # the CPU default: a 0.6M-parameter Llama, 300 steps of 4 x 128 tokens (both arms: BENCHMARKS.md's main-job
    # table); eager attention (bf16 GEMMs, fp32 softmax): torch's bf16 SDPA backward is a CPU step's slowest op
    "small": dict(hidden=128, layers=2, heads=4, kv_heads=2, ffn=352, vocab=1024, seq=128, batch=4, steps=300,
                  lr=3e-3, eval_every=60, eval_batches=8, attention="eager"),
    "gpu": dict(hidden=768, layers=12, heads=12, kv_heads=4, ffn=2048, vocab=8192, seq=1024, batch=8, steps=600,
                lr=1e-3, eval_every=100, eval_batches=16, attention="sdpa"),
    # the loss-parity model (launch/loss_parity.py): about 150M parameters, ~2.5 epochs of the corpus in 2,000 steps
    "parity": dict(hidden=1024, layers=12, heads=16, kv_heads=4, ffn=2816, vocab=8192, seq=512, batch=8, steps=2000,
                   lr=6e-4, eval_every=100, eval_batches=32, attention="sdpa"),
    # TinyLlama-1.1B's shape with the corpus vocabulary (1.0B parameters): launch/optimizer_parity.py's larger size
    "1b": dict(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=8192, seq=1024, batch=8, steps=500,
               lr=3e-4, eval_every=50, eval_batches=16, attention="sdpa"),
}


@dataclass
class ArmResult:
    name: str
    train: list  # (step, loss)
    val: list  # (step, loss)
    tokens_per_s: float
    optimizer_state_bytes: int
    saved_bytes: dict  # dtype -> bytes saved for backward by one micro-batch (parameters excluded)
    peak_gib: float | None
    seconds: float


def build_model(args, vocab, attention="sdpa"):
    """The Llama of `args`'s shape; `attention`: its attention backend (Hugging Face's attn_implementation)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, use_cache=False, attn_implementation=attention)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg)


def lr_at(step, args):
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))


def saved_for_backward(model, tokens, device):
    """Bytes saved for backward by one forward, by dtype; parameters and duplicate storages counted once / not."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, counts = set(), {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else None
        if ptr is not None and ptr not in params and ptr not in seen:
            seen.add(ptr)
            key = str(t.dtype).replace("torch.", "")
            counts[key] = counts.get(key, 0) + t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(device):
        out = model(input_ids=tokens, labels=tokens)
    del out
    return counts


def _autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def evaluate(model, batches, device):
    """Mean next-token loss over the validation windows (the model's own loss, as in training)."""
    model.eval()
    total = 0.0
    with torch.no_grad(), _autocast(device):
        for b in batches:
            b = b.to(device)
            total += model(input_ids=b, labels=b).loss.float().item()
    model.train()
    return total / len(batches)


ARMS = {  # arm -> label
    "bf16": "BF16",
    "coat_optim": "COAT optimizer",
    "coat_act": "COAT activations",
    "coat": "COAT",
    "torchao": "torchao float8",
}


def make_arm(arm, base, args, device):
    """(model, optimizer) of one arm, the model a copy of `base` on `device`. bf16: torch AdamW; coat_optim:
    CoatFP8AdamW; coat_act: the decoder layers on FP8 activations (convert_to_coat) with torch AdamW; coat: both;
    torchao: torchao's convert_to_float8_training (tensorwise scaling, LM head left in BF16) with torch AdamW."""
    from coat_hf import ActivationConfig, coat_runtime, convert_to_coat
    from coat_kernels.optim import CoatFP8AdamW

    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {sorted(ARMS)}")
    model = copy.deepcopy(base).to(device)
    if arm in ("coat_act", "coat"):
        # on a GPU each decoder layer replays CUDA graphs: this model is small enough for the host to be the limit
        model = convert_to_coat(model, ActivationConfig(cuda_graphs=device.type == "cuda"))
    if arm == "torchao":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda module, name: name != "lm_head")
    options = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if arm in ("coat_optim", "coat"):
        optimizer = CoatFP8AdamW(model.parameters(), **options)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **options,
                                      **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    if arm in ("coat_act", "coat"):
        coat_runtime(model).attach_optimizer(optimizer)
    return model, optimizer


def run_arm(name, model, optimizer, batches, val_batches, args, device, show_progress, on_eval=None,
            compile_layers=False):
    """Train `model` on `batches`, evaluating every args.eval_every steps; on_eval(train, val) after each;
    compile_layers: each decoder layer under torch.compile (after measuring what one forward saves)."""
    with bf16_gemm_route(args, device):
        return _run_arm(name, model, optimizer, batches, val_batches, args, device, show_progress, on_eval,
                        compile_layers)


def bf16_gemm_route(args, device):
    """On a CPU with --bf16-gemms fp32 (the default), the bf16 autocast GEMMs run as fp32 GEMMs of the same bf16
    operands rounded once to bf16 (launch.bf16_gemms: what torch's bf16 kernel computes, 10-35x faster on CPUs
    without bf16 instructions); with native, or on a GPU, torch's own bf16 kernels."""
    from launch.bf16_gemms import Bf16GemmsInFp32

    if args.bf16_gemms not in ("fp32", "native"):
        raise ValueError(f"--bf16-gemms must be fp32 or native, got {args.bf16_gemms!r}")
    return Bf16GemmsInFp32() if device.type == "cpu" and args.bf16_gemms == "fp32" else contextlib.nullcontext()


def _run_arm(name, model, optimizer, batches, val_batches, args, device, show_progress, on_eval, compile_layers):
    from tqdm import tqdm

    model.to(device).train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    saved = saved_for_backward(model, batches[0].to(device), device)
    if compile_layers:  # after the measurement: saved-tensor hooks would break the compiled graphs
        for layer in model.model.layers:
            layer.compile()
    train, val, train_seconds = [], [], 0.0
    bar = tqdm(range(args.steps), desc=f"{name:>4}", disable=not show_progress, dynamic_ncols=True)
    start = time.time()
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        tokens = batches[step].to(device)
        t0 = time.perf_counter()
        with _autocast(device):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        train_seconds += time.perf_counter() - t0
        train.append((step + 1, loss_value))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val.append((step + 1, evaluate(model, val_batches, device)))
            if on_eval is not None:
                on_eval(train, val)
        tokens_per_s = (step + 1) * tokens.numel() / train_seconds
        bar.set_postfix(loss=f"{loss_value:.3f}", val=f"{val[-1][1]:.3f}" if val else "-",
                        tok_s=f"{tokens_per_s:,.0f}")
    state = optimizer.state_bytes() if hasattr(optimizer, "state_bytes") else sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None
    return ArmResult(name, train, val, tokens_per_s, state, saved, peak, time.time() - start)


def add_run_args(ap, default_size, default_out):
    """Options shared by the main job and the loss-parity runs: device, size (each field overridable), seed,
    corpus source, output directory. default_size None: small on the CPU, gpu on CUDA."""
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=sorted(SIZES), default=default_size,
                    help="model and run defaults" + ("" if default_size else ": small on CPU, gpu on CUDA"))
    for key, value in SIZES["small"].items():
        ap.add_argument("--" + key.replace("_", "-"), type=type(value), default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stdlib", default=None, help="train on the .py files under this directory instead of this "
                                                  "Python's standard library (the pydoc topics stay)")
    ap.add_argument("--out", default=default_out)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--bf16-gemms", choices=("fp32", "native"), default="fp32",
                    help="on a CPU, how the bf16 autocast GEMMs run: fp32 (default) one fp32 GEMM of the bf16 operands "
                         "rounded once to bf16, torch's bf16 arithmetic 10-35x faster on CPUs without bf16 "
                         "instructions (launch/bf16_gemms.py); native: torch's bf16 kernels")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads (default: OMP_NUM_THREADS if set, else one per core left idle by other "
                         "processes, measured at start)")


def set_cpu_threads(args, device, omp_num_threads: str | None):
    """On a CPU run, set torch's thread count (launch.cpu_threads) and say why; returns the choice (None on CUDA)."""
    from launch.cpu_threads import ThreadChoice, choose_threads, idle_cores, usable_cores

    if device.type != "cpu":
        return None
    if args.threads is None and omp_num_threads:
        choice = ThreadChoice(torch.get_num_threads(), f"OMP_NUM_THREADS={omp_num_threads}")
    else:
        choice = choose_threads(args.threads, None if args.threads is not None else idle_cores(), usable_cores())
    torch.set_num_threads(choice.threads)
    print(f"CPU threads: {choice.threads} ({choice.reason}; --threads N to choose)", flush=True)
    return choice


def resolve_size(args):
    """Fill the size fields not given on the command line from the chosen size."""
    device = torch.device(args.device)
    for key, value in SIZES[args.size or ("gpu" if device.type == "cuda" else "small")].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return device


def prepare_data(args):
    """(corpus, one training batch per step, the fixed validation batches), all from args.seed."""
    data = corpus_lib.load(vocab_size=args.vocab, stdlib=args.stdlib)
    source = corpus_lib.Batches(data, args.seq, args.batch, seed=args.seed)
    return data, [source.train_batch() for _ in range(args.steps)], source.val_batches(args.eval_batches)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap, None, os.path.join("runs", "main"))
    args = ap.parse_args(argv)
    device = resolve_size(args)
    threads = set_cpu_threads(args, device, os.environ.get("OMP_NUM_THREADS"))
    args.threads = threads.threads if threads else None  # results.json records the count used
    warnings.filterwarnings("ignore", category=UserWarning)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    data, batches, val_batches = prepare_data(args)
    print(f"corpus ready in {time.time() - t0:.1f} s: {len(data.train):,} training tokens, {len(data.val):,} "
          f"validation tokens, vocabulary {data.vocab_size}; device {device}", flush=True)

    base = build_model(args, data.vocab_size, attention=args.attention)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"model: Llama, {n_params / 1e6:.2f}M parameters ({args.layers} layers, hidden {args.hidden}); "
          f"{args.steps} steps of {args.batch} x {args.seq} tokens", flush=True)
    results = []
    for arm in ("bf16", "coat"):
        model, optimizer = make_arm(arm, base, args, device)
        results.append(run_arm(ARMS[arm], model, optimizer, batches, val_batches, args, device,
                               not args.no_progress))
        del model, optimizer
    report(results, args, device, n_params, describe_machine(device, threads, time.time() - t0))


def describe_machine(device, threads, seconds) -> dict:
    """What results.json records besides the arguments: the device, on a CPU the threads, why (the idle cores
    measured at start) and the load average at the end; the whole job's wall time (launch.main_table reads it)."""
    if device.type == "cuda":
        return {"device": torch.cuda.get_device_name(device), "seconds": seconds}
    return {"device": "cpu", "cpu": torch.backends.cpu.get_cpu_capability(), "threads": threads.threads,
            "threads_reason": threads.reason, "load_average_at_end": list(os.getloadavg()), "seconds": seconds}


def report(results, args, device, n_params, machine):
    bf16, coat = results
    gap = (coat.val[-1][1] - bf16.val[-1][1]) / bf16.val[-1][1] * 100
    lines = ["| | BF16 + AdamW | COAT (FP8 activations + CoatFP8AdamW) |", "|---|---|---|"]

    def row(label, f):
        lines.append(f"| {label} | {f(bf16)} | {f(coat)} |")

    row("validation loss", lambda r: f"{r.val[-1][1]:.4f}")
    row("validation perplexity", lambda r: f"{math.exp(r.val[-1][1]):.2f}")
    lines.append(f"| gap (COAT vs BF16) | | {gap:+.2f}% |")
    row("tokens/s", lambda r: f"{r.tokens_per_s:,.0f}")
    row("optimizer state", lambda r: f"{r.optimizer_state_bytes / 2**20:.2f} MiB "
                                     f"({r.optimizer_state_bytes / n_params:.2f} B/param)")
    row("saved for backward (one micro-batch)",
        lambda r: f"{sum(r.saved_bytes.values()) / 2**20:.1f} MiB ("
                  + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(r.saved_bytes.items())) + ")")
    if device.type == "cuda":
        row("peak GPU memory", lambda r: f"{r.peak_gib:.2f} GiB")
    row("wall time (incl. evaluation)", lambda r: f"{r.seconds:.0f} s")
    if device.type == "cpu":
        lines.append(f"\nCPU, {args.threads} thread(s): COAT runs bit-exact torch emulations of its GPU kernels here "
                     "(FP8 rounding done in fp32 arithmetic) and CoatFP8AdamW's C++ step, so its tokens/s say nothing "
                     "about its speed on a GPU.")
    table = "\n".join(lines)
    print("\n" + table, flush=True)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(args=vars(args), parameters=n_params, machine=machine, results=[asdict(r) for r in results]),
                  f, indent=1)
    plot(results, os.path.join(args.out, "curves.png"))


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r, color in zip(results, ("C0", "C3")):
        steps, losses = zip(*r.train)
        window = max(1, len(losses) // 30)
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(steps, smooth, color=color, alpha=0.6, label=f"{r.name} train (smoothed)")
        ax.plot(*zip(*r.val), "o-", color=color, label=f"{r.name} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Llama on the Python standard library")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"curves: {path}", flush=True)


if __name__ == "__main__":
    main()
