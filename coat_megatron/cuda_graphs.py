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
import types

import torch


class CallReleasingMemory:
    """FullCudaGraphWrapper.__call__: Megatron's (`original`), after emptying the cache when this call captures."""

    def __init__(self, original, graph_wrapper_class):
        self.original = original
        self.graph_wrapper_class = graph_wrapper_class  # holds the captured graphs per stage
        functools.update_wrapper(self, original)

    def __get__(self, wrapper, owner=None):
        return self if wrapper is None else types.MethodType(self, wrapper)

    def __call__(self, wrapper, *args, **kwargs):
        stage = "validation" if kwargs.get("forward_only") else "training"
        captures = self.graph_wrapper_class.cuda_graph.get(stage) is None
        if captures and wrapper.curr_iter(stage) == wrapper.cuda_graph_warmup_steps:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return self.original(wrapper, *args, **kwargs)


def release_memory_before_capture() -> bool:
    """Replace FullCudaGraphWrapper.__call__ (idempotent); False when this Megatron has no full-iteration graphs."""
    try:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    except ImportError:
        return False
    call = FullCudaGraphWrapper.__dict__["__call__"]
    if not isinstance(call, CallReleasingMemory):
        FullCudaGraphWrapper.__call__ = CallReleasingMemory(call, FullCudaGraphWrapper)
    return True
