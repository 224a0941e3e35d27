"""What the CPU and GPU torch.compile tests share: one training step of a model or of one decoder layer, returning
what the tests compare (compiled against eager)."""
from __future__ import annotations

import torch


def loss_and_grads(model, ids):
    """(loss, parameter gradients) of one causal-LM step on `ids` (labels = inputs)."""
    for p in model.parameters():
        p.grad = None
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def layer_step(layer, x, dy, position_embeddings):
    """[output, input gradient, parameter gradients...] of one decoder layer's forward and backward (copies)."""
    for p in layer.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    y = layer(x, position_embeddings=position_embeddings)
    y.backward(dy)
    return [t.detach().clone() for t in [y, x.grad] + [p.grad for p in layer.parameters()]]
