"""What the custom-op shells of the compiled path (`compiled_ops`, `compiled_mlp`) share: outputs a call does not
produce (empty uint8 tensors: custom ops return tensors only, and an integer tensor is never differentiable), the
fake shapes of what the bodies return, and the argument checks done before an op is called."""
from __future__ import annotations

import torch
from torch import Tensor

from .group_quant import SCALE_DTYPE
from .tiles import GROUP

NORMS = ("rmsnorm", "layernorm")


def absent(like: Tensor) -> Tensor:
    """An output the call does not produce: an empty uint8 tensor on like's device."""
    return like.new_empty(0, dtype=torch.uint8)


def or_absent(t: Tensor | None, like: Tensor) -> Tensor:
    return t if t is not None else absent(like)


def rows_of(like: Tensor) -> int:
    """The number of rows of like [..., K] seen as [M, K]."""
    m = 1
    for d in like.shape[:-1]:
        m = m * d
    return m


def fp8_like(like: Tensor, *shape) -> Tensor:
    return like.new_empty(shape, dtype=torch.float8_e4m3fn)


def scale_like(like: Tensor) -> Tensor:
    return like.new_empty((), dtype=torch.float32)


def split_rows(grad: Tensor, weights) -> list:
    return list(grad.split([w.shape[0] for w in weights], 0)) if len(weights) > 1 else [grad]


def keep_grads(ctx):
    """Non-differentiable FP8 outputs get no gradient tensors (None, not materialized zeros)."""
    ctx.set_materialize_grads(False)


def grad_or_zeros(grad, shape, dtype, like):
    return grad if grad is not None else torch.zeros(shape, dtype=dtype, device=like.device)


def check_norm(norm, hdim):
    if norm not in NORMS:
        raise ValueError(f"norm must be 'rmsnorm' or 'layernorm', got {norm!r}")
    if hdim % GROUP:
        raise ValueError(f"hidden size must be a multiple of {GROUP} (1x16 groups), got {hdim}")


def gemm_grads_fake(dy, weights, need_dx, need_dw, bias_dtype):
    """Fake (dgrad, wgrad, bias gradient) of a GEMM backward."""
    n, k = sum(w.shape[0] for w in weights), weights[0].shape[1]
    dx = dy.new_empty(rows_of(dy), k) if need_dx else absent(dy)
    dw = weights[0].new_empty(n, k) if need_dw else absent(dy)
    db = dy.new_empty(n, dtype=bias_dtype) if bias_dtype is not None else absent(dy)
    return dx, dw, db


def norm_outputs_fake(x, residual, norm, with_h):
    """(h, q, e, mean, rstd) of a fake norm forward."""
    hdim, m = x.shape[-1], rows_of(x)
    if residual is not None:
        h = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    else:
        h = x.new_empty(x.shape) if with_h else absent(x)
    mean = x.new_empty(m, dtype=torch.float32) if norm == "layernorm" else absent(x)
    return (h, fp8_like(x, m, hdim), x.new_empty(m, hdim // GROUP, dtype=SCALE_DTYPE), mean,
            x.new_empty(m, dtype=torch.float32))


def norm_grads_fake(q, norm_weight, norm_bias, dx_dtype, need_dx):
    if not need_dx:
        return absent(q), absent(q), absent(q)
    return (q.new_empty(q.shape, dtype=dx_dtype), norm_weight.new_empty(norm_weight.shape),
            norm_bias.new_empty(norm_bias.shape) if norm_bias is not None else absent(q))


def swiglu_saved_fake(x):
    m, f2 = rows_of(x), x.shape[-1]
    return fp8_like(x, m, f2), x.new_empty(m, f2 // GROUP, dtype=SCALE_DTYPE)
