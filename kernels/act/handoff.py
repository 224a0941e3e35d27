"""The gradient-amax hand-off between FP8 blocks.

A backward kernel that produces a gradient (the norm backward's dx, RoPE's d(qkv), SwiGLU's d[gate | up]) computes
its stage-1 amaxes, and its E5M2 scale, from values it already holds. The block whose backward receives that very
tensor as its output gradient needs exactly that scale to quantize it for its GEMMs; `give` records it, `take`
returns it (once) to the consumer, which then skips its own amax pass over the gradient. Entries are matched by
tensor identity and version (an in-place change or a different tensor never reuses them) and held weakly, so a
gradient that nobody consumes does not keep anything alive. One hand-off object is shared by the blocks of a model
(a CoatRuntime holds it); blocks given none simply compute their own amax.
"""
from __future__ import annotations

import weakref

import torch

from .scaling import StageOneAmax


class GradientAmaxHandoff:
    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self._entries: list = []  # (weak reference to the gradient, its version, StageOneAmax)

    def give(self, grad: torch.Tensor, amax: StageOneAmax) -> None:
        self._entries = [e for e in self._entries[-(self.capacity - 1):] if e[0]() is not None]
        self._entries.append((weakref.ref(grad), grad._version, amax))

    def take(self, grad: torch.Tensor) -> StageOneAmax | None:
        for i, (ref, version, amax) in enumerate(self._entries):
            if ref() is grad:
                del self._entries[i]
                return amax if grad._version == version else None
        return None
