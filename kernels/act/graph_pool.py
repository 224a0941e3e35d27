"""The memory side of per-layer CUDA graphs (coat_kernels.act.layer_graphs): one CUDA-graph memory pool per model,
shared by every graphed layer and every length bucket, and the generations it holds (the graphs of one bucket
across the model's layers, captured in one forward pass). Why the pool is shared, what a generation keeps allocated
and when it gives its memory back: layer_graphs' module docstring; lending the pool's memory between steps:
coat_kernels.act.graph_pool_loans.
"""
from __future__ import annotations

import gc
import warnings
import weakref
from dataclasses import dataclass

import torch


def unowned(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory that does not keep it allocated (t's memory can be given back to its pool while the
    graphs that write it keep replaying)."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.shape, t.stride())


class GraphPool:
    """What the graphed layers of one model share: one CUDA-graph memory pool and its generations (one per bucket,
    keyed by the shapes it was captured for)."""

    def __init__(self):
        self._memory = None
        self._stream = None
        self._warmup_stream = None
        self.generations: dict = {}
        self.handed_out: list = []  # weak references to outputs returned by replays, newest last
        self.warned: set = set()
        self.reset_requested = ""  # why the generations are to be dropped and captured anew ("": they are not)
        self.recaptures: dict = {}  # why the generations were dropped to be captured anew -> how often
        self.reserve_bytes = 0  # the pool's first segment, in one piece (see `memory`)

    @property
    def memory(self) -> torch.cuda.MemPool:
        """The memory pool every capture allocates from (made at the first capture, anew after a reset). With
        `reserve_bytes` set, its first segment is that large: captures carve their blocks out of it, and once they
        have given them back it is one free block again, which work borrowing the pool can take in one piece."""
        if self._memory is None:
            self._memory = torch.cuda.MemPool()
            if self.reserve_bytes:
                with torch.cuda.stream(self.capture_stream), torch.cuda.use_mem_pool(self._memory):
                    torch.empty(self.reserve_bytes, dtype=torch.uint8, device="cuda")  # freed: a free segment
        return self._memory

    @property
    def handle(self):
        return self.memory.id

    @property
    def capture_stream(self) -> torch.cuda.Stream:
        """The one stream every capture runs on: the caching allocator keeps a pool's free blocks per stream, so
        captures (and work borrowing the pool's memory, kernels.act.graph_pool_loans) reuse each other's memory only
        on one stream. cuBLAS keeps a workspace per stream (and thread) it ran on: a generation's first capture makes
        this stream's in the pool (kernels.act.layer_graphs)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    @property
    def warmup_stream(self) -> torch.cuda.Stream:
        """The one stream every capture's eager warm-up runs on, so cuBLAS makes its workspaces for warm-ups once, not
        per layer (it keeps them for the life of the process). Of high priority: torch hands out the streams of one
        priority round-robin from a small set, and this one must never be the capture stream, or the captures would
        find the warm-up's workspace, in ordinary memory, and use it."""
        if self._warmup_stream is None:
            self._warmup_stream = torch.cuda.Stream(priority=-1)
        return self._warmup_stream

    def __getstate__(self):
        """Copies and pickles start empty (a copied model captures its own graphs in a pool of its own)."""
        return {"_memory": None, "_stream": None, "_warmup_stream": None, "generations": {}, "handed_out": [],
                "warned": set(), "reset_requested": "", "recaptures": {}, "reserve_bytes": 0}

    def generation(self, key, max_generations: int, shapes) -> "Generation | None":
        """The generation of bucket `key` (made now if new and within max_generations; else None, with one warning
        per model naming `shapes()`, the call's input shapes)."""
        if self.reset_requested and not self.in_flight():
            reason = self.reset_requested
            self.reset()
            self._count_recapture(reason)
        gen = self.generations.get(key)
        if gen is None:
            if len(self.generations) >= max_generations:
                self.warn_once("limit", f"coat-fp8: a layer with per-layer CUDA graphs was called with input shapes "
                               f"{shapes()}, a bucket beyond the {max_generations} whose graphs a model keeps "
                               f'(ActivationConfig.cuda_graph_shapes; ds_config "coat": {{"cuda_graph_shapes": N}}); '
                               "calls in further buckets run eagerly (same results, the eager host cost). Raise the "
                               "limit, or the padding multiple (cuda_graph_pad_multiple) so that fewer buckets cover "
                               "the lengths.")
                return None
            gen = self.generations[key] = Generation(key)
        return gen

    # captures anew after which a model warns: a capture step costs several replayed ones, so a cause that recurs
    # every few steps leaves the graphs slower than eager layers
    RECAPTURES_BEFORE_WARNING = 4

    def request_reset(self, reason: str) -> None:
        """Drop every generation and capture anew at the next call with nothing in flight, because of `reason`."""
        self.reset_requested = reason

    def _count_recapture(self, reason: str) -> None:
        self.recaptures[reason] = self.recaptures.get(reason, 0) + 1
        total = sum(self.recaptures.values())
        if total >= self.RECAPTURES_BEFORE_WARNING:
            causes = "; ".join(f"{why}: {count}" for why, count in self.recaptures.items())
            self.warn_once("recaptures", f"coat-fp8: the per-layer CUDA graphs were dropped and captured anew {total} "
                           f"times ({causes}); a capture step costs several replayed steps, so graphs that keep being "
                           "captured anew run slower than eager layers. Parameters that move to new storage at every "
                           "step keep the graphs from replaying: train such a model without cuda_graphs.")

    def in_flight(self, besides=None) -> bool:
        """Whether a generation other than `besides` has a replay whose backward has not run yet."""
        return any(g.in_flight for g in self.generations.values() if g is not besides)

    def open(self, gen: "Generation") -> None:
        """Before `gen` captures: every other generation stops capturing and gives its memory back to the pool."""
        for other in self.generations.values():
            if other is not gen:
                other.close()

    def restart(self, gen: "Generation") -> "Generation":
        """A new, empty generation in place of `gen` (dropped with its graphs); only when none is in flight."""
        gen.close()
        fresh = self.generations[gen.key] = Generation(gen.key)
        return fresh

    def close_all(self) -> None:
        """Every generation gives all its memory back to the pool (their graphs keep writing it at their next
        replays); only when none is in flight."""
        for gen in self.generations.values():
            gen.close()

    def reset(self) -> None:
        """Drop every generation (their graphs and pool) and capture anew; only when none is in flight."""
        self.release_graphs()
        self.generations.clear()
        self.handed_out.clear()
        self.reset_requested = ""
        if self._memory is not None:
            # the dropped pool's segments go back to the device before a new pool reserves its own: first the
            # generations' tensors (they and their captures refer to each other), then the pool
            gc.collect()
            self._memory = None
            torch.cuda.empty_cache()

    def release_graphs(self) -> None:
        """Let go of every capture's graphs now. A MemPool must outlive the graphs captured into it (torch aborts
        the process otherwise), and a capture may still be referenced from elsewhere (a kept loss, an exception's
        traceback) when its pool is dropped."""
        for gen in self.generations.values():
            for capture in gen.captures.values():
                capture.forward.reset()
                capture.backward.reset()
        if self._memory is not None:
            # cuBLAS's workspaces for the capture stream live in the pool (kernels.act.layer_graphs) and keep it
            # allocated; the next GEMM on any stream makes its own anew
            torch._C._cuda_clearCublasWorkspaces()

    def __del__(self):
        # a model dropped with its graphs is collected as one cycle, in no set order: the graphs go first
        if getattr(self, "generations", None):  # (absent when a copy failed before its state was set)
            self.release_graphs()

    def segment_bytes(self) -> int:
        """Bytes of the pool's segments (0 before the first capture)."""
        if self._memory is None:
            return 0
        pool_id = tuple(self._memory.id)
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                   if tuple(s.get("segment_pool_id", ())) == pool_id)

    def may_replay(self, input_tensor) -> bool:
        """Whether a replay may run: no output handed out earlier whose buffer went back to the pool (where any later
        replay may write) is still referenced, except the one being fed in (the previous layer's). An output whose
        buffer its capture still holds is overwritten only by that capture's next replay, as documented."""
        alive = [(ref, capture) for ref, capture in self.handed_out if ref() is not None]
        self.handed_out = alive
        return all(capture.holds_output or ref() is input_tensor for ref, capture in alive)

    def hand_out(self, t: torch.Tensor, capture) -> None:
        self.handed_out.append((weakref.ref(t), capture))

    def warn_once(self, topic: str, message: str) -> None:
        """One warning per model and topic."""
        if topic not in self.warned:
            self.warned.add(topic)
            warnings.warn(message, stacklevel=4)


