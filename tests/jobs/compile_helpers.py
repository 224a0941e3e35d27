"""What the CPU and GPU torch.compile tests share: one training step of a model or of one decoder layer, returning
what the tests compare (compiled against eager); every FP8 block as a case, compiled together against eager."""
from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounterWithBackend

import coat_kernels.act as act
from coat_hf import ActivationConfig
from coat_kernels.act.rope import rope_split

BF16 = torch.bfloat16


def loss_and_grads(model, ids):
    """(loss, parameter gradients) of one causal-LM step on `ids` (labels = inputs)."""
    for p in model.parameters():
        p.grad = None
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def layer_step(layer, x, dy, position_embeddings):
    """[output, input gradient, parameter gradients...] of one decoder layer's forward and backward (copies)."""
    for p in layer.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    y = layer(x, position_embeddings=position_embeddings)
    y.backward(dy)
    return [t.detach().clone() for t in [y, x.grad] + [p.grad for p in layer.parameters()]]


def block_cases(backend, device="cpu"):
    """(name, fn(*tensors) -> tensor or tuple, make(rows) -> tensors) for every public block and rope_split, with
    every branch the ops have: weight pieces, biases, residual in and out, reuse_input, LayerNorm and RMSNorm,
    grouped q/k/v; `rows` tokens, on `device`."""
    cfg = dict(config=ActivationConfig(backend=backend))
    use_triton = backend == "triton"
    g = torch.Generator().manual_seed(0)

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, BF16)

    def w(*shape):
        return t(*shape, scale=0.1)

    def gamma(n):
        return (torch.rand(n, generator=g) * 0.4 + 0.8).to(device, BF16)

    cos, sin = (t.to(device) for t in rope_tables(48, 8))
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
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in outs])
    return [o.detach() for o in outs] + [leaf.grad for leaf in leaves]


def assert_same_bits(got, expected, names):
    for name, g, e in zip(names, got, expected):
        assert g is not None and torch.equal(g, e), name


def assert_every_block_compiles_to_the_eager_bits(backend, token_counts, device="cpu"):
    """All block_cases in one function compiled with aot_eager and dynamic shapes (one graph: no break): outputs
    and input gradients bit-equal to eager at each token count, the later counts reusing the first's graph. Token
    counts equal to no other size of a case (a coincidence would be guarded)."""
    cases = block_cases(backend, device)
    inputs = [len(make(16)) for _, _, make in cases]
    outputs_per_case = []

    def every_block(*tensors):
        outs, used = [], 0
        for (_, fn, _), n in zip(cases, inputs):
            out = fn(*tensors[used:used + n])
            outs += list(out) if isinstance(out, tuple) else [out]
            used += n
            if len(outputs_per_case) < len(cases):  # the eager call's record, for the names
                outputs_per_case.append(len(out) if isinstance(out, tuple) else 1)
        return tuple(outs)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(every_block, backend=counter, dynamic=True, fullgraph=True)
    frames = []
    for rows in token_counts:
        tensors = [t for _, _, make in cases for t in make(rows)]
        expected = run_block(every_block, tensors)
        names = [f"{name}: output {i}" for (name, _, _), n in zip(cases, outputs_per_case) for i in range(n)]
        names += [f"{name}: gradient of input {i}" for (name, _, _), n in zip(cases, inputs) for i in range(n)]
        assert_same_bits(run_block(compiled, tensors), expected, names)
        frames.append(counter.frame_count)
    assert frames[-1] == frames[0]  # no recompilation
