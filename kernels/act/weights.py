"""FP8 weights, quantized once per optimizer step.

COAT quantizes weights per tensor to E4M3 with a just-in-time scale. A `WeightCache` (one per weight slot of a
module) keeps the row-major copy (forward GEMM operand) and the transposed copy (dgrad operand) made at one count of
a `StepClock`, and shares them between the micro-batches of a step and between forward and backward. The clock is
ticked by the optimizer (a post-step hook, `StepClock.attach`): training engines write updated weights through
`.data`, flat buffers or parameter gathers, none of which a tensor's version counter sees, so the step itself is the
signal. A cache is keyed by (clock count, shape, dtype, device): the weight may be a new tensor at every forward
(ZeRO-3 gathers) and still hit. After changing weights outside an optimizer step, call `StepClock.tick()` (or
`WeightCache.invalidate()`).

CUDA graphs: whether the current stream is capturing is part of the key, so the first use inside a capture always
quantizes, and the graph holds that quantization: each replay quantizes the weights it then finds (after a step, the
updated ones). Later uses at the same clock count inside captures (micro-batches, the backward) share those copies,
so graphs captured at one step are replayed in the order they were captured.

`WeightPieces`: one GEMM weight given as row blocks of several tensors (separate q/k/v or gate/up projections that
keep their own parameters): quantized as one tensor with one scale; concatenated only transiently, to quantize.
"""
from __future__ import annotations

import torch

from ..formats import E4M3
from .scaling import ScaleTickets
from .tensor_quant import cast, tensor_scale


class WeightPieces:
    """Row blocks [N_i, K] of one GEMM weight [sum N_i, K]."""

    def __init__(self, tensors):
        self.tensors = tuple(tensors)
        first = self.tensors[0]
        if any(t.dim() != 2 or t.shape[1] != first.shape[1] or t.dtype != first.dtype or t.device != first.device
               for t in self.tensors):
            raise ValueError("weight pieces must be 2-D with one in_features, dtype and device: got "
                             f"{[(tuple(t.shape), t.dtype, str(t.device)) for t in self.tensors]}")
        self.shape = (sum(t.shape[0] for t in self.tensors), first.shape[1])
        self.dtype, self.device = first.dtype, first.device
        self.rows = [t.shape[0] for t in self.tensors]

    def joined(self) -> torch.Tensor:
        """The whole weight (a transient copy when there are several pieces), detached."""
        if len(self.tensors) == 1:
            return self.tensors[0].detach()
        return torch.cat([t.detach() for t in self.tensors], 0)

    def split(self, grad: torch.Tensor) -> tuple:
        """The gradient of the whole weight as one gradient per piece."""
        return tuple(grad.split(self.rows, 0)) if len(self.tensors) > 1 else (grad,)


def as_pieces(weight) -> WeightPieces:
    return weight if isinstance(weight, WeightPieces) else WeightPieces(
        [weight] if isinstance(weight, torch.Tensor) else weight)


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
    """Per-tensor E4M3 copies of one weight made at one clock count: `w8` [N, K] (forward) and `w8_t` [K, N16]
    (dgrad), both with `scale`. Filled by `fill` in forward, so backward needs no BF16 weight."""

    def __init__(self, clock: StepClock):
        self.clock = clock
        self.invalidate()

    def invalidate(self) -> None:
        self._key = None
        self.scale = self.w8 = self.w8_t = None

    def _key_of(self, weight):
        capturing = weight.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        return (self.clock.count, tuple(weight.shape), weight.dtype, weight.device, capturing)

    def holds(self, weight, scale) -> bool:
        """Whether the cache still holds the quantization that produced `scale` (a later micro-batch's forward may
        have refilled it after a step)."""
        return self._key == self._key_of(weight) and self.scale is scale

    def fill(self, weight, use_triton: bool, tickets: ScaleTickets | None = None, transposed: bool = True):
        """Quantize `weight` (a tensor or WeightPieces) unless the cache holds this clock count's copies:
        -> (w8 [N, K], scale); with `transposed` the dgrad copy is made now too (from the same transient tensor)."""
        pieces = as_pieces(weight)
        key = self._key_of(pieces)
        if key != self._key:
            self.invalidate()
            whole = pieces.joined()
            self.scale = tensor_scale(whole, E4M3, use_triton, tickets)
            self.w8, self.w8_t = cast(whole, self.scale, E4M3, use_triton, write_t=transposed)
            self._key = key
        elif transposed and self.w8_t is None:
            _, self.w8_t = cast(pieces.joined(), self.scale, E4M3, use_triton, write_row=False, write_t=True)
        return self.w8, self.scale