class Generation:
    """The graphs of one bucket across a model's layers (see the module docstring), and the memory they hold."""

    def __init__(self, key):
        self.key = key
        self.captures: dict = {}     # GraphedLayer -> _Capture
        self.order: list = []        # the captures in capture order
        self.shared = None           # the shared static inputs (unowned views; their owners in `held`)
        self.filled_from = None      # (weak references to the sources, their versions, n) of the last fill
        self.outputs: dict = {}      # data_ptr -> output buffer, while captures may still take it as input
        self.held: dict = {}         # name -> owner (tensors and autograd graphs kept allocated)
        self.in_flight = 0           # replays whose backward has not run
        self.sealed = False          # its first forward pass is over: no more captures
        self.rebuild = False         # a layer found no capture of its own: capture all layers again
        self.closed = False          # its memory is given back to the pool

    def hold(self, name, owner) -> None:
        self.held[name] = owner

    def give_back(self, name) -> None:
        self.held.pop(name, None)
        if name[0] == "output":
            self.order[name[1]].holds_output = False

    def close(self) -> None:
        self.held.clear()
        self.outputs.clear()
        for capture in self.order:
            capture.holds_output = False
        self.sealed = self.closed = True

    def fill(self, shared: "SharedInputs", n: int) -> None:
        """Write the call's shared inputs into the static ones, once per step: the layers of a step pass the same
        source tensors (matched by identity and version, so a new step's tensors at a recycled address are copied)."""
        sources = shared.sources
        stamp = [(weakref.ref(s), s._version) if s is not None else None for s in sources]
        last = self.filled_from
        if last is not None and last[1] == n and all(
                (a is None and b is None) or (a is not None and b is not None and a[0]() is b[0]() and a[1] == b[1])
                for a, b in zip(last[0], stamp)):
            return
        shared.pad(sources, n, self.shared)
        self.filled_from = (stamp, n)


@dataclass(frozen=True)
class SharedInputs:
    """The inputs every layer of a bucket reads besides its own: `key` (hashable: what fixes their padded shapes),
    `sources` (the call's tensors, None where absent), `pad(sources, n, out)`: their padded versions for n real
    positions, written into `out` (a list of tensors) or, with out None, returned as new tensors."""
    key: tuple
    sources: tuple
    pad: object
