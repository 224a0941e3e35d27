"""Per-layer CUDA graphs of converted Hugging Face decoder layers (ActivationConfig(cuda_graphs=True)): a replayed layer
gives the eager layer's bits; training steps replay the graphs and give the eager model's losses and gradients, at a
fixed length and at lengths that vary per step (padded inside the layer to a bucket), with and without a padding
mask; all buckets share one memory pool the size of about one, and captures leave nothing per layer outside it; two
forwards before a backward, a forward in another bucket while one is in flight, a held output, moved parameters
(also with a capture still referenced), a dropped model, saved-tensor hooks, checkpointing, evaluation and buckets
beyond cuda_graph_shapes fall back, recapture or give their memory back as documented; two graphed models train in
turns."""
import copy
import gc

import pytest
import torch

from coat_hf import ActivationConfig, convert_to_coat

SEQ, VOCAB = 256, 512


def model_pair(layers=3, **options):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    base = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    eager = convert_to_coat(copy.deepcopy(base), ActivationConfig(cache_weights=False))
    graphed = convert_to_coat(copy.deepcopy(base), ActivationConfig(cache_weights=False, cuda_graphs=True, **options))
    return eager, graphed


def step(model, ids, mask=None):
    model.zero_grad(set_to_none=True)
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def train(model, steps, seed=1, lengths=None, lr=0.1):
    """Losses and the last step's gradients of `steps` SGD steps (lr=0: every step on the initial weights, which
    compares each step's graphs alone, without FP8 rounding differences compounding through updates)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator(device="cuda").manual_seed(seed)
    losses, grads = [], None
    for i in range(steps):
        length = SEQ if lengths is None else lengths[i % len(lengths)]
        ids = torch.randint(0, VOCAB, (2, length), device="cuda", generator=g)
        loss, grads = step(model, ids)
        opt.step()
        losses.append(loss)
    return losses, grads


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def replays(model):
    return [sum(c.replays for c in layer.coat.graphs.captures.values()) for layer in model.model.layers]


def assert_close(got, expected, loss_tol=1e-3, grad_tol=2e-2):
    (lg, gg), (le, ge) = got, expected
    lg, le = (lg, le) if isinstance(lg, list) else ([lg], [le])
    assert max(abs(a - b) / abs(b) for a, b in zip(lg, le)) < loss_tol, (lg, le)
    errors = [rel(a, b) for a, b in zip(gg, ge)]
    assert max(errors) < grad_tol, sorted(enumerate(errors), key=lambda e: -e[1])[:4]


def pool_bytes(model) -> int:
    """Bytes of the segments of the model's CUDA-graph pool."""
    handle = tuple(model.coat_runtime.graph_pool.handle)
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == handle)


