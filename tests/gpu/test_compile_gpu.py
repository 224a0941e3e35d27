"""torch.compile of converted Hugging Face models on the GPU: the Triton kernels inside COAT's custom ops, Inductor's
CUDA code around them. One decoder layer compiled alone (default mode and CUDA graphs) against eager COAT, a whole
causal LM compiled with no graph break, every FP8 block (each branch of the ops) compiled under dynamic shapes, and the
Trainer's torch_compile=True."""
import warnings

import pytest
import torch
from compile_helpers import assert_every_block_compiles_to_the_eager_bits, layer_step, loss_and_grads
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from coat_hf import ActivationConfig, coat_runtime, convert_to_coat

warnings.filterwarnings("ignore", category=RuntimeWarning)
VOCAB, SEQ, HIDDEN = 512, 256, 256


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def llama(layers=2):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=704, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ)
    model = LlamaForCausalLM(cfg).cuda().bfloat16()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.8, 1.2)
    return model


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def same_or_close(got, expected, deterministic, bound):
    """Where eager repeats its own bits, within 1e-4 (the compiled layer runs the same kernels; its last-bit
    differences, seen up to 5e-7 relative, come from the sums around them in Inductor's order); else (attention's
    backward accumulating with atomics) within `bound`."""
    for g, e in zip(got, expected):
        assert rel(g, e) < (1e-4 if deterministic else bound)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_a_compiled_decoder_layer_gives_eager_coat(mode):
    """Eager with its weight cache and gradient-amax hand-off; compiled (Inductor, fullgraph: no break inside the
    layer; "reduce-overhead": replayed as CUDA graphs) over steps with weight updates in between."""
    eager_model, model = llama(), llama()
    convert_to_coat(eager_model, ActivationConfig())
    convert_to_coat(model, ActivationConfig())
    eager, layer = eager_model.model.layers[0], model.model.layers[0]
    opt_eager = torch.optim.SGD(eager.parameters(), lr=1e-3)
    coat_runtime(eager_model).attach_optimizer(opt_eager)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    compiled = torch.compile(layer, mode=mode, fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, SEQ, HIDDEN, device="cuda", generator=g).bfloat16()
    dy = torch.randn(2, SEQ, HIDDEN, device="cuda", generator=g).bfloat16()
    pe = eager_model.model.rotary_emb(x, torch.arange(SEQ, device="cuda")[None])
    for _ in range(3):
        expected = layer_step(eager, x, dy, pe)
        deterministic = all(torch.equal(a, b) for a, b in zip(layer_step(eager, x, dy, pe), expected))
        got = layer_step(compiled, x, dy, pe)
        assert all(torch.isfinite(t.float()).all() for t in expected)
        assert torch.equal(got[0], expected[0])  # forward: the same kernels on the same values
        same_or_close(got[1:], expected[1:], deterministic, 0.02)
        opt_eager.step()
        opt.step()


def batch(seed, size=2):
    return torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(seed)).cuda()


def test_a_compiled_causal_lm_has_no_graph_break_and_gives_eager_coat():
    """Whole model with the default backend. Inductor also compiles the BF16 parts (embedding, final norm, chunked
    LM loss) in its own summation order; those last-bit differences flip FP8 roundings downstream, so compiled and
    eager COAT differ by about COAT's own FP8 error. The check: the compiled model's gradients are as close to the
    BF16 model's as eager COAT's are (within 1.5x + 0.02), and the losses agree."""
    ids = batch(1)
    explained = torch._dynamo.explain(convert_to_coat(llama(), ActivationConfig()))(input_ids=ids, labels=ids)
    assert explained.graph_break_count == 0 and not explained.break_reasons
    torch._dynamo.reset()
    bf16 = llama()
    eager = convert_to_coat(llama(), ActivationConfig())
    compiled = torch.compile(convert_to_coat(llama(), ActivationConfig()))
    for seed in (1, 2):
        (_, g_bf16), (l_eager, g_eager), (l_comp, g_comp) = (loss_and_grads(m, batch(seed))
                                                              for m in (bf16, eager, compiled))
        assert abs(l_comp.item() - l_eager.item()) < 1e-3 * l_eager.item()
        worse = {n: (rel(c, b), rel(e, b)) for (n, _), c, e, b in zip(eager.named_parameters(), g_comp, g_eager, g_bf16)
                 if rel(c, b) > 1.5 * rel(e, b) + 0.02}
        assert not worse, worse  # name: (compiled vs BF16, eager vs BF16)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = batch(i, 1)[0].cpu()
        return {"input_ids": ids, "labels": ids}


def test_trainer_with_torch_compile(tmp_path):
    """TrainingArguments(torch_compile=True) (Inductor) trains a converted model as the eager Trainer does."""
    losses = {}
    for compiled in (False, True):
        model = convert_to_coat(llama(), ActivationConfig())
        args = TrainingArguments(output_dir=str(tmp_path / str(compiled)), per_device_train_batch_size=4, max_steps=4,
                                 logging_steps=1, learning_rate=1e-3, report_to=[], disable_tqdm=True,
                                 save_strategy="no", torch_compile=compiled)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
        trainer.train()
        assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule) == compiled
        losses[compiled] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses[True]) == 4
    for a, b in zip(losses[True], losses[False]):
        assert abs(a - b) < 1e-2 * b, losses


def test_every_block_compiles_to_the_eager_bits_with_dynamic_shapes():
    """The CPU test's cases (tests/hf/test_compile.py) on the Triton kernels: bit-equal to eager at two token counts
    under one graph."""
    assert_every_block_compiles_to_the_eager_bits("triton", (40, 24), device="cuda")
