"""torch.compile of COAT: the FP8 blocks as torch.library custom ops (coat_kernels.act.compiled_ops) and converted
Hugging Face models on them. Checked on CPU: Dynamo's graph breaks against the BF16 model, compiled loss and
gradients against eager COAT (bit-exact: the ops run the same kernels, and eager's weight cache and gradient-amax
hand-off change no value; those models use eager attention, see EXACT_ATTENTION), every block under dynamic shapes
(torch backend; the Triton kernels' on the GPU), the fake implementations (torch.library.opcheck on each op as the
blocks call it), one decoder layer compiled by Inductor, and the Trainer's torch_compile=True."""
import warnings

import pytest
import torch
from compile_helpers import (assert_every_block_compiles_to_the_eager_bits, assert_same_bits, block_cases, layer_step,
                             loss_and_grads, run_block)
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Trainer, TrainingArguments

from coat_hf import ActivationConfig, coat_runtime, convert_to_coat
from test_hf import batch, tiny

warnings.filterwarnings("ignore", category=RuntimeWarning)
BF16 = torch.bfloat16
# While tracing, transformers cannot skip the causal mask, so under torch.compile its sdpa backend runs the masked
# kernel with k and v repeated per query head, where eager runs is_causal with grouped-query attention: q/k/v
# gradients differ by BF16 rounding (which E5M2 gradients then amplify). Eager attention takes one path in both.
EXACT_ATTENTION = dict(attn_implementation="eager")
OPS = ("fp8_linear", "fp8_norm_linear", "fp8_swiglu_linear", "fp8_norm_swiglu_mlp", "fp8_act", "rope_split")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# the coat ops of one converted decoder layer, per family
LAYER_OPS = {"llama": {"fp8_norm_linear": 1, "fp8_linear": 1, "fp8_norm_swiglu_mlp": 1, "rope_split": 1},
             "qwen2": {"fp8_norm_linear": 1, "fp8_linear": 1, "fp8_norm_swiglu_mlp": 1, "rope_split": 1},
             # Hugging Face's RoPE after the q/k norms
             "qwen3": {"fp8_norm_linear": 1, "fp8_linear": 1, "fp8_norm_swiglu_mlp": 1},
             "gemma3_text": {"fp8_norm_linear": 1, "fp8_linear": 1, "fp8_norm_swiglu_mlp": 1},
             # no input norms: q/k/v, o_proj and gate/up are plain FP8 GEMMs
             "olmo2": {"fp8_linear": 3, "fp8_swiglu_linear": 1}}


@pytest.mark.parametrize("family", list(LAYER_OPS))
def test_a_converted_model_has_no_more_graph_breaks_than_bf16(family):
    ids = batch()
    bf16 = torch._dynamo.explain(tiny(family))(input_ids=ids, labels=ids)
    torch._dynamo.reset()
    coat = torch._dynamo.explain(convert_to_coat(tiny(family), ActivationConfig(backend="torch")))(
        input_ids=ids, labels=ids)
    assert coat.graph_break_count <= bf16.graph_break_count and coat.graph_count <= bf16.graph_count
    assert not coat.break_reasons, [str(r.reason)[:300] for r in coat.break_reasons]
    targets = [str(n.target) for g in coat.graphs for n in g.graph.nodes if n.op == "call_function"]
    counts = {op: targets.count(f"coat.{op}.default") for op in OPS}
    assert counts == {op: 2 * LAYER_OPS[family].get(op, 0) for op in OPS}, targets  # two layers


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "olmo2", "gemma3_text"])
def test_compiled_model_gives_the_eager_loss_and_gradients(family):
    """aot_eager against eager COAT with its weight cache and gradient-amax hand-off on, across an optimizer step
    (the compiled model quantizes the updated weights)."""
    eager = convert_to_coat(tiny(family, **EXACT_ATTENTION), ActivationConfig(backend="torch"))
    model = convert_to_coat(tiny(family, **EXACT_ATTENTION), ActivationConfig(backend="torch"))
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.5)
    coat_runtime(eager).attach_optimizer(opt_eager)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    compiled = torch.compile(model, backend="aot_eager")
    names = [n for n, _ in model.named_parameters()]
    for step in range(2):
        ids = batch(seed=step + 1)
        (l_eager, g_eager), (l_comp, g_comp) = loss_and_grads(eager, ids), loss_and_grads(compiled, ids)
        assert torch.equal(l_comp, l_eager)
        assert_same_bits(g_comp, g_eager, names)
        opt_eager.step()
        opt.step()


