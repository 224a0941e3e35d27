"""LM head + cross-entropy in chunks of tokens, never holding the full logits.

A causal LM's loss needs logits [tokens, vocab]: in BF16, upcast to fp32 for the softmax, plus their gradient, that is
about 10 bytes per token per vocabulary entry at its peak (several GiB at a few thousand tokens and a 32k vocab).
`chunked_lm_loss` computes, chunk by chunk, logits = hidden @ W^T (BF16 GEMM, as the unchunked head), the fp32
log-sum-exp and the target logit, and keeps only the hidden states; backward recomputes each chunk's logits and
turns softmax - one_hot into the hidden and weight gradients (one more head GEMM per step, a few percent of a layer
stack's compute). The loss equals torch's cross_entropy on the full logits up to fp32 summation order.
"""
from __future__ import annotations

import torch

DEFAULT_CHUNK_TOKENS = 4096


def _chunks(n, size):
    return [(s, min(s + size, n)) for s in range(0, n, size)]


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, denominator, ignore_index, chunk):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s, e in _chunks(hidden.shape[0], chunk):
            logits = (hidden[s:e] @ weight.t()).float()
            target = labels[s:e]
            valid = target != ignore_index
            picked = logits.gather(1, target.clamp(min=0)[:, None])[:, 0]
            total += ((torch.logsumexp(logits, 1) - picked) * valid).sum()
        ctx.save_for_backward(hidden, weight, labels, denominator)
        ctx.ignore_index, ctx.chunk = ignore_index, chunk
        return total / denominator

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, denominator = ctx.saved_tensors
        scale = grad_loss / denominator
        d_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for s, e in _chunks(hidden.shape[0], ctx.chunk):
            h = hidden[s:e]
            probs = torch.softmax((h @ weight.t()).float(), 1)
            target = labels[s:e]
            valid = target != ctx.ignore_index
            probs[torch.arange(e - s, device=h.device), target.clamp(min=0)] -= 1.0
            d_logits = (probs * (scale * valid)[:, None]).to(hidden.dtype)
            if d_hidden is not None:
                d_hidden[s:e] = d_logits @ weight
            if d_weight is not None:
                d_weight += (d_logits.t() @ h).float()
        return d_hidden, (d_weight.to(weight.dtype) if d_weight is not None else None), None, None, None, None


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                    num_items: int | torch.Tensor | None = None, ignore_index: int = -100,
                    chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """Mean cross-entropy of the logits hidden @ weight.T against labels (already aligned with hidden: the caller
    shifts them for a causal LM), ignoring `ignore_index`; with num_items, the sum divided by it (gradient
    accumulation over micro-batches counts the items of the whole batch)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    if y.shape[0] != h.shape[0]:
        raise ValueError(f"{y.shape[0]} labels for {h.shape[0]} hidden states")
    if num_items is None:
        denominator = (y != ignore_index).sum().clamp(min=1).float()
    else:
        denominator = torch.as_tensor(num_items, dtype=torch.float32, device=h.device)
    return _ChunkedLMLoss.apply(h, weight, y, denominator, ignore_index, chunk_tokens)
