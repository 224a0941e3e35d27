"""CUDA graphs of one layer's forward and backward, captured lazily per input shape and replayed in place of the eager
calls: the whole host cost of a layer step (Python, Triton launches, cuBLAS calls, autograd nodes) becomes two graph
launches. TransformerEngine's `make_graphed_callables` does the same for a list of callables captured up front; here
each layer captures itself at its first call with a new shape, so a model needs no sample inputs and no set-up call.

`GraphedLayer(fn, module)`: `fn(*inputs)` is the layer's forward (a tensor out), reading the parameters of `module`.
Calling the GraphedLayer with inputs of a signature seen before replays the forward graph; the backward of its output
replays the backward graph, which gives the gradients of the inputs and parameters to autograd as ordinary gradients
(accumulated into `.grad`, through any hooks an engine put on the parameters). A signature is the inputs' shapes,
dtypes and requires_grad, and the parameters' storage addresses (an engine that moves or re-allocates parameters
gets new graphs, and the graphs made for the old addresses are released).

Shapes: a GraphedLayer keeps graphs for at most `max_shapes` input signatures; a call with another one runs `fn`
eagerly (the same results), and the first such call of a model warns once (through its GraphPool), naming the
limit and the shape: inputs of ever new lengths (batches padded to their longest sequence) would otherwise capture,
and keep the memory of, one set of graphs per length.

What a replay needs and how it is kept right:
- Inputs are copied into the graph's own input buffers (skipped when the caller passes those very buffers). An input
  that is the output buffer of another graph of the same `GraphPool` (the previous layer's) is used as this graph's
  input buffer itself: consecutive graphed layers pass activations without a copy or a second buffer.
- The output is the graph's output buffer (a view of it): each replay overwrites it. A call made while the previous
  call's backward is still pending (its autograd graph alive: two forwards before a backward, a forward whose loss is
  never backpropagated and is still referenced) runs eagerly instead, so no live result is overwritten.
- Graphs sharing a pool may reuse each other's temporary memory, which is safe when they replay in the order they
  were captured: each input shape's graphs are captured layer by layer in a step of that shape, and replay so. A
  layer that captures again because its parameters moved would be captured after the layers behind it and replay
  before them: it captures into a pool of its own from then on.
- Memory the graphs keep: what the forward saves for backward (kept from capture on, where eager frees it after each
  backward), the input/output/gradient buffers, and the parameter gradient buffers of the backward graph (the size of
  the layer's parameters). Graphs of all layers of a model share one `GraphPool`.
- Capture runs `warmup` eager forward + backward passes first (on a side stream, `torch.autograd.grad`, so nothing is
  accumulated into `.grad`), then captures the forward and the backward on one capture stream. During capture the
  module's parameters are replaced by aliases (same storage), so the captured autograd graph holds no node of the
  real parameters: their gradient accumulation (and any hook an engine put on it) runs on the stream of the eager
  backward.
- The gradients handed to autograd are views of the backward graph's buffers that the capture keeps referenced, so
  autograd copies them into `.grad` (it never adopts a buffer the next replay overwrites): gradient accumulation over
  micro-batches stays right.
Only CUDA tensors, with grad enabled, outside another capture; `fn` must not synchronise with the host.
"""
from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


class GraphPool:
    """What the graphed layers of one model share: a CUDA-graph memory pool (made at first use) and the output
    buffers of their forward graphs (by address), so that a layer fed by another's output reuses that buffer."""

    def __init__(self):
        self._handle = None
        self.outputs: dict = {}
        self.warned_shape_limit = False

    @property
    def handle(self):
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    def __getstate__(self):
        """Copies and pickles start empty (a copied model captures its own graphs in a pool of its own)."""
        return {"_handle": None, "outputs": {}, "warned_shape_limit": False}

    def warn_shape_limit(self, max_shapes: int, inputs) -> None:
        """One warning per model: a layer met more input shapes than it keeps graphs for."""
        if self.warned_shape_limit:
            return
        self.warned_shape_limit = True
        shapes = [tuple(t.shape) for t in inputs if t is not None]
        warnings.warn(f"coat-fp8: a layer with per-layer CUDA graphs was called with input shapes {shapes}, a new "
                      f"shape beyond the {max_shapes} it keeps graphs for (ActivationConfig.cuda_graph_shapes; "
                      f'ds_config "coat": {{"cuda_graph_shapes": N}}); calls with such shapes run eagerly (same '
                      "results, the eager host cost). Pad or pack batches to a few fixed lengths (e.g. a data "
                      "collator's pad_to_multiple_of) so that graphs replay for all of them.", stacklevel=4)


@dataclass
class _Capture:
    inputs: list                # the graph's input buffers (tensors; None where the caller passed None)
    output: torch.Tensor        # the forward graph's output buffer (holds the autograd graph the backward replays)
    grad_output: torch.Tensor   # the backward graph's incoming-gradient buffer
    grads: tuple                # views of the gradient buffers, one per input and parameter that requires grad
    needs_grad: tuple           # per input and parameter: whether it gets a gradient
    forward: torch.cuda.CUDAGraph
    backward: torch.cuda.CUDAGraph
    pending: object = None      # weak reference to the token of the call whose backward has not run yet
    replays: int = 0