def layer_runs(model, layer, length, graphs_per_run):
    """[output, input gradient, parameter gradients...] of one layer's forward and backward on fixed random inputs,
    once per entry of graphs_per_run (cuda_graphs off or on)."""
    x = torch.randn(2, length, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rotary = model.model.rotary_emb(x, torch.arange(length, device="cuda")[None])
    dy = torch.randn_like(x)
    runs = []
    for graphs in graphs_per_run:
        layer.coat.config = layer.coat.config.replace(cuda_graphs=graphs)
        x.grad = None
        layer.zero_grad(set_to_none=True)
        out = layer(x, position_embeddings=rotary)
        out.backward(dy)
        runs.append([out.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()])
    return runs


def test_a_graphed_layer_gives_the_eager_layers_bits():
    """The same layer, the same inputs and output gradient, at a bucket's own length: the replayed graphs run the
    eager kernels."""
    eager, _ = model_pair()
    layer = eager.model.layers[1]
    runs = layer_runs(eager, layer, SEQ, (False, True, True, True))
    assert sum(c.replays for c in layer.coat.graphs.captures.values()) == 3
    names = ["out", "dx"] + [n for n, _ in layer.named_parameters()]
    for run in runs[1:]:
        diff = {n: rel(a, b) for n, a, b in zip(names, run, runs[0]) if not torch.equal(a, b)}
        assert not diff, diff


def test_a_padded_replay_gives_the_unpadded_eager_layer():
    """x of 200 positions in a bucket of 256: the real rows match eager on the 200 (the GEMMs' longer sums over
    zero rows may round differently); the padded rows of the graph's buffers stay zero."""
    eager, _ = model_pair()
    layer = eager.model.layers[0]
    runs = layer_runs(eager, layer, 200, (False, True, True))
    (capture,) = layer.coat.graphs.captures.values()
    assert capture.replays == 2 and capture.length == 256
    assert not capture.output[:, 200:].any() and not capture.grads[0][:, 200:].any()
    for run in runs[1:]:
        assert max(rel(a, b) for a, b in zip(run, runs[0])) < 1e-2


def test_graphed_training_matches_eager():
    eager, graphed = model_pair()
    (l_e, g_e), (l_g, g_g) = train(eager, 4), train(graphed, 4)
    assert [len(layer.coat.graphs.captures) for layer in graphed.model.layers] == [1, 1, 1]
    assert replays(graphed) == [4, 4, 4]
    assert_close((l_g, g_g), (l_e, g_e))


def test_varying_lengths_replay_their_buckets_and_train_like_eager():
    """Lengths in 4 buckets of 64; each bucket captured once, in its first step, and replayed after."""
    eager, graphed = model_pair(cuda_graph_pad_multiple=64)
    lengths = [200, 130, 256, 70, 190, 129, 250, 64]  # buckets 256, 192, 256, 128, 192, 192, 256, 64
    (l_e, g_e), (l_g, g_g) = (train(m, 8, lengths=lengths, lr=0.0) for m in (eager, graphed))
    assert_close((l_g, g_g), (l_e, g_e))
    for layer in graphed.model.layers:
        captures = layer.coat.graphs.captures
        assert sorted(c.length for c in captures.values()) == [64, 128, 192, 256]
        assert sorted(c.replays for c in captures.values()) == [1, 1, 3, 3]


def test_padding_masks_replay_with_the_mask_padded():
    eager, graphed = model_pair(cuda_graph_pad_multiple=64)
    g = torch.Generator(device="cuda").manual_seed(2)
    for length, pad in ((200, 30), (170, 0), (230, 100)):
        ids = torch.randint(0, VOCAB, (2, length), device="cuda", generator=g)
        mask = torch.ones_like(ids)
        mask[1, length - pad:] = 0  # the second row right-padded (an all-ones mask leaves HF's mask out)
        assert_close(step(graphed, ids, mask), step(eager, ids, mask))
    assert all(c.replays >= 1 for layer in graphed.model.layers for c in layer.coat.graphs.captures.values())


def test_all_buckets_share_one_pool_of_about_the_largest():
    """The pool after capturing the largest bucket and then five smaller ones is at most 30% larger than after the
    largest alone (the buckets' memory overlaps; without sharing it would be about 3.5x), and a bucket replayed
    after the others still trains like eager."""
    eager, graphed = model_pair(layers=4, cuda_graph_pad_multiple=32)
    lengths = [256, 224, 192, 160, 128, 96, 160, 256]
    train(graphed, 1, lengths=lengths[:1], lr=0.0)
    largest = pool_bytes(graphed)
    (l_e, g_e), (l_g, g_g) = (train(m, 7, lengths=lengths[1:], seed=9, lr=0.0) for m in (eager, graphed))
    assert_close((l_g, g_g), (l_e, g_e))
    assert len(graphed.model.layers[0].coat.graphs.captures) == 6
    assert pool_bytes(graphed) <= 1.3 * largest, (pool_bytes(graphed), largest)


def test_a_new_buckets_capture_reuses_the_memory_other_streams_held_cached():
    """A new bucket's first capture while a large free block sits in the main stream's cache takes no memory beyond
    what was reserved before it: the warm-up's stream gets the cached memory back instead of new memory on top."""
    _, graphed = model_pair(layers=2, cuda_graph_pad_multiple=32)
    train(graphed, 1, lengths=[256], lr=0.0)
    block = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    del block  # 1 GiB free in the main stream's cache
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    train(graphed, 1, lengths=[224], lr=0.0)  # a new bucket: warm-up and capture
    assert len(graphed.model.layers[0].coat.graphs.captures) == 2
    assert torch.cuda.max_memory_reserved() <= before, (torch.cuda.max_memory_reserved(), before)


def allocated_in(pool_id=(0, 0)) -> int:
    """Bytes allocated in the CUDA-graph pool `pool_id` ((0, 0): ordinary memory, outside every pool)."""
    return sum(s["allocated_size"] for s in torch.cuda.memory_snapshot()
               if tuple(s.get("segment_pool_id", (0, 0))) == tuple(pool_id))


def test_captures_leave_nothing_per_layer_outside_the_pool():
    """A capture step of eight layers leaves at most four cuBLAS workspaces (32 MiB each on Hopper, and cuBLASLt's of
    1 MiB beside them: the warm-up stream's and the current stream's, each for the forward's thread and autograd's)
    and the gradients allocated
    outside the graph pool: cuBLAS keeps a workspace per stream its GEMMs ran on, so a warm-up stream per layer
    would leave 64 MiB behind per layer."""
    _, graphed = model_pair(layers=8)
    torch._C._cuda_clearCublasWorkspaces()  # the step makes every workspace it uses anew, whatever ran before it
    torch.cuda.synchronize()
    before = allocated_in()
    train(graphed, 1, lr=0.0)
    torch.cuda.synchronize()
    grads = sum(p.grad.untyped_storage().nbytes() for p in graphed.parameters())
    assert sum(replays(graphed)) == 8
    left = allocated_in() - before - grads
    assert left <= 4 * (32 + 1) * 2 ** 20 + 2 ** 20, left / 2 ** 20


def test_the_graphs_cublas_workspaces_live_in_the_pool():
    """The captures' cuBLAS workspaces are pool memory: clearing cuBLAS's workspaces (torch.compile's CUDA-graph
    trees do before they record) frees them inside the pool, which only the pool's own captures and loans take, and
    the graphs keep giving eager's results."""
    eager, graphed = model_pair(layers=2)
    (l_e, g_e), (l_g, g_g) = (train(m, 1, lr=0.0) for m in (eager, graphed))
    torch.cuda.synchronize()
    pool_id = graphed.coat_runtime.graph_pool.handle
    held = allocated_in(pool_id)
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.synchronize()
    assert held - allocated_in(pool_id) >= 32 * 2 ** 20, (held, allocated_in(pool_id))
    assert_close(train(graphed, 2, seed=3, lr=0.0), train(eager, 2, seed=3, lr=0.0))
    assert sum(replays(graphed)) == 2 * 3


def test_two_graphed_models_trained_in_turns_each_train_like_eager():
    """Two graphed models in one process (a policy and a value model, say), stepped in turns, each capturing buckets
    after the other's captures: a model's first capture clears cuBLAS's workspaces, which frees the other model's
    workspace inside that model's own pool, where only that model's captures and loans take memory; both keep giving
    their eager twins' losses and gradients."""
    pairs = [model_pair(layers=2, cuda_graph_pad_multiple=64), model_pair(layers=3, cuda_graph_pad_multiple=64)]
    pools = {tuple(graphed.coat_runtime.graph_pool.handle) for _, graphed in pairs}
    assert len(pools) == 2
    g = torch.Generator(device="cuda").manual_seed(11)
    schedule = [(0, 256), (1, 192), (0, 250), (0, 128), (1, 64), (1, 190), (0, 256), (0, 100), (1, 60), (1, 256)]
    for which, length in schedule:
        eager, graphed = pairs[which]
        ids = torch.randint(0, VOCAB, (2, length), device="cuda", generator=g)
        assert_close(step(graphed, ids), step(eager, ids))
    for (_, graphed), expected in zip(pairs, ({128: 2, 256: 3}, {64: 2, 192: 2, 256: 1})):
        for layer in graphed.model.layers:
            captures = layer.coat.graphs.captures.values()
            assert {c.length: c.replays for c in captures} == expected


def test_gradient_accumulation_over_micro_batches():
    """Accumulating three micro-batches (two lengths) without zeroing sums all three (no .grad is a buffer the next
    replay overwrites)."""
    eager, graphed = model_pair(cuda_graph_pad_multiple=64)
    g = torch.Generator(device="cuda").manual_seed(3)
    batches = [torch.randint(0, VOCAB, (2, n), device="cuda", generator=g) for n in (SEQ, 150, SEQ)]
    grads = []
    for model in (eager, graphed):
        model.zero_grad(set_to_none=True)
        for ids in batches:
            model(input_ids=ids, labels=ids).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert max(rel(a, b) for a, b in zip(grads[1], grads[0])) < 2e-2


def test_consecutive_layers_share_activation_buffers():
    _, graphed = model_pair()
    train(graphed, 1)
    (c0,), (c1,) = (layer.coat.graphs.captures.values() for layer in graphed.model.layers[:2])
    assert c1.x.data_ptr() == c0.output.data_ptr()


def test_two_forwards_before_a_backward_run_eagerly_and_stay_right():
    eager, graphed = model_pair(cuda_graph_pad_multiple=64)
    train(eager, 1)
    train(graphed, 1)  # captured; both models take the same step
    ids = torch.randint(0, VOCAB, (2, SEQ), device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    for second in (ids.flip(1), ids[:, :100]):  # the same bucket, then another one, while the first is in flight
        expected = []
        for model in (eager, graphed):
            model.zero_grad(set_to_none=True)
            before = replays(model) if model is graphed else None
            a = model(input_ids=ids, labels=ids).loss
            b = model(input_ids=second, labels=second).loss  # must not overwrite the first's buffers
            (a + b).backward()
            if model is graphed:
                assert [r - r0 for r, r0 in zip(replays(model), before)] == [1, 1, 1]  # `b` ran eagerly
            expected.append(([a.item(), b.item()], [p.grad.clone() for p in model.parameters()]))
        assert_close(expected[1], expected[0])


def test_a_held_output_of_an_earlier_layer_is_not_overwritten():
    """Layer 0's output kept while layers 1 and 2 run: its buffer went back to the pool once layer 1 captured, so
    layer 2 must not replay over it (it runs eagerly); the kept output keeps its values."""
    eager, graphed = model_pair()
    train(graphed, 1)
    layers = graphed.model.layers
    x = torch.randn(2, SEQ, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pe = graphed.model.rotary_emb(x, torch.arange(SEQ, device="cuda")[None])
    before = replays(graphed)
    h0 = layers[0](x, position_embeddings=pe)
    kept = h0.detach().clone()
    h2 = layers[2](layers[1](h0, position_embeddings=pe), position_embeddings=pe)
    assert torch.equal(h0, kept)
    assert [r - r0 for r, r0 in zip(replays(graphed), before)] == [1, 1, 0]
    h2.sum().backward()


def test_moved_parameters_recapture_and_checkpointing_and_eval_run_eagerly():
    eager, graphed = model_pair()
    train(eager, 1)
    train(graphed, 1)
    for model in (eager, graphed):
        with torch.no_grad():
            for p in model.model.layers[0].parameters():
                p.data = p.data.clone()  # new storage
    (l_e, g_e), (l_g, g_g) = train(eager, 3, seed=4), train(graphed, 3, seed=4)
    assert_close((l_g, g_g), (l_e, g_e))
    layer = graphed.model.layers[0]
    assert len(layer.coat.graphs.captures) == 1 and replays(graphed) == [2, 2, 2]  # recaptured in step 2 of 3
    graphed.eval()
    with torch.no_grad():
        graphed(input_ids=torch.zeros(1, 8, dtype=torch.long, device="cuda"))
    graphed.train()
    before = replays(graphed)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # a replay would bypass them
        train(graphed, 1)
    graphed.gradient_checkpointing_enable()
    with pytest.warns(UserWarning, match="not used with gradient checkpointing"):
        train(graphed, 2)
    assert replays(graphed) == before


def test_a_pool_dropped_while_a_capture_is_referenced_elsewhere_releases_its_graphs():
    """Moved parameters make the pool drop its generations while a capture is still referenced from outside (as an
    exception's traceback or a kept variable would keep it): its graphs are let go with the pool (torch aborts the
    process when a memory pool goes before a graph captured into it), and training goes on with new graphs."""
    eager, graphed = model_pair()
    train(eager, 1)
    train(graphed, 1)
    (kept,) = graphed.model.layers[0].coat.graphs.captures.values()
    for model in (eager, graphed):
        with torch.no_grad():
            for p in model.model.layers[0].parameters():
                p.data = p.data.clone()  # new storage
    assert_close(train(graphed, 2, seed=4), train(eager, 2, seed=4))
    (fresh,) = graphed.model.layers[0].coat.graphs.captures.values()
    assert fresh is not kept and fresh.replays == 1
    with pytest.raises(RuntimeError):
        kept.forward.replay()


def test_a_dropped_graphed_model_gives_its_pool_back():
    _, graphed = model_pair()
    train(graphed, 2)
    handle = tuple(graphed.coat_runtime.graph_pool.handle)
    assert pool_bytes(graphed) > 0
    del graphed
    gc.collect()
    torch.cuda.empty_cache()
    assert not [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == handle]


def test_no_garbage_collection_runs_while_a_layer_captures():
    """A collection during a capture may free another model's graphs or pool, which a capturing stream forbids (the
    process aborts): with the collector set to run at every allocation, none runs while a stream captures."""
    _, graphed = model_pair()
    during_capture = []

    def record(phase, info):
        if phase == "start":
            during_capture.append(torch.cuda.is_current_stream_capturing())

    threshold = gc.get_threshold()
    gc.set_threshold(1)
    gc.callbacks.append(record)
    try:
        train(graphed, 1)
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*threshold)
    assert len(graphed.model.layers[0].coat.graphs.captures) == 1
    assert during_capture and not any(during_capture), during_capture.count(True)


def test_buckets_beyond_the_limit_run_eagerly_with_the_eager_results():
    eager, graphed = model_pair(cuda_graph_shapes=2, cuda_graph_pad_multiple=64)
    g = torch.Generator(device="cuda").manual_seed(7)
    with pytest.warns(UserWarning, match="cuda_graph_shapes") as caught:
        for length in (SEQ, SEQ // 2, SEQ // 4, SEQ // 2, SEQ // 4):
            ids = torch.randint(0, VOCAB, (2, length), device="cuda", generator=g)
            assert_close(step(graphed, ids), step(eager, ids))
    assert sum("cuda_graph_shapes" in str(w.message) for w in caught) == 1
    for layer in graphed.model.layers:
        captures = layer.coat.graphs.captures.values()
        assert sorted(c.length for c in captures) == [SEQ // 2, SEQ]
        assert sorted(c.replays for c in captures) == [1, 2]


def test_copies_of_a_graphed_model_leave_the_graphs_behind():
    _, graphed = model_pair()
    train(graphed, 1)
    clone = copy.deepcopy(graphed)
    assert clone.model.layers[0].coat.graphs is None
    train(clone, 1)
    assert len(clone.model.layers[0].coat.graphs.captures) == 1


@pytest.mark.parametrize("bad", [{"cuda_graphs": "yes"}, {"cuda_graph_pad_multiple": 0}])
def test_bad_option(bad):
    with pytest.raises((TypeError, ValueError)):
        ActivationConfig(**bad)
