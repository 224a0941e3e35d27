"""What GraphedLayer decides before any CUDA graph exists, checked on CPU with the capture itself replaced: at most
`max_generations` buckets get graphs (others run eagerly, with one warning per model); a new bucket takes the memory
of the others; only one bucket is in flight, and a layer whose previous call's backward is pending runs eagerly;
moved parameters make the pool capture anew once nothing is in flight (letting go of the old graphs), as does a layer
missing from a generation, and captures anew that recur warn once with their causes; the first loan of the pool's
memory drops the pool and sizes it; the options come from ActivationConfig / the ds_config section. The graphs
themselves are checked on the GPU (tests/gpu/test_layer_graphs_gpu.py, tests/gpu/test_graph_pool_loans_gpu.py)."""
import warnings
from types import SimpleNamespace

import pytest
import torch

from coat_ds.ds_config import parse_section
from coat_kernels.act import ActivationConfig
from coat_kernels.act.graph_pool import GraphPool, SharedInputs
from coat_kernels.act.layer_graphs import GraphedLayer, _Token

SHARED = SharedInputs(("none",), (), lambda sources, n, out=None: [] if out is None else out)


class FakeGraph:
    """Stands in for a CUDAGraph: records whether it was let go."""

    def __init__(self):
        self.released = False

    def reset(self):
        self.released = True


def fake_captures(monkeypatch):
    """Replace the CUDA capture by a record of what would have been captured, holding a placeholder buffer."""
    made = []

    def capture(self, gen, x, n, length, shared):
        made.append((tuple(x.shape), length))
        gen.shared = gen.shared if gen.shared is not None else []
        index = len(gen.order)
        gen.hold(("output", index), torch.empty(1))
        c = SimpleNamespace(generation=gen, pending=None, holds_output=True, length=length, replays=0,
                            param_ptrs=tuple(p.data_ptr() for p in self.params),
                            forward=FakeGraph(), backward=FakeGraph())
        gen.captures[self] = c
        gen.order.append(c)
        return c

    monkeypatch.setattr(GraphedLayer, "_capture", capture)
    return made


def layers(count=2, max_generations=2):
    pool = GraphPool()
    modules = [torch.nn.Linear(4, 4) for _ in range(count)]
    return pool, modules, [GraphedLayer(lambda x: x, m, pool=pool, max_generations=max_generations) for m in modules]


def call(layer, length, bucket):
    """What GraphedLayer.__call__ decides for x [1, length, 4] in `bucket`: the capture to replay, or None."""
    gen = layer.pool.generation((bucket,), layer.max_generations, lambda: [(1, length, 4)])
    return None if gen is None else layer._capture_for(gen, torch.zeros(1, length, 4), length, bucket, SHARED)


def test_buckets_beyond_the_limit_run_eagerly_and_warn_once_per_model(monkeypatch):
    made = fake_captures(monkeypatch)
    pool, _, (first, second) = layers()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for length, bucket in ((100, 128), (200, 256), (120, 128), (300, 384), (400, 512), (250, 256)):
            for layer in (first, second):
                assert (call(layer, length, bucket) is None) == (bucket > 256)
    assert made == [((1, 100, 4), 128)] * 2 + [((1, 200, 4), 256)] * 2
    messages = [str(w.message) for w in caught if "cuda_graph_shapes" in str(w.message)]
    assert len(messages) == 1 and "[(1, 300, 4)]" in messages[0] and "beyond the 2" in messages[0], messages


def test_a_new_bucket_takes_the_memory_of_the_others_and_one_bucket_is_in_flight(monkeypatch):
    fake_captures(monkeypatch)
    pool, _, (first, second) = layers(max_generations=4)
    a = call(first, 100, 128)
    call(second, 100, 128)
    gen_a = a.generation
    assert len(gen_a.held) == 2 and not gen_a.closed
    token = _Token(a)  # a replay of bucket 128 whose backward is pending
    assert call(second, 200, 256) is None  # another bucket while 128 is in flight: eager
    assert call(first, 100, 128) is None  # the same layer again before its backward: eager
    assert call(second, 100, 128) is not None  # the next layer of the same step replays
    token.finish()
    b = call(first, 200, 256)
    assert b is not None and gen_a.closed and not gen_a.held and not a.holds_output  # 128's memory given back
    assert call(first, 100, 128) is a  # closed generations still replay


