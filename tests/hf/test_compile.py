"""torch.compile of COAT: the FP8 blocks as torch.library custom ops (coat_kernels.act.compiled_ops) and converted
Hugging Face models on them. Checked on CPU: Dynamo's graph breaks against the BF16 model, compiled loss and
gradients against eager COAT (bit-exact: the ops run the same kernels, and eager's weight cache and gradient-amax
hand-off change no value; those models use eager attention, see EXACT_ATTENTION), every block under dynamic shapes,
the fake implementations (torch.library.opcheck on each op as the blocks call it), one decoder layer compiled by
Inductor, and the Trainer's torch_compile=True."""
import warnings

import pytest
import torch
from compile_helpers import layer_step, loss_and_grads
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Trainer, TrainingArguments

import coat_kernels.act as act
from coat_hf import ActivationConfig, coat_runtime, convert_to_coat
from coat_kernels.act.rope import rope_split
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


def assert_same_bits(got, expected, names):
    for name, g, e in zip(names, got, expected):
        assert g is not None and torch.equal(g, e), name


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


def block_cases(backend):
    """(name, fn(*tensors) -> tensor or tuple, make(rows) -> tensors) for every public block and rope_split, with
    every branch the ops have: weight pieces, biases, residual in and out, reuse_input, LayerNorm and RMSNorm,
    grouped q/k/v; `rows` tokens."""
    cfg = dict(config=ActivationConfig(backend=backend))
    use_triton = backend == "triton"
    g = torch.Generator().manual_seed(0)

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(BF16)

    def w(*shape):
        return t(*shape, scale=0.1)

    def gamma(n):
        return (torch.rand(n, generator=g) * 0.4 + 0.8).to(BF16)

    cos, sin = rope_tables(48, 8)
    return [
        ("fp8_linear pieces + bias", lambda x, w1, w2, b: act.fp8_linear(x, (w1, w2), b, **cfg),
         lambda r: [t(2, r, 32), w(16, 32), w(32, 32), t(48)]),
        ("fp8_linear reuse_input", lambda x, w1: act.fp8_linear(x, w1, reuse_input=True, **cfg),
         lambda r: [t(r, 32), w(32, 32)]),
        ("fp8_norm_linear residual_out", lambda x, gm, w1, w2: act.fp8_norm_linear(
            x, gm, None, (w1, w2), residual_out=True, **cfg), lambda r: [t(r, 32), gamma(32), w(32, 32), w(16, 32)]),
        ("fp8_add_norm_linear layernorm", lambda x, res, gm, nb, w1, b: act.fp8_add_norm_linear(
            x, res, gm, nb, w1, b, norm="layernorm", zero_centered_gamma=True, **cfg),
         lambda r: [t(2, r, 32), t(2, r, 32), t(32, scale=0.1), t(32), w(48, 32), t(48)]),
        ("fp8_swiglu_linear", lambda x, w1, b: act.fp8_swiglu_linear(x, w1, b, **cfg),
         lambda r: [t(r, 64), w(32, 32), t(32)]),
        ("fp8_norm_swiglu_mlp residual", lambda x, res, gm, w1, w2, w3: act.fp8_norm_swiglu_mlp(
            x, gm, None, (w1, w2), w3, residual=res, **cfg),
         lambda r: [t(r, 32), t(r, 32), gamma(32), w(32, 32), w(32, 32), w(32, 32)]),
        ("fp8_norm_swiglu_mlp biases layernorm", lambda x, gm, nb, w1, b1, w2, b2: act.fp8_norm_swiglu_mlp(
            x, gm, nb, w1, w2, b1, b2, norm="layernorm", **cfg),
         lambda r: [t(2, r, 32), gamma(32), t(32), w(64, 32), t(64), w(32, 32), t(32)]),
        ("fp8_swiglu_linear gelu_tanh", lambda x, w1: act.fp8_swiglu_linear(x, w1, activation="gelu_tanh", **cfg),
         lambda r: [t(r, 64), w(32, 32)]),
        ("fp8_norm_swiglu_mlp gelu_tanh", lambda x, res, gm, w1, w2: act.fp8_norm_swiglu_mlp(
            x, gm, None, w1, w2, residual=res, zero_centered_gamma=True, activation="gelu_tanh", **cfg),
         lambda r: [t(r, 32), t(r, 32), t(32, scale=0.1), w(64, 32), w(32, 32)]),
        ("fp8_gelu", lambda x: act.fp8_gelu(x, **cfg), lambda r: [t(2, r, 32)]),
        ("rope_split split", lambda qkv: rope_split(qkv, cos, sin, 16, 2, use_triton), lambda r: [t(r, 8 * 16)]),
        ("rope_split grouped", lambda qkv: rope_split(qkv, cos[:24], sin[:24], 16, 1, use_triton, layout="grouped",
                                                      rows_per_position=2), lambda r: [t(r, 6 * 16)]),
    ]


def rope_tables(positions, half):
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * torch.linspace(0.05, 1.0, half)
    return angles.cos(), angles.sin()


def run_block(fn, tensors, seed=0):
    """Outputs and input gradients of fn on leaves made from `tensors`, random output gradients."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs])
    return [o.detach() for o in outs] + [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("backend,token_counts", [("torch", (40, 24)), ("triton", (24,))])  # (interpreter: slow)
def test_every_block_compiles_to_the_eager_bits_with_dynamic_shapes(backend, token_counts):
    """All cases in one compiled function (one graph: no break), at token counts equal to no other size of a case
    (a coincidence would be guarded), the second reusing the first's graph."""
    cases = block_cases(backend)
    inputs = [len(make(16)) for _, _, make in cases]

    def every_block(*tensors):
        outs, used = [], 0
        for (_, fn, _), n in zip(cases, inputs):
            out = fn(*tensors[used:used + n])
            outs += list(out) if isinstance(out, tuple) else [out]
            used += n
        return tuple(outs)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(every_block, backend=counter, dynamic=True, fullgraph=True)
    frames = []
    for rows in token_counts:
        per_case = [make(rows) for _, _, make in cases]
        with torch.no_grad():
            outputs = [fn(*tensors) for (_, fn, _), tensors in zip(cases, per_case)]
        names = [f"{name}: output {i}" for (name, _, _), out in zip(cases, outputs)
                 for i in range(len(out) if isinstance(out, tuple) else 1)]
        names += [f"{name}: gradient of input {i}" for (name, _, _), n in zip(cases, inputs) for i in range(n)]
        tensors = [t for case in per_case for t in case]
        assert_same_bits(run_block(compiled, tensors), run_block(every_block, tensors), names)
        frames.append(counter.frame_count)
    assert frames[-1] == frames[0]  # no recompilation


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
