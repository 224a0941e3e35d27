"""coat_kernels.act.saved_tensors: what autograd nodes and graphs saved, against what the ops are known to save."""
import pytest
import torch
import torch.nn.functional as F

from coat_kernels.act.saved_tensors import saved_by_graph, saved_by_node


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x * 2
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        return g * 2


def storages(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_nodes_and_graphs():
    q = torch.randn(1, 2, 8, 4).transpose(1, 2).requires_grad_()  # bshd memory, as the decoder layer's q is
    o = F.scaled_dot_product_attention(q, q, q, is_causal=True)  # saves its output (and q, k, v, logsumexp)
    assert o.untyped_storage().data_ptr() in storages(saved_by_node(o.grad_fn))
    y = Double.apply(o.sum(-1))
    assert storages(saved_by_node(y.grad_fn)) == {y.untyped_storage().data_ptr()}
    whole = storages(saved_by_graph(y.grad_fn))
    assert {o.untyped_storage().data_ptr(), q.untyped_storage().data_ptr()} <= whole
    assert saved_by_node(o.sum().grad_fn) == []  # a sum saves no tensor


def test_stale_nodes_fail_or_are_skipped():
    w = torch.randn(4, requires_grad=True)
    d = Double.apply(w)
    y = d * w  # MulBackward saves d and w
    with torch.no_grad():
        w.add_(1)  # an optimizer step
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved_by_graph(y.grad_fn)
    # the stale node is left out; the walk goes on past it to Double, which saved d
    assert storages(saved_by_graph(y.grad_fn, skip_stale=True)) == {d.untyped_storage().data_ptr()}


class SavesNone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(None, x)  # an absent tensor (LayerNorm's mean under RMSNorm, say)
        return x * 3

    @staticmethod
    def backward(ctx, g):
        return g * 3


def test_absent_saved_tensors_are_left_out():
    x = torch.randn(4, requires_grad=True)
    y = SavesNone.apply(x)
    assert saved_by_node(y.grad_fn) == [x]
    assert [t is x for t in saved_by_graph(y.grad_fn)] == [True]
