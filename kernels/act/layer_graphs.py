"""CUDA graphs of one layer's forward and backward, captured lazily per sequence-length bucket and replayed in place of
the eager calls: the whole host cost of a layer step (Python, Triton launches, cuBLAS calls, autograd nodes) becomes
two graph launches. TransformerEngine's `make_graphed_callables` captures a list of callables up front for fixed
sample shapes; here each layer captures itself at its first call in a new bucket, so a model needs no sample inputs
and no set-up call, and batches of varying length replay a few sets of graphs.

`GraphedLayer(fn, module, pool)`: `fn(x, *shared)` is the layer's forward on a padded input x [b, S, ...] (S: the
bucket's length) and the bucket's shared inputs (the same tensors for every layer of a step: position tables, a mask,
the number of real positions), returning a tensor of x's shape; it reads the parameters of `module`. A call
`graphed(x, S, shared)` with x [b, n, ...] (n <= S real positions) pads x to S inside the layer, replays the graphs
of that bucket (capturing them first if new) and returns the first n positions of the output; the backward of that
output replays the backward graph and hands autograd the gradients of x and of the parameters as ordinary gradients
(accumulated into `.grad`, through any hooks an engine put on the parameters). `fn` must keep the padded positions
from changing the real ones (causal attention with padded masks does; coat_hf's decoder layer also zeroes the padded
rows of its attention output, so every per-tensor FP8 scale is the unpadded one).

Memory: the graphs of one bucket across the model's layers form a *generation*, captured in one forward pass in the
order the layers run. Within a generation each capture keeps what a later step needs (the activations its forward
saves for its backward, its buffers) allocated while later layers capture, so no replay of that step overwrites
what another one still needs; what only one layer's backward writes (its input and parameter gradients) is given
back to the pool right after its capture, and the output and incoming-gradient buffers once the next layer has
captured: a later layer runs after it in the forward and before it in the backward, so it may reuse that memory.
When a new bucket starts capturing, every other generation gives all its memory back to the pool, and the new one is
captured into it: generations never run at the same time, so all buckets share one pool the size of the largest
one, about eager's own peak (torch.compile's CUDA-graph trees share one pool the same way). Replays keep using the
given-back memory through tensors that do not own it (`unowned`).

What keeps replays right:
- Only one generation is in flight: a call in another bucket while a replay's backward is pending (a forward whose
  backward has not run: two forwards before a backward, a loss never backpropagated but still referenced) runs
  eagerly, as does a second call of the same layer before its backward. Captures happen only in a generation's
  first forward pass, in the order the layers run.
- Outputs are views of graph buffers, overwritten by later replays: a call while an output whose buffer went back to
  the pool (any layer's but the generation's latest capture) is still referenced, other than the input being fed
  in, runs eagerly, so no live result is overwritten. The latest capture's output is overwritten by its own next
  replay, as a single graphed layer's always is.
- Inputs are copied into the graph's input buffer (padded rows zeroed), unless they are the previous layer's output
  buffer, which is then the input buffer itself: consecutive graphed layers pass activations without a copy.
- Capture runs `warmup` eager forward + backward passes first (`torch.autograd.grad`, so nothing is accumulated into
  `.grad`; after emptying the allocator's cache, so the warm-up's allocations reuse what other streams held cached
  instead of adding to it), then captures the forward and the backward, with Python's garbage collector paused (a
  collection could free another model's graphs mid-capture). Every warm-up runs on the pool's one warm-up stream and
  every capture on its one capture stream: cuBLAS keeps a workspace for every stream its GEMMs ran on (per thread,
  for the life of the process), so a stream per capture would leave two workspaces behind per layer. A generation's
  first capture clears cuBLAS's workspaces (as torch.compile's CUDA-graph trees do before they record), so its
  graphs' workspaces are made in the pool: whatever clears them later frees pool memory, which only the pool's own
  captures and loans take (never while the graphs that use it are in flight), not ordinary memory that any tensor
  could take while the graphs keep writing it.
  During capture the module's parameters are replaced by aliases (same storage), so the captured autograd graph
  holds no node of the real parameters: their gradient accumulation (and any hook an engine put on it) runs on the
  stream of the eager backward. The gradients handed to autograd are views of graph buffers, so autograd copies them
  into `.grad`.
- A layer whose parameters moved to new storage (an engine re-allocating them) can no longer replay: its calls run
  eagerly and, once no replay is pending, the pool drops every generation and captures anew. A layer that ran
  eagerly in its generation's first pass (and so has no graphs there) makes the generation capture anew, in order,
  at its next call with nothing in flight.
- At most `max_generations` buckets per model; calls in further buckets run eagerly, with one warning per model.
Only CUDA tensors, with grad enabled, outside another capture; `fn` must not synchronise with the host.
"""
from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .graph_pool import Generation, GraphPool, SharedInputs, unowned
from .saved_tensors import saved_by_graph


