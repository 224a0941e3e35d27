"""Per-layer CUDA graphs of converted Hugging Face decoder layers (ActivationConfig(cuda_graphs=True)): a replayed layer
gives the eager layer's bits; training steps replay the graphs and give the eager model's losses and gradients; two
forwards before a backward, a moved parameter, saved-tensor hooks, activation checkpointing, evaluation and input
shapes beyond cuda_graph_shapes fall back or recapture as documented."""
import copy

import pytest
import torch

from coat_hf import ActivationConfig, convert_to_coat

SEQ, VOCAB = 256, 512


def model_pair():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    base = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    eager = convert_to_coat(copy.deepcopy(base), ActivationConfig(cache_weights=False))
    graphed = convert_to_coat(copy.deepcopy(base), ActivationConfig(cache_weights=False, cuda_graphs=True))
    return eager, graphed


def train(model, steps, seed=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator(device="cuda").manual_seed(seed)
    losses, grads = [], None
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, SEQ), device="cuda", generator=g)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        losses.append(loss.item())
    return losses, grads


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def test_a_graphed_layer_gives_the_eager_layers_bits():
    """The same layer, the same inputs and output gradient: the replayed graphs run the eager kernels."""
    eager, _ = model_pair()
    layer = eager.model.layers[1]
    x = torch.randn(2, SEQ, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rotary = eager.model.rotary_emb(x, torch.arange(SEQ, device="cuda")[None])
    dy = torch.randn_like(x)
    runs = []
    for graphs in (False, True, True, True):
        layer.coat.config = layer.coat.config.replace(cuda_graphs=graphs)
        x.grad = None
        layer.zero_grad(set_to_none=True)
        out = layer(x, position_embeddings=rotary)
        out.backward(dy)
        runs.append([out.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()])
    names = ["out", "dx"] + [n for n, _ in layer.named_parameters()]
    for run in runs[1:]:
        diff = {n: rel(a, b) for n, a, b in zip(names, run, runs[0]) if not torch.equal(a, b)}
        assert not diff, diff


def test_graphed_training_matches_eager():
    eager, graphed = model_pair()
    (l_e, g_e), (l_g, g_g) = train(eager, 4), train(graphed, 4)
    captures = [len(layer.coat.graphs.captures) for layer in graphed.model.layers]
    replays = [sum(c.replays for c in layer.coat.graphs.captures.values()) for layer in graphed.model.layers]
    assert captures == [1, 1, 1] and replays == [4, 4, 4]
    assert max(abs(a - b) / abs(b) for a, b in zip(l_g, l_e)) < 1e-3, (l_g, l_e)
    errors = {n: rel(a, b) for (n, _), a, b in zip(graphed.named_parameters(), g_g, g_e)}
    assert max(errors.values()) < 2e-2, errors


def test_gradient_accumulation_over_micro_batches():
    """Accumulating three micro-batches without zeroing sums all three (no .grad is a buffer the next replay
    overwrites)."""
    eager, graphed = model_pair()
    g = torch.Generator(device="cuda").manual_seed(3)
    batches = [torch.randint(0, VOCAB, (2, SEQ), device="cuda", generator=g) for _ in range(3)]
    grads = []
    for model in (eager, graphed):
        model.zero_grad(set_to_none=True)
        for ids in batches:
            model(input_ids=ids, labels=ids).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    errors = {n: rel(a, b) for (n, _), a, b in zip(graphed.named_parameters(), grads[1], grads[0])}
    assert max(errors.values()) < 2e-2, errors


def test_consecutive_layers_share_activation_buffers():
    _, graphed = model_pair()
    train(graphed, 1)
    layers = [layer.coat.graphs.captures for layer in graphed.model.layers]
    (c0,), (c1,) = layers[0].values(), layers[1].values()
    assert c1.inputs[0].data_ptr() == c0.output.data_ptr()


def test_two_forwards_before_a_backward_run_eagerly_and_stay_right():
    eager, graphed = model_pair()
    train(eager, 1)
    train(graphed, 1)  # captured; both models take the same step
    ids = torch.randint(0, VOCAB, (2, SEQ), device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    ids2 = ids.flip(1)
    expected = []
    for model in (eager, graphed):
        model.zero_grad(set_to_none=True)
        a = model(input_ids=ids, labels=ids).loss
        b = model(input_ids=ids2, labels=ids2).loss  # the second forward must not overwrite the first's buffers
        (a + b).backward()
        if model is graphed:
            replays = [sum(c.replays for c in layer.coat.graphs.captures.values()) for layer in model.model.layers]
            assert replays == [2, 2, 2], replays  # one in train(), one for `a`; `b` ran eagerly
        expected.append(([a.item(), b.item()], [p.grad.clone() for p in model.parameters()]))
    (le, ge), (lg, gg) = expected
    assert max(abs(x - y) / abs(y) for x, y in zip(lg, le)) < 1e-3
    errors = {n: rel(x, y) for (n, _), x, y in zip(graphed.named_parameters(), gg, ge)}
    assert max(errors.values()) < 2e-2, errors


def test_moved_parameters_recapture_and_checkpointing_and_eval_run_eagerly():
    _, graphed = model_pair()
    train(graphed, 1)
    layer = graphed.model.layers[0]
    with torch.no_grad():
        layer.mlp.down_proj.weight.data = layer.mlp.down_proj.weight.data.clone()  # a new storage
    train(graphed, 1)
    assert len(layer.coat.graphs.captures) == 1  # recaptured; the graphs of the old storage released
    graphed.eval()
    with torch.no_grad():
        graphed(input_ids=torch.zeros(1, 8, dtype=torch.long, device="cuda"))
    graphed.train()
    before = sum(c.replays for c in layer.coat.graphs.captures.values())
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # a replay would bypass them
        train(graphed, 1)
    graphed.gradient_checkpointing_enable()
    train(graphed, 1)
    assert sum(c.replays for c in layer.coat.graphs.captures.values()) == before


def test_a_layer_whose_parameters_moved_recaptures_and_trains_like_eager():
    """Layer 0 captures again after the later layers captured: in a pool of its own, so the later layers' replays
    cannot overwrite what its forward graph saved for its backward."""
    eager, graphed = model_pair()
    train(eager, 1)
    train(graphed, 1)
    for model in (eager, graphed):
        with torch.no_grad():
            for p in model.model.layers[0].parameters():
                p.data = p.data.clone()
    (l_e, g_e), (l_g, g_g) = train(eager, 3, seed=4), train(graphed, 3, seed=4)
    assert len(graphed.model.layers[0].coat.graphs.captures) == 1
    assert max(abs(a - b) / abs(b) for a, b in zip(l_g, l_e)) < 1e-3, (l_g, l_e)
    errors = {n: rel(a, b) for (n, _), a, b in zip(graphed.named_parameters(), g_g, g_e)}
    assert max(errors.values()) < 2e-2, errors


def test_shapes_beyond_the_limit_run_eagerly_with_the_eager_results():
    eager, graphed = model_pair()
    for layer in graphed.model.layers:
        layer.coat.config = layer.coat.config.replace(cuda_graph_shapes=2)
    g = torch.Generator(device="cuda").manual_seed(7)
    with pytest.warns(UserWarning, match="cuda_graph_shapes") as caught:
        for length in (SEQ, SEQ // 2, SEQ // 4, SEQ // 2, SEQ // 4):
            ids = torch.randint(0, VOCAB, (2, length), device="cuda", generator=g)
            results = []
            for model in (eager, graphed):
                model.zero_grad(set_to_none=True)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
            (le, ge), (lg, gg) = results
            assert abs(lg - le) / abs(le) < 1e-3, (length, lg, le)
            assert max(rel(a, b) for a, b in zip(gg, ge)) < 2e-2, length
    assert sum("cuda_graph_shapes" in str(w.message) for w in caught) == 1
    for layer in graphed.model.layers:
        shapes = sorted(key[0][0][0][1] for key in layer.coat.graphs.captures)
        replays = sorted(c.replays for c in layer.coat.graphs.captures.values())
        assert shapes == [SEQ // 2, SEQ] and replays == [1, 2], (shapes, replays)


def test_copies_of_a_graphed_model_leave_the_graphs_behind():
    _, graphed = model_pair()
    train(graphed, 1)
    clone = copy.deepcopy(graphed)
    assert clone.model.layers[0].coat.graphs is None
    train(clone, 1)
    assert len(clone.model.layers[0].coat.graphs.captures) == 1


@pytest.mark.parametrize("bad", [{"cuda_graphs": "yes"}])
def test_bad_option_type(bad):
    with pytest.raises(TypeError):
        ActivationConfig(**bad)
