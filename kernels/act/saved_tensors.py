"""What an autograd graph saved for its backward, read from its nodes: the tensors a node saved (a Python autograd
Function's `saved_tensors`, a built-in node's `_saved_*` attributes) and those of a whole graph. Used to tell whether
a tensor's memory is kept by the graph anyway (o_proj reusing the attention output; a graphed layer's backward reading
its input buffer)."""
from __future__ import annotations

import functools

import torch


def saved_by_node(node) -> list:
    """The tensors one autograd node saved for its backward."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):  # a Python autograd Function's context
        return [t for t in node.saved_tensors if t is not None]  # (save_for_backward takes None for an absent one)
    values = (getattr(node, name) for name in _saved_names(type(node)))
    return [t for t in values if isinstance(t, torch.Tensor)]


def saved_by_graph(root, skip_stale: bool = False) -> list:
    """The tensors every node reachable from `root` (a grad_fn) saved for its backward. skip_stale: leave out the
    nodes a saved tensor of which was changed in place since (a parameter stepped by an optimizer), which otherwise
    fail autograd's version check here."""
    saved, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        try:
            saved += saved_by_node(node)
        except RuntimeError:
            if not skip_stale:
                raise
        stack.extend(fn for fn, _ in node.next_functions)
    return saved


@functools.lru_cache(maxsize=None)
def _saved_names(node_type) -> tuple:
    """The `_saved_*` attributes of a built-in autograd node type (the tensors and values it saved)."""
    return tuple(name for name in dir(node_type) if name.startswith("_saved_"))
