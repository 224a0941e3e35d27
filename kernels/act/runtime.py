"""CoatRuntime: the mutable state the FP8 blocks of one model share between calls.

- `tickets`: zeroed word pairs for kernels that finish their own per-tensor scale (scaling.ScaleTickets);
- `handoff`: gradient amaxes passed from the backward kernel that produced a gradient to the block that consumes
  it (handoff.GradientAmaxHandoff);
- `clock`: the optimizer-step count that keeps FP8 weight copies valid (weights.StepClock);
- `rope`: the cos/sin tables of the model's rotary embedding, made once for all its layers (rope.RopeTables);
- `graph_pool`: what the model's CUDA-graphed layers share (graph_pool.GraphPool).
One runtime per model: the modules of a model (a converted Hugging Face model, a Megatron GPT) are given the same
one; a module built without one gets its own (correct, but no hand-off between modules and no weight cache until
its clock is attached to the optimizer).
"""
from __future__ import annotations

import warnings

from .config import ActivationConfig
from .handoff import GradientAmaxHandoff
from .graph_pool import GraphPool
from .rope import RopeTables
from .scaling import ScaleTickets
from .weights import StepClock, WeightCache


class CoatRuntime:
    def __init__(self):
        self.tickets = ScaleTickets()
        self.handoff = GradientAmaxHandoff()
        self.clock = StepClock()
        self.rope = RopeTables()
        self.graph_pool = GraphPool()
        self._warned_unattached = False

    def attach_optimizer(self, optimizer):
        """Weights are re-quantized after each step of this (torch) optimizer, once for all micro-batches."""
        return self.clock.attach(optimizer)

    def new_weight_cache(self) -> WeightCache:
        return WeightCache(self.clock)

    def usable_cache(self, cache: WeightCache | None, config: ActivationConfig) -> WeightCache | None:
        """`cache` if the config caches weights and the clock knows when steps happen; else None (the block then
        quantizes its weight at every forward), with one warning per runtime that says how to attach the clock."""
        if cache is None or not config.cache_weights:
            return None
        if not self.clock.attached:
            if not self._warned_unattached:
                self._warned_unattached = True
                warnings.warn("coat-fp8: FP8 weights are quantized at every forward because no optimizer is attached "
                              "to this model's CoatRuntime; call runtime.attach_optimizer(optimizer) (the DeepSpeed "
                              "and Megatron integrations do) to quantize each weight once per optimizer step",
                              RuntimeWarning, stacklevel=3)
            return None
        return cache
