"""Megatron's full-iteration CUDA graph (`--cuda-graph-impl full_iteration`): the eager warm-up's cached memory is
released before the capture.

megatron.core.full_cuda_graph.FullCudaGraphWrapper runs `cuda_graph_warmup_steps` iterations eagerly, then captures
the next one into a private memory pool. The blocks the eager iterations freed stay reserved by PyTorch's caching
allocator for the default pool, where the capture cannot use them, so the captured iteration needs its activation
memory a second time: the capture runs out of memory at a micro-batch the eager iterations trained at.
`release_memory_before_capture()` makes the wrapper empty that cache right before the call that captures.
"""
from __future__ import annotations

import functools

import torch


def release_memory_before_capture() -> bool:
    """Wrap FullCudaGraphWrapper.__call__ (idempotent); False when this Megatron has no full-iteration graphs."""
    try:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    except ImportError:
        return False
    call = FullCudaGraphWrapper.__call__
    if getattr(call, "releases_memory_before_capture", False):
        return True

    @functools.wraps(call)
    def call_releasing_memory(self, *args, **kwargs):
        stage = "validation" if kwargs.get("forward_only") else "training"
        if FullCudaGraphWrapper.cuda_graph.get(stage) is None and self.curr_iter(stage) == self.cuda_graph_warmup_steps:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return call(self, *args, **kwargs)

    call_releasing_memory.releases_memory_before_capture = True
    FullCudaGraphWrapper.__call__ = call_releasing_memory
    return True