def layer_inputs(model, b, s, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, 64, generator=g).to(BF16)
    return x, torch.randn(b, s, 64, generator=g).to(BF16), model.model.rotary_emb(x, torch.arange(s)[None])


def test_one_decoder_layer_compiles_with_inductor_to_the_eager_bits():
    """A converted decoder layer compiled alone (as the benchmarks compile it) by the default backend: Inductor's
    CPU code for what is not COAT's (views, the residual add, attention)."""
    model = convert_to_coat(tiny("llama"), ActivationConfig(backend="torch"))
    layer = model.model.layers[0]
    x, dy, pe = layer_inputs(model, 2, 16)
    expected = layer_step(layer, x, dy, pe)
    got = layer_step(torch.compile(layer, fullgraph=True), x, dy, pe)  # fullgraph: no break inside the layer
    assert_same_bits(got, expected, ["y", "dx"] + [n for n, _ in layer.named_parameters()])


def test_a_compiled_layer_takes_dynamic_shapes():
    model = convert_to_coat(tiny("llama"), ActivationConfig(backend="torch"))
    layer = model.model.layers[1]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, dynamic=True, fullgraph=True)
    frames = []
    for b, s in ((2, 40), (3, 24)):
        x, dy, pe = layer_inputs(model, b, s)
        assert_same_bits(layer_step(compiled, x, dy, pe), layer_step(layer, x, dy, pe), range(99))
        frames.append(counter.frame_count)
    assert frames[1] == frames[0]  # no recompilation


# The Triton kernels' case runs on the GPU (tests/gpu/test_compile_gpu.py; about a minute under the interpreter).
def test_every_block_compiles_to_the_eager_bits_with_dynamic_shapes():
    assert_every_block_compiles_to_the_eager_bits("torch", (40, 24))


class RecordCoatOps(TorchDispatchMode):
    """Every call of a coat:: op (forward and backward ops alike) with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "coat":
            self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def test_fake_implementations_match_the_ops(monkeypatch):
    """torch.library.opcheck of every op as the blocks call it, forward and backward: the fake implementation's
    shapes, dtypes and strides against the op's outputs, and the autograd registration. The blocks take their
    compiled path eagerly here (is_compiling patched), so the ops run for real. (opcheck's test_schema and
    test_aot_dispatch_dynamic need arithmetic on float8 tensors that torch lacks on CPU; the ops' AOT dispatch under
    dynamic shapes is the test above.)"""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    recorder = RecordCoatOps()
    with recorder:
        for _, fn, make in block_cases("torch"):
            run_block(fn, make(24))
    called = {func.name().split("::")[1] for func, _, _ in recorder.calls}
    assert called == set(OPS) | {op + "_backward" for op in OPS}, called
    for func, args, kwargs in recorder.calls:
        if func.name().endswith("_backward"):  # no autograd formula of their own (no double backward)
            args = torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, args)
        torch.library.opcheck(func, args, kwargs, test_utils=("test_faketensor", "test_autograd_registration"))


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = batch(seed=i, size=1)[0]
        return {"input_ids": ids, "labels": ids}


def test_trainer_with_torch_compile(tmp_path):
    """TrainingArguments(torch_compile=True) (backend aot_eager) trains a converted model to the eager Trainer's
    losses and weights."""
    runs = {}
    for compiled in (False, True):
        model = convert_to_coat(tiny("llama", **EXACT_ATTENTION), ActivationConfig(backend="torch"))
        args = TrainingArguments(output_dir=str(tmp_path / str(compiled)), per_device_train_batch_size=2, max_steps=3,
                                 logging_steps=1, learning_rate=1e-2, report_to=[], use_cpu=True, disable_tqdm=True,
                                 save_strategy="no", torch_compile=compiled,
                                 torch_compile_backend="aot_eager" if compiled else None)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
        trainer.train()
        assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule) == compiled
        runs[compiled] = ([h["loss"] for h in trainer.state.log_history if "loss" in h],
                          {n: p.detach().clone() for n, p in model.named_parameters()})
    (losses_eager, weights_eager), (losses, weights) = runs[False], runs[True]
    assert len(losses) == 3 and losses == losses_eager
    assert_same_bits(weights.values(), weights_eager.values(), weights)