class _Token:
    """Alive while the autograd graph of one replayed call is (held by its ctx); counts its generation in flight
    until its backward has run or the graph is gone."""

    def __init__(self, capture):
        self.capture = capture
        capture.generation.in_flight += 1
        capture.pending = weakref.ref(self)

    def finish(self):
        if self.capture is not None:
            self.capture.generation.in_flight -= 1
            self.capture.pending = None
            self.capture = None

    def __del__(self):
        self.finish()


@dataclass
class _Capture:
    generation: Generation
    length: int                 # the bucket's padded length S
    x: torch.Tensor             # input buffer [b, S, ...] (unowned)
    output: torch.Tensor        # output buffer (unowned)
    grad_output: torch.Tensor   # incoming-gradient buffer (unowned)
    grads: tuple                # unowned views: the input gradient (if needed), then the parameters'
    needs_grad: tuple           # per input x and parameter: whether it gets a gradient
    param_ptrs: tuple           # the parameter storage the graphs read
    forward: torch.cuda.CUDAGraph
    backward: torch.cuda.CUDAGraph
    pending: object = None      # weak reference to the token of the call whose backward has not run yet
    replays: int = 0
    holds_output: bool = True   # whether the output buffer is still this capture's alone (not given back)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, capture: _Capture, n: int, x, *params):
        buf = capture.x
        if x.data_ptr() != buf.data_ptr():
            buf[:, :n].copy_(x)
            if n < capture.length:
                buf[:, n:].zero_()
        capture.forward.replay()
        capture.replays += 1
        ctx.capture, ctx.n, ctx.token = capture, n, _Token(capture)
        return capture.output[:, :n]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        capture, n = ctx.capture, ctx.n
        buf = capture.grad_output
        buf[:, :n].copy_(grad)
        if n < capture.length:
            buf[:, n:].zero_()
        capture.backward.replay()
        capture.generation.sealed = True
        ctx.token.finish()
        ctx.capture = ctx.token = None  # a loss kept after its backward must not keep dropped graphs (and their pool)
        grads = iter(capture.grads)
        out = [next(grads) if needed else None for needed in capture.needs_grad]
        if out[0] is not None:
            out[0] = out[0][:, :n]
        return (None, None, *out)


