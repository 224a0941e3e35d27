"""The activation kernels on the GPU against their torch references (run on the same GPU), at a Llama-like shape:
1x16 group quantization bit-exact; elsewhere FP8 codes may differ in at most 1e-3 of the elements (fp32 math in a
different order, e.g. exp), values, statistics
and partial amaxes within 1e-3 relative; scales reduced inside the producing launch equal a separate reduction; the
COAT Llama layer (Hugging Face's, converted by coat_hf) on the kernels against the same layer on the references; a
CUDA-graph capture of the layer replays the eager gradients."""
import math

import pytest
import torch

from coat_hf import convert_to_coat
from coat_kernels.act import ActivationConfig, CoatRuntime
from coat_kernels.act import group_quant as GQ
from coat_kernels.act import norm as N
from coat_kernels.act import pointwise as P
from coat_kernels.act import rope as R
from coat_kernels.act import swiglu as S
from coat_kernels.act import tensor_quant as TQ
from coat_kernels.act.scaling import ScaleTickets, StageOneAmax, finalize_scale
from coat_kernels.formats import E4M3, E5M2

M, H, F = 4096, 4096, 11008
TOL = 1e-3


def differing(a, b):
    a, b = a.float(), b.float()
    return 1.0 - ((a == b) | (a.isnan() & b.isnan())).float().mean().item()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def amax_rel(a: StageOneAmax, b: StageOneAmax):
    return abs(a.partials.max().item() - b.partials.max().item()) / b.partials.max().item()


@pytest.fixture(scope="module")
def inputs():
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, H, **bf16) * torch.logspace(-2, 2, H, device="cuda").bfloat16()
    return dict(x=x, res=torch.randn(M, H, **bf16), gu=torch.randn(M, 2 * F, **bf16) * 3,
                dp=torch.randn(M, F, **bf16), w=1 + 0.1 * torch.randn(H, device="cuda"))


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_group_and_tensor_quantization(inputs, fmt):
    x = inputs["x"]
    a, b = GQ.group_quantize(x, fmt, True, partial_amax=True), GQ.group_quantize(x, fmt, False, partial_amax=True)
    # bit-exact: bf16 inputs over bf16 scales often land exactly on an FP8 midpoint, where only IEEE division rounds
    # as the reference does
    assert differing(a[0], b[0]) == 0 and differing(a[1], b[1]) == 0
    assert rel(GQ.group_dequantize(a[0], a[1], True, torch.float32), GQ.group_dequantize(b[0], b[1], False,
                                                                                          torch.float32)) == 0
    s = TQ.tensor_scale(x, fmt, False)
    assert torch.equal(TQ.tensor_scale(x, fmt, True), s)
    ca, cb = TQ.cast(x, s, fmt, True, write_t=True), TQ.cast(x, s, fmt, False, write_t=True)
    assert differing(ca[0], cb[0]) == 0 and differing(ca[1], cb[1]) == 0
    xs = x.clone()
    xs[5, 7] = float("inf")
    assert math.isnan(TQ.tensor_scale(xs, fmt, True).item())


def test_norm_kernels(inputs):
    x, res, w = inputs["x"], inputs["res"], inputs["w"]
    a, b = N.norm_forward(x, w, None, True, residual=res), N.norm_forward(x, w, None, False, residual=res)
    assert differing(a[1], b[1]) <= TOL and differing(a[2], b[2]) <= TOL and rel(a[4], b[4]) <= TOL
    assert amax_rel(a[5], b[5]) <= TOL
    s = finalize_scale(b[5], E4M3, False)
    ca = N.norm_cast(*b[1:5], w, None, s, True, write_t=True)
    cb = N.norm_cast(*b[1:5], w, None, s, False, write_t=True)
    assert differing(ca[0], cb[0]) <= TOL and differing(ca[1], cb[1]) <= TOL
    da = N.norm_backward(*b[1:5], w, res, True, dres=x, partial_amax=True)
    db = N.norm_backward(*b[1:5], w, res, False, dres=x, partial_amax=True)
    assert rel(da[0], db[0]) <= TOL and rel(da[1], db[1]) <= TOL and amax_rel(da[3], db[3]) <= TOL