class _Token:
    """Alive while the autograd graph of one replayed call is (held by its ctx)."""


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, capture: _Capture, n_inputs: int, *tensors):
        for buf, t in zip(capture.inputs, tensors[:n_inputs]):
            if buf is not None and buf.data_ptr() != t.data_ptr():
                buf.copy_(t)
        capture.forward.replay()
        capture.replays += 1
        ctx.capture, ctx.token = capture, _Token()
        capture.pending = weakref.ref(ctx.token)
        return capture.output.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        capture = ctx.capture
        if grad.data_ptr() != capture.grad_output.data_ptr():
            capture.grad_output.copy_(grad)
        capture.backward.replay()
        capture.pending = None
        grads = iter(capture.grads)
        return (None, None) + tuple(next(grads) if needed else None for needed in capture.needs_grad)


@dataclass
class GraphedLayer:
    fn: object
    module: torch.nn.Module
    pool: GraphPool = field(default_factory=GraphPool)  # shared by the graphed layers of one model
    warmup: int = 1
    max_shapes: int = 4
    captures: dict = field(default_factory=dict)

    def __post_init__(self):
        self.names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        self.params = [self.module.get_parameter(n) for n in self.names]
        self.own_pool = None  # this layer's own pool handle, once its parameters have moved

    def __call__(self, *inputs):
        capture = self._capture_for(inputs)
        if capture is None or (capture.pending is not None and capture.pending() is not None):
            # over the shape limit, or the previous call's backward is pending (its output must stay as it is)
            return self.fn(*inputs)
        tensors = [t if t is not None else _NONE for t in inputs]
        return _Replay.apply(capture, len(inputs), *tensors, *self.params)

    def _capture_for(self, inputs):
        """The capture for these inputs (made now if new and within max_shapes), or None: run eagerly."""
        key = self._signature(inputs)
        capture = self.captures.get(key)
        if capture is not None:
            return capture
        if self._release_stale(key[1]) and self.own_pool is None:
            self.own_pool = self._new_pool_handle()
        if len(self.captures) >= self.max_shapes:
            self.pool.warn_shape_limit(self.max_shapes, inputs)
            return None
        capture = self.captures[key] = self._capture(inputs, self.own_pool or self.pool.handle)
        return capture

    def _release_stale(self, param_ptrs) -> bool:
        """Drop the captures made for parameter addresses other than the current ones (they can never replay; a
        replay whose backward is pending keeps its capture alive through its autograd node until then). Returns
        whether there were any."""
        stale_keys = [k for k in self.captures if k[1] != param_ptrs]
        for key in stale_keys:
            stale = self.captures.pop(key)
            self.pool.outputs.pop(stale.output.data_ptr(), None)
        return bool(stale_keys)

    @staticmethod
    def _new_pool_handle():
        return torch.cuda.graph_pool_handle()

    def _signature(self, inputs):
        return (tuple(None if t is None else (tuple(t.shape), t.dtype, t.requires_grad, t.device) for t in inputs),
                tuple(p.data_ptr() for p in self.params))

    def _static_input(self, t):
        if t is None:
            return None
        shared = self.pool.outputs.get(t.data_ptr())
        if shared is not None and shared.shape == t.shape and shared.dtype == t.dtype:
            return shared.detach().requires_grad_(t.requires_grad)  # a leaf on the other graph's output buffer
        return t.detach().clone().requires_grad_(t.requires_grad)

    def _capture(self, inputs, pool_handle) -> _Capture:
        static = [self._static_input(t) for t in inputs]
        aliases = [torch.nn.Parameter(p.detach(), requires_grad=True) for p in self.params]
        surface = [t for t in static if t is not None and t.requires_grad] + aliases
        needs_grad = tuple(t is not None and t.requires_grad for t in static) + (True,) * len(aliases)
        # no autocast cache while capturing: a cast of a parameter cached by an eager pass would be read by the
        # graph as it was then, and a cast made in the capture would live in the graph's memory
        autocast = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"),
                                  enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)
        with _parameters_replaced(self.module, self.names, aliases), autocast:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    out = self.fn(*static)
                    torch.autograd.grad(out, surface, torch.zeros_like(out), allow_unused=True)
                    del out
            torch.cuda.current_stream().wait_stream(side)
            forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(forward, pool=pool_handle):
                output = self.fn(*static)
            grad_output = torch.empty_like(output)
            with torch.cuda.graph(backward, pool=pool_handle):
                grads = torch.autograd.grad(output, surface, grad_output, allow_unused=True, retain_graph=True)
        if any(g is None for g in grads):
            unused = [i for i, g in enumerate(grads) if g is None]
            raise RuntimeError(f"GraphedLayer: inputs/parameters {unused} requiring grad get no gradient from the "
                               "layer; pass only what the layer uses")
        self.pool.outputs[output.data_ptr()] = output
        return _Capture(static, output, grad_output, tuple(g.detach() for g in grads), needs_grad, forward, backward)


@contextmanager
def _parameters_replaced(module, names, replacements):
    """Within the block, module's parameters `names` are `replacements` (restored afterwards)."""
    slots = []
    for name, new in zip(names, replacements):
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        slots.append((owner, leaf, owner._parameters[leaf]))
        owner._parameters[leaf] = new
    try:
        yield
    finally:
        for owner, leaf, old in slots:
            owner._parameters[leaf] = old


_NONE = torch.empty(0)  # stands for an absent input in the replay's argument list (autograd needs tensors)