@dataclass(eq=False)
class GraphedLayer:
    fn: object
    module: torch.nn.Module
    pool: GraphPool = field(default_factory=GraphPool)  # shared by the graphed layers of one model
    warmup: int = 1
    max_generations: int = 32

    def __post_init__(self):
        self.names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        self.params = [self.module.get_parameter(n) for n in self.names]

    @property
    def captures(self) -> dict:
        """This layer's captures: bucket key -> _Capture."""
        return {key: gen.captures[self] for key, gen in self.pool.generations.items() if self in gen.captures}

    def __call__(self, x: torch.Tensor, length: int, shared: SharedInputs) -> torch.Tensor | None:
        """The layer's output for x [b, n, ...] (n <= length) through the graphs of bucket `length`; None where they
        cannot run (see the module docstring): the caller then runs the layer eagerly."""
        n = x.shape[1]
        key = (tuple(x.shape[:1]) + (length,) + tuple(x.shape[2:]), x.dtype, x.requires_grad, shared.key)
        gen = self.pool.generation(key, self.max_generations, lambda: [tuple(x.shape)] + [
            tuple(s.shape) for s in shared.sources if s is not None])
        capture = None if gen is None else self._capture_for(gen, x, n, length, shared)
        if capture is None:
            return None
        out = _Replay.apply(capture, n, x, *self.params)
        self.pool.hand_out(out, capture)
        return out

    def _capture_for(self, gen: Generation, x, n, length, shared) -> _Capture | None:
        """The capture to replay now (made now if this is the generation's first pass), or None: run eagerly."""
        pool = self.pool
        if pool.in_flight(besides=gen) or not pool.may_replay(x):
            return None
        if gen.rebuild and not gen.in_flight:
            gen = pool.restart(gen)
        capture = gen.captures.get(self)
        if capture is not None:
            if capture.pending is not None and capture.pending() is not None:
                return None  # its previous output's backward is pending: that output must stay as it is
            if capture.param_ptrs != tuple(p.data_ptr() for p in self.params):
                pool.request_reset("parameters moved to new storage")
                return None
            gen.fill(shared, n)
            return capture
        if gen.sealed:  # a layer that ran eagerly in the generation's first pass: capture them all again
            if gen.in_flight:  # not before the layers that replayed in this step have run their backward
                gen.rebuild = True
                return None
            gen = pool.restart(gen)
        pool.open(gen)
        first = gen.shared is None  # the generation's first capture allocates the shared inputs
        if not first:
            gen.fill(shared, n)  # the warm-up reads them
        capture = self._capture(gen, x, n, length, shared)
        if first:
            gen.fill(shared, n)
        return capture

    def _capture(self, gen: Generation, x, n, length, shared) -> _Capture:
        previous = gen.order[-1] if gen.order else None
        prev_out = gen.outputs.get(x.data_ptr())
        takes_previous = prev_out is not None and prev_out.dtype == x.dtype and prev_out.shape == (
            x.shape[0], length, *x.shape[2:])
        x_warm = prev_out if takes_previous else _pad_rows(x, length)
        shared_warm = gen.shared if gen.shared is not None else shared.pad(shared.sources, n, None)
        aliases = [torch.nn.Parameter(p.detach(), requires_grad=True) for p in self.params]
        # no autocast cache while capturing: a cast of a parameter cached by an eager pass would be read by the
        # graph as it was then, and a cast made in the capture would live in the graph's memory
        autocast = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"),
                                  enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)
        if previous is None:
            # a generation's first capture makes the capture stream's cuBLAS workspaces anew, in the pool, where the
            # generation's graphs keep using them (see GraphPool.capture_stream); the warm-up's are made anew too
            torch._C._cuda_clearCublasWorkspaces()
        # the warm-up runs on a stream of its own, and a new pool reserves its first segment: neither can take the
        # blocks other streams hold cached, so give those back first (torch.cuda.graph does the same before the
        # capture), or a new bucket's first capture would add the warm-up's memory and the reserve on top of them
        torch.cuda.empty_cache()
        handle, stream, warm_stream = self.pool.handle, self.pool.capture_stream, self.pool.warmup_stream
        with _parameters_replaced(self.module, self.names, aliases), autocast:
            warm_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warm_stream):
                for _ in range(self.warmup):
                    leaf = x_warm.detach().requires_grad_(x.requires_grad)
                    out = self.fn(leaf, *shared_warm)
                    surface = ([leaf] if leaf.requires_grad else []) + aliases
                    torch.autograd.grad(out, surface, torch.zeros_like(out), allow_unused=True)
                    del out, leaf
            torch.cuda.current_stream().wait_stream(warm_stream)
            forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with _collection_paused(), torch.cuda.graph(forward, pool=handle, stream=stream):
                # buffers made here (no kernel runs) come from the pool; they are filled before each replay
                if gen.shared is None:
                    owners = [torch.empty_like(t) if t is not None else None for t in shared_warm]
                    gen.hold("shared", owners)
                    gen.shared = [unowned(t) if t is not None else None for t in owners]
                # the input leaf does not own its memory: the captured autograd graph (kept for what the forward
                # saved) must not keep the previous layer's output buffer allocated
                if takes_previous:
                    x_static = unowned(prev_out).requires_grad_(x.requires_grad)
                else:
                    owner = torch.empty_like(x_warm)
                    gen.hold(("input", len(gen.order)), owner)
                    x_static = unowned(owner).requires_grad_(x.requires_grad)
                output = self.fn(x_static, *gen.shared)
            with _collection_paused(), torch.cuda.graph(backward, pool=handle, stream=stream):
                grad_output = torch.empty_like(output)
                surface = ([x_static] if x_static.requires_grad else []) + aliases
                grads = torch.autograd.grad(output, surface, grad_output, allow_unused=True, retain_graph=True)
        if any(g is None for g in grads):
            unused = [i for i, g in enumerate(grads) if g is None]
            raise RuntimeError(f"GraphedLayer: inputs/parameters {unused} requiring grad get no gradient from the "
                               "layer; pass only what the layer uses")
        index = len(gen.order)
        capture = _Capture(gen, length, x_static.detach(), unowned(output), unowned(grad_output),
                           tuple(unowned(g) for g in grads), (x_static.requires_grad,) + (True,) * len(aliases),
                           tuple(p.data_ptr() for p in self.params), forward, backward)
        # kept until the generation closes: what the forward saved for the backward (the autograd graph), the
        # input buffer this capture made; kept until the next capture: the output and incoming-gradient buffers
        gen.hold(("graph", index), output.grad_fn)
        gen.hold(("output", index), output)
        gen.hold(("grad_output", index), grad_output)
        gen.outputs = {output.data_ptr(): output}
        if previous is not None:
            last = index - 1
            gen.give_back(("grad_output", last))
            if not (takes_previous and _saves_storage(output, x_static)):
                gen.give_back(("output", last))
        gen.captures[self] = capture
        gen.order.append(capture)
        return capture


@contextmanager
def _collection_paused():
    """Python's cyclic garbage collector off for the block (torch.cuda.graph still collects once as it begins). A
    collection during a capture may destroy another model's graphs or memory pool, CUDA calls that a capturing stream
    forbids: the process aborts."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _pad_rows(x: torch.Tensor, length: int) -> torch.Tensor:
    """x [b, n, ...] with zero rows appended along dim 1 up to `length` (x itself when n == length)."""
    n = x.shape[1]
    if n == length:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], length - n, *x.shape[2:])], 1)


def _saves_storage(output: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether output's autograd graph saved a tensor on t's storage."""
    storage = t.untyped_storage().data_ptr()
    return any(s.untyped_storage().data_ptr() == storage for s in saved_by_graph(output.grad_fn))


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