def test_swiglu_kernels(inputs):
    gu, dp = inputs["gu"], inputs["dp"]
    a, b = S.swiglu_forward(gu, True, write_out=True), S.swiglu_forward(gu, False, write_out=True)
    assert differing(a[0], b[0]) <= TOL and differing(a[1], b[1]) <= TOL
    assert amax_rel(a[2], b[2]) <= TOL and rel(a[3], b[3]) <= TOL
    s = finalize_scale(b[2], E4M3, False)
    ca, cb = S.swiglu_cast(b[0], b[1], s, True, write_t=True), S.swiglu_cast(b[0], b[1], s, False, write_t=True)
    assert differing(ca[0], cb[0]) <= TOL and differing(ca[1], cb[1]) <= TOL
    ds = TQ.tensor_scale(S.swiglu_grad_reference(b[0], b[1], dp), E5M2, False)
    ga, gb = S.swiglu_backward_cast(b[0], b[1], dp, ds, True), S.swiglu_backward_cast(b[0], b[1], dp, ds, False)
    assert differing(ga[0], gb[0]) <= TOL and differing(ga[1], gb[1]) <= TOL
    da, db = S.swiglu_backward(b[0], b[1], dp, True), S.swiglu_backward(b[0], b[1], dp, False)
    assert rel(da[0], db[0]) <= TOL and amax_rel(da[1], db[1]) <= TOL
    amax_t, product_t = S.swiglu_backward_amax(b[0], b[1], dp, True, product_scale=s)
    assert amax_rel(amax_t, db[1]) <= TOL and differing(product_t, cb[1]) <= TOL


@pytest.mark.parametrize("layout,rows_per_position", [("split", 1), ("grouped", 4)])
@pytest.mark.parametrize("kv_heads", [32, 8])
def test_rope_split(kv_heads, layout, rows_per_position):
    hd = 128
    width = (32 + 2 * kv_heads) * hd
    cos, sin = R.rope_tables(2048, hd, device="cuda")
    qkv = torch.randn(M, width, device="cuda", dtype=torch.bfloat16)
    outs = []
    for tri in (True, False):
        q = qkv.clone().requires_grad_()
        o = R.rope_split(q, cos, sin, hd, kv_heads, tri, layout=layout, rows_per_position=rows_per_position)
        torch.autograd.backward(o, [t * 0.5 for t in o])
        outs.append((o, q.grad))
    assert max(rel(a, b) for a, b in zip(outs[0][0], outs[1][0])) <= TOL and rel(outs[0][1], outs[1][1]) <= TOL


@pytest.mark.parametrize("name", ["silu", "gelu"])
def test_pointwise(inputs, name):
    a, b = P.act_forward(inputs["x"], name, True), P.act_forward(inputs["x"], name, False)
    assert rel(a[0], b[0]) <= TOL and differing(a[1], b[1]) <= TOL


def test_scale_reduced_in_the_launch_equals_a_separate_reduction(inputs):
    """Repeated launches: an ordering bug in the last-ticket reduction would show now and then."""
    x, res, w, gu, dp = inputs["x"], inputs["res"], inputs["w"], inputs["gu"], inputs["dp"]
    tickets = ScaleTickets()
    q, e, *_ = S.swiglu_forward(gu, False)
    _, nq, ne, mean, rstd, _ = N.norm_forward(x, w, None, False, residual=res)
    mismatches = 0
    for _ in range(5):
        produced = [(TQ.amax_partials(x, True, E4M3, tickets), E4M3),
                    (N.norm_forward(x, w, None, True, residual=res, tickets=tickets)[5], E4M3),
                    (S.swiglu_forward(gu, True, tickets=tickets)[2], E4M3),
                    (S.swiglu_backward_amax(q, e, dp, True, tickets=tickets)[0], E5M2),
                    (N.norm_backward(nq, ne, mean, rstd, w, res, True, dres=x, partial_amax=True,
                                     tickets=tickets)[3], E5M2)]
        for amax, fmt in produced:
            separate = finalize_scale(StageOneAmax(amax.partials.clone()), fmt, True)
            mismatches += int(not torch.equal(finalize_scale(amax, fmt, True), separate))
    assert mismatches == 0


