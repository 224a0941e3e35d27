"""Time of NCCL collectives alone between the GPUs of one host, and their bus bandwidth (NCCL's definition: for
all-gather and reduce-scatter (n-1)/n of the larger buffer's bytes per second; for all-reduce 2(n-1)/n of the
buffer's). What a training step's collectives would take with nothing else running: compare a profile's collective
durations (`trace_summary.py` prints their minimum, median and maximum) with these to tell transfer time from one
rank waiting for another. Run with NCCL_DEBUG=INFO to see the transport NCCL picks (P2P, SHM, NET).

    torchrun --nproc_per_node 2 benchmarks/collective_bandwidth.py [--mib 64,1024] [--iters 10]
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist


def timed_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", default="64,1024", help="sizes of the per-rank input buffer, MiB, comma-separated")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    for mib in (int(m) for m in args.mib.split(",")):
        x = torch.ones(mib * 2**19, dtype=torch.bfloat16, device="cuda")  # mib MiB of bf16
        gathered = torch.empty(x.numel() * n, dtype=x.dtype, device="cuda")
        shard = torch.empty(x.numel() // n, dtype=x.dtype, device="cuda")
        size = mib * 2**20
        rows = (("all_gather", lambda: dist.all_gather_into_tensor(gathered, x), size * n, (n - 1) / n),
                ("reduce_scatter", lambda: dist.reduce_scatter_tensor(shard, x), size, (n - 1) / n),
                ("all_reduce", lambda: dist.all_reduce(x), size, 2 * (n - 1) / n))
        for name, fn, nbytes, factor in rows:
            ms = timed_ms(fn, args.iters)
            if rank == 0:
                print(f"{name:15s} {mib:6d} MiB per rank in, {n} ranks: {ms * 1e3:9.1f} us, bus bandwidth "
                      f"{factor * nbytes / ms / 1e6:6.0f} GB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
