"""DeepSpeed training of a Llama-style causal LM (built from a config, no downloads) on synthetic data.

    torchrun --nproc_per_node 2 launch/train_ds.py --ds-config configs/ds_zero2_coat.json --model tinyllama-1b
    deepspeed --num_gpus 2 launch/train_ds.py --ds-config configs/ds_zero2_coat.json
    python launch/train_ds.py --ds-config configs/ds_zero2_coat.json --model tiny --steps 20     # CPU smoke run

Prints per step: loss (mean over ranks), step time, tokens/s; after the first step the optimizer-state bytes of
every rank; at the end peak memory per rank and a JSON summary line (`SUMMARY {...}`: also the median time of
`engine.step()` alone and rank 0's peak CPU resident set, which holds the optimizer states under ZeRO-Offload). `--csv`
writes the curve.
The optimizer, ZeRO stage and precision come from the DeepSpeed config; this script only sets the batch sizes
(`--global-batch` sequences per step, split over the data-parallel ranks) and, with `--lr`, the peak learning rate.

Data: sequences from a fixed random bigram language (each token has 8 possible successors with Zipf weights, about
1.7 nats of entropy), a deterministic function of (seed, global sample index): with the same --global-batch, runs
on 1 and on 2 GPUs see identical global batches, so their loss curves are comparable step by step.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch

MODELS = {
    # TinyLlama 1.1B shape
    "tinyllama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4),
    # ~3B: Llama hidden 3072 (e.g. Llama-3.2-3B's width), 26 layers, GQA 24/8
    "llama-3b": dict(vocab_size=32000, hidden_size=3072, intermediate_size=8192, num_hidden_layers=26,
                     num_attention_heads=24, num_key_value_heads=8),
    # Llama-2-7B shape (32 layers, hidden 4096, 32 heads, MHA, SwiGLU 11008)
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}


class BigramData:
    """Synthetic token sequences: token t is followed by one of SUCCESSORS fixed random tokens, Zipf-weighted."""
    SUCCESSORS = 8

    def __init__(self, vocab: int, seq_len: int, seed: int):
        rng = np.random.default_rng(seed)
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        self.successors = rng.integers(0, vocab, size=(vocab, self.SUCCESSORS))
        weights = 1.0 / np.arange(1, self.SUCCESSORS + 1)
        self.cdf = np.cumsum(weights / weights.sum())

    def sequences(self, first_index: int, count: int) -> torch.Tensor:
        """int64 [count, seq_len + 1] for global sample indices first_index .. first_index + count - 1."""
        rngs = [np.random.default_rng((self.seed, first_index + i)) for i in range(count)]
        choices = np.stack([np.searchsorted(self.cdf, r.random(self.seq_len)) for r in rngs])
        out = np.empty((count, self.seq_len + 1), dtype=np.int64)
        out[:, 0] = [r.integers(0, self.vocab) for r in rngs]
        for t in range(self.seq_len):
            out[:, t + 1] = self.successors[out[:, t], choices[:, t]]
        return torch.from_numpy(out)


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
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--csv", default=None, help="write step,loss,step_s,tokens_per_s here (rank 0)")
    p.add_argument("--label", default=None, help="name of the run in the summary")
    p.add_argument("--compile-layers", action="store_true", help="torch.compile each decoder layer (in place)")
    p.add_argument("--grad-checkpointing", action="store_true",
                   help="Hugging Face gradient checkpointing (each decoder layer recomputed in backward)")
    p.add_argument("--torchao-float8", action="store_true",
                   help="torchao convert_to_float8_training (tensorwise; lm_head excluded) before DeepSpeed")
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return p.parse_args(argv)


def load_config(args, world: int) -> dict:
    with open(args.ds_config) as f:
        config = json.load(f)
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of the {world} ranks")
    config.update(train_batch_size=args.global_batch, train_micro_batch_size_per_gpu=args.global_batch // world,
                  gradient_accumulation_steps=1)
    if args.zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    if args.lr is not None:
        config["optimizer"]["params"]["lr"] = args.lr
        if "scheduler" in config and "warmup_max_lr" in config["scheduler"].get("params", {}):
            config["scheduler"]["params"]["warmup_max_lr"] = args.lr
    return config


def build_model(name: str, seq_len: int, device: torch.device, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**MODELS[name], max_position_embeddings=seq_len, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(seed)  # same initial weights on every rank
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # CPU: peak resident set


def main(argv=None):
    args = parse_args(argv)
    import deepspeed
    import deepspeed.comm as dist

    import coat_ds  # noqa: F401  (registers "CoatFP8AdamW"; the installed .pth hook would do it too)
    from coat_ds.deepspeed_plugin import optimizer_state_report

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
    config = load_config(args, world)
    model = build_model(args.model, args.seq_len, device, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    apply_peer_options(model, args)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    data = BigramData(model.config.vocab_size, args.seq_len, args.seed)
    micro = args.global_batch // world
    tokens_per_step = args.global_batch * args.seq_len
    label = args.label or os.path.splitext(os.path.basename(args.ds_config))[0]
    if rank == 0:
        print(f"[train_ds] {label}: {args.model} ({n_params / 1e9:.3f} B params), {world} rank(s), global batch "
              f"{args.global_batch} x {args.seq_len}, optimizer {type(engine.basic_optimizer).__name__} in "
              f"{type(engine.optimizer).__name__}, device "
              f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}",
              flush=True)

    rows, step_times, optimizer_times, host_times = [], [], [], []
    csv = open_csv(args.csv) if rank == 0 and args.csv else None
    memory = {}
    for step in range(args.steps):
        tokens = data.sequences(step * args.global_batch + rank * micro, micro).to(device)
        sync(device)
        if step == 1 and device.type == "cuda":  # model states are all allocated after the first step
            memory["before_forward"] = torch.cuda.memory_allocated(device)
            memory["first_step_peak"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        loss = engine(input_ids=tokens[:, :-1], labels=tokens[:, 1:].contiguous()).loss
        engine.backward(loss)
        host_times.append(time.perf_counter() - start)  # until the host has issued forward and backward
        sync(device)
        optimizer_start = time.perf_counter()
        engine.step()
        sync(device)
        optimizer_times.append(time.perf_counter() - optimizer_start)
        step_s = time.perf_counter() - start
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss)
        mean_loss = mean_loss.item() / world
        step_times.append(step_s)
        rows.append((step + 1, mean_loss, step_s, tokens_per_step / step_s))
        if csv:
            csv.write("%d,%.6f,%.6f,%.1f\n" % rows[-1])
            csv.flush()
        if step == 0:
            report_state(engine, optimizer_state_report, rank, world, dist)
        if rank == 0 and (step < 5 or (step + 1) % 10 == 0 or step + 1 == args.steps):
            print(f"[train_ds] step {step + 1:5d}  loss {mean_loss:.4f}  step {step_s * 1e3:8.1f} ms  "
                  f"{tokens_per_step / step_s:9.0f} tokens/s", flush=True)

    if "before_forward" in memory:
        memory["step_peak"] = torch.cuda.max_memory_allocated(device)
    peaks = [None] * world
    dist.all_gather_object(peaks, max(peak_memory_bytes(device), memory.get("first_step_peak", 0)))
    states = [None] * world
    dist.all_gather_object(states, optimizer_state_report(engine))
    model_states = model_state_bytes(engine, device)
    if rank == 0:
        steady = step_times[min(10, len(step_times) // 2):]
        median_s = statistics.median(steady)
        summary = dict(label=label, model=args.model, params=n_params, ranks=world, global_batch=args.global_batch,
                       seq_len=args.seq_len, steps=args.steps, optimizer=states[0]["optimizer"],
                       grad_checkpointing=args.grad_checkpointing,
                       first_loss=rows[0][1], final_loss=rows[-1][1],
                       mean_loss_last10=statistics.fmean(r[1] for r in rows[-10:]),
                       median_step_ms=median_s * 1e3, tokens_per_s=tokens_per_step / median_s,
                       median_optimizer_step_ms=statistics.median(optimizer_times[min(10, len(step_times) // 2):])
                       * 1e3,
                       median_fwd_bwd_host_ms=statistics.median(host_times[min(10, len(step_times) // 2):]) * 1e3,
                       cpu_peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
                       peak_memory_gib=[b / 2 ** 30 for b in peaks],
                       optimizer_state_bytes=[s["state_bytes"] for s in states],
                       stepped_numel=[s["stepped_numel"] for s in states],
                       state_bytes_per_element=[round(s["bytes_per_element"], 4) for s in states],
                       memory_breakdown_gib=breakdown(memory, model_states,
                                                      0 if offloaded(config) else states[0]["state_bytes"]))
        for r in range(world):
            print(f"[train_ds] rank {r}: peak memory {peaks[r] / 2 ** 30:.2f} GiB, optimizer state "
                  f"{states[r]['state_bytes'] / 2 ** 30:.3f} GiB", flush=True)
        print("SUMMARY " + json.dumps(summary), flush=True)
    if csv:
        csv.close()
    dist.barrier()
    dist.destroy_process_group()


def apply_peer_options(model, args):
    """The options a Hugging Face user would reach for, applied before DeepSpeed wraps the model."""
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.torchao_float8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn != "lm_head")
    if args.compile_layers or args.torchao_float8:
        for layer in model.model.layers:
            layer.compile()


def offloaded(config: dict) -> bool:
    """Whether ZeRO keeps the optimizer (master weights and states) in CPU memory or on NVMe."""
    return (config.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device", "none") != "none"


def model_state_bytes(engine, device: torch.device) -> dict:
    """Bytes of model states this rank holds on `device`, from the tensors themselves: the weights as DeepSpeed
    keeps them (bf16; this rank's partitions under ZeRO-3); the ZeRO master weights where they are tensors of their
    own (0 when offloaded, or when the optimizer steps the weights themselves: CoatFP8AdamW with master remainders);
    CoatFP8AdamW's master remainders (part of its optimizer state)."""
    def nbytes(t):
        return t.numel() * t.element_size()

    params = list(engine.module.parameters())
    shards = [p.ds_tensor if hasattr(p, "ds_tensor") else p for p in params]
    storages = {t.untyped_storage().data_ptr() for t in shards}
    wrapper = engine.optimizer
    masters = getattr(wrapper, "single_partition_of_fp32_groups", None) or \
        getattr(wrapper, "fp32_partitioned_groups_flat", None) or []
    remainders = [s["master_remainder"] for s in getattr(engine.basic_optimizer, "state", {}).values()
                  if "master_remainder" in s]
    return dict(weights=sum(nbytes(t) for t in shards if t.device == device),
                master_weights=sum(nbytes(m) for m in masters if m.device == device and m.numel()
                                   and m.untyped_storage().data_ptr() not in storages),
                master_remainders=sum(nbytes(r) for r in remainders if r.device == device))


def breakdown(memory: dict, model_states: dict, optimizer_state_bytes: int) -> dict:
    """Rank 0's GPU memory in GiB, measured before step 2's forward (what is held between steps) and at its peak:
    weights (model_state_bytes); optimizer state on the GPU (moments, metadata and master remainders; 0 when
    offloaded), of which master remainders; the other model states held between steps: master weights (a separate
    fp32 or bf16 partition, unless offloaded or stepped in place) and gradient and other buffers (the rest); what one
    step adds at its peak (activations saved for backward, gradients, logits, temporaries)."""
    if "before_forward" not in memory:
        return {}
    gib = 2.0 ** 30
    held = memory["before_forward"]
    rest = held - model_states["weights"] - optimizer_state_bytes
    return dict(weights=model_states["weights"] / gib, optimizer_state=optimizer_state_bytes / gib,
                master_remainders=model_states["master_remainders"] / gib, master_and_grad_buffers=rest / gib,
                master_weights=model_states["master_weights"] / gib,
                gradient_and_other_buffers=(rest - model_states["master_weights"]) / gib,
                step_transient=(memory["step_peak"] - held) / gib, step_peak=memory["step_peak"] / gib)


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
