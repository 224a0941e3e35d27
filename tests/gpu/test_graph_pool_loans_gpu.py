"""Lending the CUDA-graph pool's memory between a backward and the next forward (coat_kernels.act.graph_pool_loans,
coat_ds.graph_pool_step): a lent tensor takes free pool memory instead of growing the reserved memory, also loans
larger than the graphs' memory, every step after the one that sizes the pool; the graphs replay afterwards with the
bits they give without a loan; a lent tensor that outlives its block makes the layers capture anew and is left
untouched; nothing is lent while a backward is pending; a ZeRO-2 engine with per-layer graphs steps with its gradient
partitions in the pool, with the bits of the same engine without the loans, with and without ZeRO-2's contiguous
gradient buffers; and without them it trains as with them.

    python3 -m pytest -q tests/gpu/test_graph_pool_loans_gpu.py
"""
import copy
import json

import pytest
import torch

from coat_hf import ActivationConfig, convert_to_coat
from coat_kernels.act.graph_pool_loans import lend

SEQ, VOCAB, HIDDEN = 512, 8192, 512


def llama(layers=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1408, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)


def graphed_model():
    return convert_to_coat(llama(), ActivationConfig(cache_weights=False, cuda_graphs=True))


def batches(steps, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, SEQ), device="cuda", generator=g) for _ in range(steps)]


def train_step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item()


def captures(model):
    return [len(layer.coat.graphs.captures) for layer in model.model.layers]


