"""FP8 weights, quantized once per optimizer step.

COAT quantizes weights per tensor to E4M3 with a just-in-time scale. A `WeightCache` (one per weight slot of a
module) keeps the row-major copy (forward GEMM operand) and the transposed copy (dgrad operand) made at one count of
a `StepClock`, and shares them between the micro-batches of a step and between forward and backward. The clock is
ticked by the optimizer (a post-step hook, `StepClock.attach`): training engines write updated weights through
`.data`, flat buffers or parameter gathers, none of which a tensor's version counter sees, so the step itself is the
signal. A cache is keyed by (clock count, shape, dtype, device): the weight may be a new tensor at every forward
(ZeRO-3 gathers, a concatenation of several projection weights) and still hit. After changing weights outside an
optimizer step, call `StepClock.tick()` (or `WeightCache.invalidate()`).
"""
from __future__ import annotations

import torch

from ..formats import E4M3
from .scaling import ScaleTickets
from .tensor_quant import cast, tensor_scale


class StepClock:
    """Counts optimizer steps for the weight caches of one model."""

    def __init__(self):
        self.count = 0
        self._hooks = []

    @property
    def attached(self) -> bool:
        return bool(self._hooks)

    def tick(self) -> None:
        self.count += 1

    def attach(self, optimizer: torch.optim.Optimizer):
        """Tick after every `optimizer.step()` (a torch optimizer, or anything with `register_step_post_hook`);
        returns the hook handle."""
        handle = optimizer.register_step_post_hook(lambda *_: self.tick())
        self._hooks.append(handle)
        return handle


class WeightCache:
    """Per-tensor E4M3 copies of one weight made at one clock count: `rows` -> (w8 [N, K], scale), `transposed` ->
    (w8_t [K, N], scale); both with the same scale."""

    def __init__(self, clock: StepClock):
        self.clock = clock
        self.invalidate()

    def invalidate(self) -> None:
        self._key = None
        self.scale = self.w8 = self.w8_t = None

    def _key_of(self, weight):
        return (self.clock.count, tuple(weight.shape), weight.dtype, weight.device)

    def holds(self, weight, scale) -> bool:
        """Whether the cache still holds the quantization that produced `scale` (a later micro-batch's forward may
        have refilled it after a step)."""
        return self._key == self._key_of(weight) and self.scale is scale

    def _refresh(self, weight, use_triton, tickets):
        key = self._key_of(weight)
        if key != self._key:
            self.invalidate()
            self._key = key
            self.scale = tensor_scale(weight.detach(), E4M3, use_triton, tickets)

    def rows(self, weight, use_triton: bool, tickets: ScaleTickets | None = None):
        self._refresh(weight, use_triton, tickets)
        if self.w8 is None:
            self.w8, _ = cast(weight.detach(), self.scale, E4M3, use_triton)
        return self.w8, self.scale

    def transposed(self, weight, use_triton: bool, tickets: ScaleTickets | None = None):
        self._refresh(weight, use_triton, tickets)
        if self.w8_t is None:
            _, self.w8_t = cast(weight.detach(), self.scale, E4M3, use_triton, write_row=False, write_t=True)
        return self.w8_t, self.scale
