"""Can memory that a CUDA-graph pool holds between replays serve an optimizer step's temporaries?

A model whose layers replay CUDA graphs keeps its activation memory reserved in the graphs' private pool; an
optimizer step after backward then allocates its temporaries (DeepSpeed ZeRO-2: the flat fp32 gradient partition,
about 8 bytes per parameter) on top, where eager training reuses the freed activation memory. This measures, for a
stand-in layer (intermediates of `--act-mib` each, `--layers` graphs in one pool), the reserved memory after capture
and after one step-sized allocation of `--step-mib` made inside the pool (`torch.cuda.use_mem_pool`), with the pool
as the captures leave it, and with the pool's first segment reserved in one piece before capture (`--reserve`);
and whether the replays still compute the same bits afterwards. As in `coat_kernels.act.layer_graphs`, each output's
memory goes back to the pool once the next graph has been captured reading it (the graphs keep writing it).

    python benchmarks/graph_pool_reuse.py [--layers 8] [--act-mib 256] [--step-mib 4096]
"""
from __future__ import annotations

import argparse

import torch

from coat_kernels.act.graph_pool import unowned

MIB = 1 << 20


def layer(x, w):
    h = torch.relu(x @ w)   # intermediates the size of x: stand-ins for a layer's activations
    g = torch.sigmoid(h @ w)
    return (g * h) @ w


def run(layers: int, act_mib: int, step_mib: int, reserve_mib: int):
    torch.cuda.empty_cache()
    dim = 4096
    rows = act_mib * MIB // (dim * 2)
    torch.manual_seed(0)
    ws = [torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(layers)]
    x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
    pool = torch.cuda.MemPool()
    if reserve_mib:
        with torch.cuda.use_mem_pool(pool):
            block = torch.empty(reserve_mib * MIB, dtype=torch.uint8, device="cuda")
        del block
    base = torch.cuda.memory_reserved()
    graphs, outs = [], []
    inp = x
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w in ws:
            layer(inp, w)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    for w in ws:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool.id):
            out = layer(inp, w)
        graphs.append(g)
        if outs:  # the previous output is captured as this graph's input: its memory goes back to the pool
            outs[-1] = unowned(outs[-1])
        outs.append(out)
        inp = out
    torch.cuda.synchronize()
    after_capture = torch.cuda.memory_reserved()
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    reference = outs[-1].clone()  # (earlier outputs' memory is the pool's: later replays write there)
    with torch.cuda.use_mem_pool(pool):
        step = torch.empty(step_mib * MIB, dtype=torch.uint8, device="cuda")
        step.fill_(7)
    torch.cuda.synchronize()
    after_step = torch.cuda.memory_reserved()
    del step
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    same = torch.equal(outs[-1], reference)
    gib = 1 / (1 << 30)
    print(f"reserve {reserve_mib:6d} MiB | pool after capture {(after_capture - base) * gib:6.2f} GiB (reserved total "
          f"{after_capture * gib:6.2f}) | step of {step_mib} MiB in the pool grew reserved by "
          f"{(after_step - after_capture) * gib:5.2f} GiB | replays after the step give the same bits: {same}")
    del graphs, outs, reference, pool
    torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--act-mib", type=int, default=256)
    p.add_argument("--step-mib", type=int, default=4096)
    a = p.parse_args()
    run(a.layers, a.act_mib, a.step_mib, 0)
    run(a.layers, a.act_mib, a.step_mib, a.layers * a.act_mib * 4)


if __name__ == "__main__":
    main()