def run(model, ids_list, between=None):
    """Losses and final gradients of SGD steps; `between(step)` runs after each step's backward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for i, ids in enumerate(ids_list):
        losses.append(train_step(model, ids))
        if between is not None:
            between(i)
        opt.step()
    return losses, [p.grad.clone() for p in model.parameters()]


def test_a_loan_takes_pool_memory_and_the_replays_keep_their_bits():
    plain, lending = graphed_model(), graphed_model()
    pool = lending.coat_runtime.graph_pool
    grown = []

    def borrow(step):
        if step == 0:
            return
        before = torch.cuda.memory_reserved()
        with lend(pool) as loan:
            assert loan is not None
            t = loan.empty(64 << 20, torch.uint8, torch.device("cuda"))  # 64 MiB of garbage over the activations
            t.fill_(0xAB)
            del t
        grown.append(torch.cuda.memory_reserved() - before)

    data = batches(4)
    expected, got = run(plain, data), run(lending, data, borrow)
    assert got[0] == expected[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
    assert captures(lending) == [1] * 4
    # the first loan drops the pool (in pieces as the captures left it) and lends ordinary memory: the reserved
    # memory falls; the layers capture anew into one segment, where the later loans fit
    assert grown[0] < 0 and grown[1:] == [0, 0], grown


def pool_allocated_large(pool) -> int:
    """Bytes allocated in the pool's large segments, where loans come from (the caching allocator serves requests
    under 1 MiB from small segments of their own)."""
    pool_id = tuple(pool.handle)
    return sum(s["allocated_size"] for s in torch.cuda.memory_snapshot()
               if tuple(s.get("segment_pool_id", ())) == pool_id and s["segment_type"] == "large")


def test_loans_larger_than_the_activations_fit_in_one_piece_after_the_sizing_step():
    """At small micro-batches a ZeRO step's fp32 gradient partition is larger than the graphs' memory, so the sizing
    step makes the pool's segment just the loans' size: inside a later `lend` nothing in the pool's large segments is
    still allocated (the captures' cuBLAS workspaces would split it), so every later loan fits in one piece:
    nothing new reserved, no capture anew, and the replays keep their bits."""
    plain, lending = graphed_model(), graphed_model()
    pool = lending.coat_runtime.graph_pool
    sizes, grown, left = [], [], []
    cuda = torch.device("cuda")

    def borrow(step):
        if step == 0:
            sizes.extend([2 * pool.segment_bytes() + 1000, 3 << 20])  # two loans, one not a multiple of 512 bytes
            return
        before = torch.cuda.memory_reserved()
        with lend(pool) as loan:
            left.append(pool_allocated_large(pool) if not loan.sizing else 0)
            lent = [loan.empty(n, torch.uint8, cuda).fill_(0xAB) for n in sizes]
            del lent
        grown.append(torch.cuda.memory_reserved() - before)

    data = batches(6)
    expected, got = run(plain, data), run(lending, data, borrow)
    assert got[0] == expected[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
    assert grown[1:] == [0] * 4, (grown, left)
    assert left == [0] * 5, left
    # captured anew at step 2, into the segment the sizing loan of step 1 asked for, and replayed ever since
    assert [c.replays for layer in lending.model.layers for c in layer.coat.graphs.captures.values()] == [4] * 4


def test_a_lent_tensor_that_outlives_its_block_is_left_alone_and_the_layers_capture_anew():
    plain, lending = graphed_model(), graphed_model()
    pool = lending.coat_runtime.graph_pool
    kept = []

    def borrow(step):
        if step == 1:  # the first loan sizes the pool: its tensors are ordinary memory, keeping one is harmless
            with lend(pool) as loan:
                kept.append(loan.empty(1 << 20, torch.float32, torch.device("cuda")).fill_(6.0))
        if step == 2:
            with pytest.warns(UserWarning, match="outlived"):
                with lend(pool) as loan:
                    kept.append(loan.empty(1 << 20, torch.float32, torch.device("cuda")).fill_(7.0))

    data = batches(5)
    expected, got = run(plain, data), run(lending, data, borrow)
    assert got[0] == expected[0]
    assert bool((kept[0] == 6.0).all()) and bool((kept[1] == 7.0).all())
    # captured anew at step 2 (the pool sized), then at step 3 (the graphs the kept tensor overlaps dropped),
    # replayed at steps 3 and 4
    assert [c.replays for layer in lending.model.layers for c in layer.coat.graphs.captures.values()] == [2] * 4


def test_nothing_is_lent_while_a_backward_is_pending():
    model = graphed_model()
    ids = batches(1)[0]
    train_step(model, ids)
    loss = model(input_ids=ids, labels=ids).loss  # a replayed forward whose backward has not run
    with lend(model.coat_runtime.graph_pool) as loan:
        assert loan is None
    loss.backward()


def ds_engine(tmp_path, model, lending=True, contiguous_gradients=True):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "contiguous_gradients": contiguous_gradients},
              "steps_per_print": 10 ** 6,
              "optimizer": {"type": "CoatFP8AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
              "coat": {"fp8_activations": True, "cuda_graphs": True}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if not lending:  # DeepSpeed's own step and flatten back
        del engine.optimizer.step
        engine.optimizer.flatten = engine.optimizer.flatten.__wrapped__
    return engine


@pytest.fixture
def single_rank(monkeypatch):
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29731")):
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("contiguous_gradients", [True, False], ids=["contiguous", "gradients_in_grad"])
def test_zero2_steps_borrow_the_graph_pool_with_the_same_bits(tmp_path, single_rank, contiguous_gradients):
    """With ZeRO-2's contiguous gradient buffers (DeepSpeed's default) and without them (the gradients stay in `.grad`
    until the step: less memory beside the pool during the backward)."""
    pytest.importorskip("deepspeed")
    base = llama()
    engines = [ds_engine(tmp_path, copy.deepcopy(base), lending, contiguous_gradients) for lending in (False, True)]
    data = batches(5, seed=3)
    results = []
    for engine in engines:
        losses, growth = [], []
        for ids in data:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            before = torch.cuda.memory_reserved()
            torch.cuda.reset_peak_memory_stats()
            engine.step()
            growth.append(torch.cuda.max_memory_reserved() - before)
            losses.append(loss.item())
        results.append((losses, [p.detach().clone() for p in engine.module.parameters()], growth))
    (plain_losses, plain_params, plain_growth), (losses, params, growth) = results
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
    assert captures(engines[1].module) == [1] * 4
    partition = sum(p.numel() for p in base.parameters()) * 4  # the fp32 gradient partition, in bytes
    # the first step creates the optimizer state, and its loan drops the pool to size it (the layers capture anew
    # into one segment at step 2): from then on the steps' copies come from the pool
    assert max(growth[2:]) < partition / 2, (growth, partition)
    print(json.dumps({"growth_without_loans": plain_growth, "growth_with_loans": growth, "partition": partition}))


def test_zero2_without_contiguous_gradients_trains_like_with_them(tmp_path, single_rank):
    """ZeRO-2 with the gradients left in `.grad` until the step trains the graphed model as with DeepSpeed's
    contiguous gradient buffers (one rank): the same first loss, and the same values after four steps up to the last
    bits (the two paths may sum the gradient norm for clipping in another order or dtype)."""
    pytest.importorskip("deepspeed")
    base = llama()
    data = batches(4, seed=5)
    results = []
    for contiguous in (True, False):
        engine = ds_engine(tmp_path, copy.deepcopy(base), True, contiguous)
        losses = []
        for ids in data:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        results.append((losses, [p.detach().float().clone() for p in engine.module.parameters()]))
    (losses, params), (other_losses, other_params) = results
    assert losses[0] == other_losses[0]
    assert losses == pytest.approx(other_losses, rel=1e-3)
    for start, a, b in zip(base.parameters(), params, other_params):
        moved = (a - start.detach().float()).abs().max().item()  # how far training moved the tensor
        assert moved > 0 and (a - b).abs().max().item() <= 0.1 * moved, (moved, (a - b).abs().max().item())
