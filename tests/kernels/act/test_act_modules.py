"""The activation half's nn.Modules: the Llama decoder layer against a BF16/fp32 Llama layer with the same
parameters (outputs and gradients within the blocks' error bounds), what it saves for backward, parameter names,
grouped-query attention, and a step clock that re-quantizes weights once per optimizer step."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from coat_kernels.act import ActivationConfig, CoatLlamaDecoderLayer, CoatRuntime, Fp8Linear, Norm

warnings.filterwarnings("ignore", category=RuntimeWarning)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def reference_layer(layer, x):
    """The same decoder layer in plain fp32 torch (Hugging Face's Llama math)."""
    p = {n: t.float() for n, t in layer.named_parameters()}
    b, s, h = x.shape
    hq, hkv, d = layer.heads, layer.kv_heads, layer.head_dim
    y = F.rms_norm(x, (h,), p["layernorm_qkv.layer_norm_weight"], 1e-5)
    q, k, v = F.linear(y, p["layernorm_qkv.weight"]).split((hq * d, hkv * d, hkv * d), -1)
    cos, sin = (torch.cat([t[:s], t[:s]], -1)[None, None] for t in (layer.rope_cos, layer.rope_sin))

    def heads(t, n):
        return t.view(b, s, n, d).transpose(1, 2)

    def rot(t):
        return t * cos + torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1) * sin

    q, k, v = rot(heads(q, hq)), rot(heads(k, hkv)), heads(v, hkv)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != hq).transpose(1, 2)
    hsum = x + F.linear(o.reshape(b, s, hq * d), p["proj.weight"])
    g, u = F.linear(F.rms_norm(hsum, (h,), p["layernorm_mlp.layer_norm_weight"], 1e-5),
                    p["layernorm_mlp.fc1_weight"]).chunk(2, -1)
    return hsum + F.linear(F.silu(g) * u, p["layernorm_mlp.fc2_weight"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_llama_layer_matches_fp32_reference(backend, kv_heads):
    torch.manual_seed(0)
    layer = CoatLlamaDecoderLayer(64, 96, 4, kv_heads, max_seq_len=32, config=ActivationConfig(backend=backend))
    assert [n for n, _ in layer.named_parameters()] == [
        "layernorm_qkv.layer_norm_weight", "layernorm_qkv.weight", "proj.weight", "layernorm_mlp.layer_norm_weight",
        "layernorm_mlp.fc1_weight", "layernorm_mlp.fc2_weight"]
    x = torch.randn(2, 24, 64)
    dy = torch.randn(2, 24, 64)
    xb = x.bfloat16().requires_grad_()
    out = layer(xb)
    out.backward(dy.bfloat16())
    xr = x.clone().requires_grad_()
    ref = reference_layer(layer, xr)
    ref.backward(dy)
    assert out.dtype == torch.bfloat16 and rel(out, ref) < 0.05
    assert rel(xb.grad, xr.grad) < 0.12
    for name, prm in layer.named_parameters():
        assert prm.grad is not None and torch.isfinite(prm.grad.float()).all(), name


def test_llama_layer_saves_fp8_where_the_design_says():
    torch.manual_seed(1)
    b, s, h, f = 2, 16, 64, 96
    layer = CoatLlamaDecoderLayer(h, f, 4, 2, max_seq_len=32, config=ActivationConfig(backend="torch"))
    params = {id(p) for p in layer.parameters()} | {id(layer.rope_cos), id(layer.rope_sin)}
    counts = {}

    def pack(t):
        if id(t) not in params:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(torch.randn(b, s, h).bfloat16().requires_grad_())
    tokens = b * s
    # norm1 input and norm2 input (E4M3 1x16), gate/up (E4M3 1x16); the projection reuses the attention output
    assert counts[torch.float8_e4m3fn] == tokens * h * 2 + tokens * 2 * f


def test_modules_warn_once_and_cache_after_attach():
    runtime = CoatRuntime()
    lin = Fp8Linear(64, 32, config=ActivationConfig(backend="torch"), runtime=runtime, params_dtype=torch.float32)
    x = torch.randn(8, 64)
    with pytest.warns(RuntimeWarning, match="attach_optimizer"):
        lin(x)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    runtime.attach_optimizer(opt)
    lin(x.requires_grad_()).sum().backward()  # dgrad needs the transposed weight
    assert lin.weight_cache.w8 is not None and lin.weight_cache.w8_t is not None
    before = lin.weight_cache.scale
    opt.step()
    lin(x)
    assert lin.weight_cache.scale is not before  # a new quantization after the step


def test_norm_module_is_bf16_rms_or_layer_norm():
    x = torch.randn(3, 32)
    n = Norm(32, norm="layernorm", params_dtype=torch.float32)
    assert torch.allclose(n(x), F.layer_norm(x, (32,), eps=1e-5), atol=1e-6)
    with pytest.raises(ValueError, match="norm must be one of"):
        Norm(32, norm="batchnorm")
