"""Lending the memory of a model's CUDA-graph pool to work that runs between a backward and the next forward.

A model whose layers replay CUDA graphs keeps its activation memory reserved in the graphs' pool for the whole
training step; eager training frees the same memory after the backward, and the optimizer step's temporaries (a
ZeRO-1/2 step flattens each gradient partition into one new tensor, then makes a master-dtype copy of it) reuse it.
With graphs those temporaries would come on top of the pool. Between a backward and the next forward no replay is
pending and nothing in the pool has to survive (every replay rewrites its inputs and buffers), so the pool can lend
that memory:

    with lend(pool) as loan:           # loan is None when there is nothing to lend
        flat = loan.flatten(tensors, torch.float32) if loan else torch.cat(...)
        ...                            # every lent tensor must be gone when the block ends

`lend` first has every generation give its memory back to the pool, and lets go of cuBLAS's workspaces, what stays
allocated in the pool's large segments (the graphs keep writing all of it at their next replays), then
`PoolLoan.empty` / `PoolLoan.flatten` allocate from the pool's free blocks: on the pool's capture stream, since the
caching allocator keeps a pool's blocks per stream; the tensors are then used on the caller's stream, which they are
recorded on. A pool as the captures leave it is many segments (the allocator gives each large allocation its own),
where a large loan finds no free block big enough. So the first loan (the pool has no reserved size yet) drops the
pool instead: its memory goes back to the device, the loan's tensors come from ordinary memory, and the layers capture
anew at the next forward into one segment of max(the pool's size, the loan's size) reserved up front
(GraphPool.reserve_bytes), where every later loan fits. The step that sizes the pool thus needs no memory beyond the
pool's. A later loan larger than that segment takes new memory and has the pool grow the same way at the next step. A
lent tensor still referenced when the block ends would be overwritten by the next replay: the pool then drops its
graphs and captures anew at the next step (the tensor keeps the old memory), with one warning.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

from .graph_pool import GraphPool


def allocated_size(t: torch.Tensor) -> int:
    """The bytes the caching allocator takes for t's storage (it rounds every request up to 512 bytes)."""
    return -(-t.untyped_storage().nbytes() // 512) * 512


class PoolLoan:
    """Tensors allocated from a graph pool's free memory for the duration of one `lend` block."""

    def __init__(self, pool: GraphPool, sizing: bool = False):
        self.pool = pool
        self.sizing = sizing  # the pool was dropped to be sized: lend ordinary memory and count it
        self.lent: list = []  # weak references to every tensor lent
        self.bytes = 0  # lent so far
        self.outside = 0  # bytes of new segments the loans needed: what the pool could not lend in one piece

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised 1-D tensor in the pool's memory (ordinary memory while sizing), usable on the current
        stream."""
        if self.sizing:
            t = torch.empty(numel, dtype=dtype, device=device)
            self.bytes += allocated_size(t)
            return t
        user = torch.cuda.current_stream(device)
        stream = self.pool.capture_stream
        stream.wait_stream(user)
        reserved = torch.cuda.memory_reserved(device)
        with torch.cuda.stream(stream), torch.cuda.use_mem_pool(self.pool.memory):
            t = torch.empty(numel, dtype=dtype, device=device)
        self.outside += torch.cuda.memory_reserved(device) - reserved
        t.record_stream(user)
        self.lent.append(weakref.ref(t))
        self.bytes += allocated_size(t)
        return t

    def flatten(self, tensors, dtype: torch.dtype) -> torch.Tensor:
        """The tensors' elements one after the other, converted to `dtype`, in one lent tensor (torch's
        `_flatten_dense_tensors` followed by `.to(dtype)`, without the intermediate copy)."""
        tensors = list(tensors)
        out = self.empty(sum(t.numel() for t in tensors), dtype, tensors[0].device)
        offset = 0
        for t in tensors:
            out[offset:offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        return out

    def outstanding(self) -> int:
        """How many lent tensors are still referenced."""
        return sum(ref() is not None for ref in self.lent)


@contextmanager
def lend(pool: GraphPool):
    """A PoolLoan for the block (see the module docstring), or None when the pool has no graphs or a replay's
    backward is still pending."""
    if not pool.generations or pool.in_flight():
        yield None
        return
    if not pool.reserve_bytes:
        size = pool.segment_bytes()
        pool.reset()
        loan = PoolLoan(pool, sizing=True)
        try:
            yield loan
        finally:
            pool.reserve_bytes = max(size, loan.bytes)
        return
    pool.close_all()
    # cuBLAS's workspaces for the capture stream are what stays allocated in the pool's reserved segment, wherever
    # the captures placed them: let go of them (the graphs keep writing them as scratch at their replays, as they do
    # every block given back), or they would split the segment and no loan as large as it would fit. This clears
    # every stream's workspace; GEMMs outside the graphs make theirs anew from the allocator's cache
    torch._C._cuda_clearCublasWorkspaces()
    loan = PoolLoan(pool)
    try:
        yield loan
    finally:
        if loan.outstanding():
            pool.request_reset("a tensor lent from the pool outlived its loan")
            pool.warn_once("loan", f"coat-fp8: {loan.outstanding()} tensor(s) lent from the CUDA-graph pool outlived "
                           "the work they were lent to; the layers capture their graphs anew at the next step")
        elif loan.outside:
            # the loans outgrew the pool's reserved segment: capture anew into one segment as large as the pool or
            # the loans, whichever is larger
            pool.reserve_bytes = max(pool.segment_bytes() - loan.outside, loan.bytes, pool.reserve_bytes)
            pool.request_reset("the loans outgrew the pool's reserved segment")