class _Layer(torch.nn.Module):
    """Layer 0 of a one-layer Hugging Face Llama converted by coat_hf, fed with its model's rotary embedding."""

    def __init__(self, model):
        super().__init__()
        self.layer = model.layers[0]
        positions = torch.arange(512, device="cuda")[None]
        self.rotary = model.rotary_emb(torch.zeros(1, device="cuda", dtype=torch.bfloat16), positions)

    def forward(self, x):
        return self.layer(x, position_embeddings=self.rotary)


def _layer(config, runtime=None):
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=8,
                      num_hidden_layers=1, vocab_size=16, max_position_embeddings=512, rms_norm_eps=1e-5)
    model = LlamaModel(cfg).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in model.layers.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    convert_to_coat(model, config, runtime=runtime or CoatRuntime())
    return _Layer(model)


def test_llama_layer_kernels_match_the_layer_on_torch_references():
    x = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16)
    outs = []
    for backend in ("triton", "torch"):
        layer = _layer(ActivationConfig(backend=backend))
        xb = x.clone().requires_grad_()
        y = layer(xb)
        y.float().square().mean().backward()
        outs.append((y, xb.grad, [p.grad for p in layer.parameters()]))
    assert rel(outs[0][0], outs[1][0]) < 1e-2 and rel(outs[0][1], outs[1][1]) < 3e-2
    assert all(rel(a, b) < 5e-2 for a, b in zip(outs[0][2], outs[1][2]))


def test_llama_layer_replays_as_a_cuda_graph():
    layer = _layer(ActivationConfig(cache_weights=False))
    x = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    params = list(layer.parameters())
    with torch.cuda.stream(stream):
        for _ in range(3):
            for p in params + [x]:
                p.grad = None
            layer(x).backward(dy)
        eager = [t.grad.clone() for t in params + [x]]
        for p in params + [x]:
            p.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            layer(x).backward(dy)
        graph.replay()
    torch.cuda.synchronize()
    assert max(rel(t.grad, e) for t, e in zip(params + [x], eager)) < 1e-6


def test_weight_cache_in_a_cuda_graph_quantizes_the_weights_of_each_replay():
    """A graph captured at the step count of an eager forward still holds the weight quantization: replayed after
    the weights change and the clock ticks, it gives the gradients of the new weights (stale FP8 copies would not)."""
    runtime = CoatRuntime()
    layer = _layer(ActivationConfig(), runtime=runtime)
    params = list(layer.parameters())
    runtime.attach_optimizer(torch.optim.SGD(params, lr=0.0))
    x = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def clear():
        for t in params + [x]:
            t.grad = None

    with torch.cuda.stream(stream):
        for _ in range(2):
            clear()
            layer(x).backward(dy)  # the caches now hold this clock count's copies
        clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            layer(x).backward(dy)
        with torch.no_grad():
            for p in params:
                p.mul_(0.5)
        runtime.clock.tick()  # what an optimizer step does
        graph.replay()
        replayed = [t.grad.clone() for t in params + [x]]
        clear()
        layer(x).backward(dy)
        eager = [t.grad.clone() for t in params + [x]]
    torch.cuda.synchronize()
    assert max(rel(a, b) for a, b in zip(replayed, eager)) < 1e-3  # stale FP8 weights: O(1)
