"""Where the memory of per-layer CUDA graphs goes, against eager COAT, on one GPU without DeepSpeed: a converted Llama
(TinyLlama 1.1B widths, --layers of them) trained with SGD at one micro-batch and length, then at more lengths.

Prints, per arm: the memory allocated between steps, what one step adds at its peak, the peak; for the graphs, the
pool's segments and what each generation holds by kind (the autograd graphs' saved tensors, buffers), counted once
per storage. With --sites, what is allocated at the end of the forward of step --sites-step (the graphs capture at
step 0), summed by the code that allocated it (the innermost frame in coat_hf / coat_kernels, else transformers),
the graph pool's blocks apart from ordinary memory.

    python benchmarks/graph_memory.py [--layers 4] [--micro-batch 8] [--seq 2048] [--lengths 1536,1792] [--sites]
"""
from __future__ import annotations

import argparse
import copy

import torch

from coat_hf import ActivationConfig, convert_to_coat
from coat_kernels.act.saved_tensors import saved_by_graph

GIB = 2.0 ** 30


def build(layers, seq):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=seq,
                      attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)


def replays(model) -> int:
    pool = model.coat_runtime.graph_pool
    return sum(c.replays for gen in pool.generations.values() for c in gen.order)


def allocation_sites(snapshot) -> dict:
    """(pool or ordinary memory, allocating site) -> GiB of the active blocks of a memory snapshot."""
    sites = {}
    for seg in snapshot["segments"]:
        where = "pool" if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0) else "ordinary"
        for block in seg["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = block.get("frames", [])
            ours = [f for f in frames if "coat_hf" in f["filename"] or "coat_kernels" in f["filename"]]
            pick = ours[:2] or [f for f in frames if "transformers" in f["filename"]][:1] or frames[:1]
            site = " < ".join(f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']}({f['name']})" for f in pick)
            sites[(where, site)] = sites.get((where, site), 0) + block["size"] / GIB
    return sites


def run(model, steps, batch, lengths, padded_row=False, sites_step=None):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for i in range(steps):
        n = lengths[i % len(lengths)]
        ids = torch.randint(0, 32000, (batch, n), device="cuda", generator=g)
        mask = torch.ones_like(ids)
        if padded_row:  # the last row 64 tokens shorter: a 4-D mask
            mask[-1, -64:] = 0
        before = replays(model) if model.coat_runtime.graph_pool.generations else 0
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if i == sites_step:
            torch.cuda.memory._record_memory_history(stacks="python")
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        if i == sites_step:
            sites = allocation_sites(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
            print(f"  allocated at the end of step {i}'s forward, by site (GiB, largest first):")
            for (where, site), gib in sorted(sites.items(), key=lambda kv: -kv[1])[:25]:
                print(f"    {gib:7.3f}  {where:8s}  {site}")
            pool = sum(v for (where, _), v in sites.items() if where == "pool")
            print(f"    total {sum(sites.values()):.3f} (pool {pool:.3f})")
        loss.backward()
        del loss
        end.record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        rows.append(dict(length=n, held=held / GIB, peak=torch.cuda.max_memory_allocated() / GIB,
                         reserved=torch.cuda.memory_reserved() / GIB, ms=start.elapsed_time(end),
                         replays=(replays(model) - before) if model.coat_runtime.graph_pool.generations else 0))
    return rows


def storages_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def held_by_kind(model) -> dict:
    pool = model.coat_runtime.graph_pool
    kinds = {}
    for gen in pool.generations.values():
        for name, owner in gen.held.items():
            kind = name if isinstance(name, str) else name[0]
            if kind == "graph":
                tensors = saved_by_graph(owner, skip_stale=True)
            else:
                tensors = owner if isinstance(owner, list) else [owner]
            kinds[kind] = kinds.get(kind, 0) + storages_bytes(tensors) / GIB
    kinds["pool segments"] = pool.segment_bytes() / GIB
    return kinds


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--lengths", default="1536,1792", help="then steps at these lengths too")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--mask", action="store_true", help="one row padded: a 4-D attention mask")
    p.add_argument("--sites", action="store_true", help="what the forward of --sites-step allocated, by site")
    p.add_argument("--sites-step", type=int, default=0, help="the step whose forward --sites traces (0: the "
                   "graphs' capture step)")
    args = p.parse_args()
    base = build(args.layers, args.seq)
    more = [int(n) for n in args.lengths.split(",") if n]
    for arm, options in (("coat eager", {}), ("coat graphs", {"cuda_graphs": True})):
        model = convert_to_coat(copy.deepcopy(base), ActivationConfig(cache_weights=False, **options))
        rows = run(model, args.steps, args.micro_batch, [args.seq], args.mask,
                   args.sites_step if args.sites else None)
        print(f"== {arm}, {args.layers} layers, micro-batch {args.micro_batch} x {args.seq}")
        for r in rows:
            print(f"  length {r['length']}: held {r['held']:.2f} GiB, step peak {r['peak']:.2f} (adds "
                  f"{r['peak'] - r['held']:.2f}), reserved {r['reserved']:.2f}, {r['ms']:.1f} ms, "
                  f"{r['replays']} layer replays")
        if options:
            print("  held by kind (GiB):", {k: round(v, 3) for k, v in held_by_kind(model).items()})
        if more:
            rows = run(model, len(more) * 2, args.micro_batch, more, args.mask)
            for r in rows:
                print(f"  length {r['length']}: held {r['held']:.2f}, peak {r['peak']:.2f}, reserved "
                      f"{r['reserved']:.2f}, {r['ms']:.1f} ms, {r['replays']} layer replays")
            if options:
                print("  held by kind after more lengths (GiB):",
                      {k: round(v, 3) for k, v in held_by_kind(model).items()})
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
