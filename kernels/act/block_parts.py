"""What the FP8 block bodies (`block_bodies`) and their shells (`functional`, `fused_mlp`, `compiled_ops`) share:
the per-call environment resolved from a config and a runtime, the FP8 weight operands (from a WeightCache or
quantized now) and what backward keeps of them, and the dtype rules."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..formats import E4M3
from .config import ActivationConfig
from .handoff import GradientAmaxHandoff
from .scaling import ScaleTickets
from .tensor_quant import cast, quantize_tensor
from .weights import WeightPieces

DEFAULT_CONFIG = ActivationConfig()


class BlockEnv(NamedTuple):
    """What one block call needs of its config and runtime, resolved once per call (outside autograd's forward,
    where grad mode is off). The custom ops of the compiled path run with `plain_env`: no runtime state."""
    use_triton: bool
    fast_accum: bool
    tickets: ScaleTickets | None
    handoff: GradientAmaxHandoff | None
    grad_enabled: bool  # a backward may follow
    weight_t_in_forward: bool  # weight caches make the transposed copy in forward (else at the first backward)


def block_env(x, config, runtime) -> BlockEnv:
    config = config or DEFAULT_CONFIG
    return BlockEnv(config.use_triton(x), config.fprop_fast_accum, runtime.tickets if runtime else None,
                    runtime.handoff if runtime else None, torch.is_grad_enabled(),
                    config.transposed_weights == "forward")


def plain_env(use_triton: bool, fast_accum: bool = False) -> BlockEnv:
    """A block environment without runtime state (no tickets, no hand-off, no cache)."""
    return BlockEnv(use_triton, fast_accum, None, None, False, False)


def usable_cache(cache, config, runtime):
    if cache is None or runtime is None:
        return None
    return runtime.usable_cache(cache, config or DEFAULT_CONFIG)


def weight_rows(pieces: WeightPieces, cache, env):
    """(w8 [N, K], scale); a cache also makes the transposed copy now when a backward will need it and the config
    says so (transposed_weights="forward")."""
    if cache is not None:
        return cache.fill(pieces, env.use_triton, env.tickets,
                          transposed=env.grad_enabled and env.weight_t_in_forward)
    w8, _, scale = quantize_tensor(pieces.joined(), E4M3, env.use_triton, tickets=env.tickets)
    return w8, scale


class WeightLike:
    """What a block remembers of a GEMM weight for backward: shape, dtype, device, row blocks (not the tensors)."""

    def __init__(self, pieces: WeightPieces):
        self.shape, self.dtype, self.device, self.rows = pieces.shape, pieces.dtype, pieces.device, pieces.rows

    def split(self, grad):
        """The weight gradient [N, K] as one gradient per row block (None: no gradient for any)."""
        if grad is None:
            return (None,) * len(self.rows)
        return tuple(grad.split(self.rows, 0)) if len(self.rows) > 1 else (grad,)


class WeightOperand:
    """A GEMM weight as its block's backward sees it: shape and dtype, and W^T as E4M3 with the forward's scale,
    taken from the cache (made now from the saved weight if the forward did not make it) or re-cast from the saved
    weight (pieces: None when the cache holds both copies and backward saved no weight)."""

    def __init__(self, like: WeightLike, pieces: WeightPieces | None, cache=None):
        self.like, self.pieces, self.cache = like, pieces, cache

    @classmethod
    def of(cls, weights) -> "WeightOperand":
        """A weight that backward saved whole (no cache): the compiled path's weights."""
        pieces = WeightPieces(weights)
        return cls(WeightLike(pieces), pieces)

    def transposed(self, scale, use_triton):
        if self.cache is not None:
            if not self.cache.holds(self.like, scale):
                raise RuntimeError("coat-fp8: the FP8 weight cache was refilled between this forward and its backward "
                                   "(the runtime's clock ticked in between: an optimizer step or clock.tick() before "
                                   "backward)")
            if self.cache.w8_t is None:
                self.cache.fill(self.pieces, use_triton, transposed=True)  # holds this quantization: only the copy
            return self.cache.w8_t
        return cast(self.pieces.joined(), scale, E4M3, use_triton, write_row=False, write_t=True)[1]


def kept_weight(pieces: WeightPieces, cache, env) -> tuple:
    """The tensors backward must save of a weight: the pieces (parameters, no copies) without a cache or when the
    cache makes the transposed copy in backward; none when the cache holds both copies."""
    return pieces.tensors if cache is None or not env.weight_t_in_forward else ()


def output_dtype(x):
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def hand_off(env: BlockEnv, grad, amax) -> None:
    """Give a gradient's stage-1 amax to the block whose backward receives that very tensor (amax None: none)."""
    if env.handoff is not None and amax is not None:
        env.handoff.give(grad, amax)