def test_moved_parameters_make_the_pool_capture_anew_once_nothing_is_in_flight(monkeypatch):
    made = fake_captures(monkeypatch)
    pool, modules, (first, second) = layers()
    call(first, 100, 128)
    old = call(second, 100, 128)
    with torch.no_grad():
        modules[1].weight.data = modules[1].weight.data.clone()  # a new storage: its graphs can never replay
    token = _Token(call(first, 100, 128))
    assert call(second, 100, 128) is None and pool.reset_requested  # eager now; not while a replay is in flight
    token.finish()
    assert not old.forward.released
    new = call(first, 100, 128)  # nothing in flight: every generation dropped, captured anew
    assert new is not None and not pool.reset_requested and len(made) == 3
    # the dropped captures' graphs are let go even though `old` is still referenced here
    assert old.forward.released and old.backward.released and not new.forward.released
    assert call(second, 100, 128) not in (None, old) and len(made) == 4


def test_graphs_captured_anew_again_and_again_warn_once_with_the_causes(monkeypatch):
    """Parameters that move at every step (and any other cause of captures anew that recurs) would leave the graphs
    capturing at every step, slower than eager layers: the fourth capture anew warns, once, counting each cause."""
    made = fake_captures(monkeypatch)
    pool, modules, (first, second) = layers()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            assert call(first, 100, 128) is not None and call(second, 100, 128) is not None  # captured (anew)
            if step == 3:
                pool.request_reset("the loans outgrew the pool's reserved segment")
            else:
                with torch.no_grad():
                    modules[1].weight.data = modules[1].weight.data.clone()  # new storage
                assert call(first, 100, 128) is not None and call(second, 100, 128) is None  # eager until anew
            if step == 2:
                assert not [w for w in caught if "captured anew" in str(w.message)]  # two so far
    assert len(made) == 2 * 6
    assert pool.recaptures == {"parameters moved to new storage": 4, "the loans outgrew the pool's reserved segment": 1}
    messages = [str(w.message) for w in caught if "captured anew" in str(w.message)]
    assert len(messages) == 1, messages
    assert ("4 times (parameters moved to new storage: 3; the loans outgrew the pool's reserved segment: 1)"
            in messages[0]), messages


def test_a_layer_missing_from_its_generation_captures_it_anew(monkeypatch):
    made = fake_captures(monkeypatch)
    pool, _, (first, second) = layers()
    a = call(first, 100, 128)  # `second` ran eagerly in the generation's first pass
    a.generation.sealed = True  # (its first backward ran)
    token = _Token(call(first, 100, 128))
    assert call(second, 100, 128) is None and a.generation.rebuild  # not while `first` is in flight
    token.finish()
    fresh = call(first, 100, 128)
    assert fresh is not a and call(second, 100, 128) is not None and len(made) == 3


def test_the_options_are_validated_in_the_config_and_the_ds_config_section():
    assert ActivationConfig().cuda_graph_shapes == 32 and ActivationConfig().cuda_graph_pad_multiple == 128
    section = parse_section({"coat": {"fp8_activations": True, "cuda_graphs": True, "cuda_graph_shapes": 8,
                                      "cuda_graph_pad_multiple": 64}})
    config = section.activation_config(zero_stage=2, gradient_accumulation_steps=1)
    assert config.cuda_graph_shapes == 8 and config.cuda_graph_pad_multiple == 64
    for name in ("cuda_graph_shapes", "cuda_graph_pad_multiple"):
        for bad, error in ((0, ValueError), (True, TypeError), (2.0, TypeError), ("4", TypeError)):
            with pytest.raises(error, match=name):
                ActivationConfig(**{name: bad})
            with pytest.raises(error, match=name):
                parse_section({"coat": {name: bad}})


def test_the_first_loan_drops_the_pool_and_sizes_it_from_the_pool_and_the_loan(monkeypatch):
    """The pool as the captures left it (no reserved size yet) is dropped at the first loan, which lends ordinary
    memory and counts what the allocator takes for it; the pool's reserved size becomes the larger of its old size and
    the loan, also when the borrowing work fails; nothing is lent while a replay's backward is pending."""
    from coat_kernels.act.graph_pool_loans import lend

    fake_captures(monkeypatch)
    pool, _, (first, second) = layers()
    monkeypatch.setattr(GraphPool, "segment_bytes", lambda self: 1000)
    a = call(first, 100, 128)
    call(second, 100, 128)
    token = _Token(a)
    with lend(pool) as loan:
        assert loan is None  # `first` is in flight
    token.finish()
    with lend(pool) as loan:
        assert loan.sizing and not pool.generations and a.forward.released
        t = loan.empty(300, torch.float32, torch.device("cpu"))
        assert t.shape == (300,)
    taken = 1536  # 300 float32, 1200 bytes, as the caching allocator takes them: in multiples of 512 bytes
    assert pool.reserve_bytes == taken and loan.bytes == taken and not pool.reset_requested
    call(first, 100, 128)
    pool.reserve_bytes = 0
    with pytest.raises(RuntimeError, match="step failed"):
        with lend(pool) as loan:
            loan.empty(100, torch.float32, torch.device("cpu"))
            raise RuntimeError("step failed")
    assert pool.reserve_bytes == 1000 and not pool.generations
