"""Models whose parameters are fp32 master weights under `torch.autocast(bfloat16)` (plain PyTorch training loops):
the FP8 blocks then see fp32 activations and fp32 weights. On the GPU their gradients must be finite and match the
blocks on torch references, and a converted Hugging Face model must match one on the references."""
import copy

import pytest
import torch

from coat_kernels.act import ActivationConfig, CoatRuntime, fp8_norm_linear
from coat_kernels.act import tensor_quant as TQ
from coat_kernels.formats import E4M3, E5M2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cast_writing_both_copies_equals_reference(dtype, fmt):
    torch.manual_seed(0)
    x = (torch.randn(4096, 1536, device="cuda") * 3).to(dtype)
    scale = TQ.tensor_scale(x, fmt, True)
    codes, codes_t = TQ.cast(x, scale, fmt, True, write_row=True, write_t=True)
    ref, ref_t = TQ.cast_reference(x, scale, fmt, write_row=True, write_t=True)
    assert torch.equal(codes.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(codes_t.view(torch.uint8), ref_t.view(torch.uint8))


def _norm_linear_grads(backend, x_dtype, w_dtype, cache):
    torch.manual_seed(0)
    x = torch.randn(4096, 1024, device="cuda", dtype=x_dtype).requires_grad_()
    nw = (1 + 0.1 * torch.randn(1024, device="cuda")).to(w_dtype).requires_grad_()
    ws = [(torch.randn(n, 1024, device="cuda") * 0.03).to(w_dtype).requires_grad_() for n in (1024, 256, 256)]
    runtime = CoatRuntime()
    runtime.attach_optimizer(torch.optim.SGD(ws, lr=0.0))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, residual = fp8_norm_linear(x, nw, None, tuple(ws), None, residual_out=True, runtime=runtime,
                                      config=ActivationConfig(backend=backend, cache_weights=cache),
                                      weight_cache=runtime.new_weight_cache())
        loss = (y.float() * torch.linspace(-1, 1, y.shape[-1], device="cuda")).sum() + residual.float().sum() / 2
    loss.backward()
    return [x.grad, nw.grad] + [w.grad for w in ws]


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
def test_norm_linear_on_fp32_activations_matches_reference(x_dtype, w_dtype, cache):
    got = _norm_linear_grads("triton", x_dtype, w_dtype, cache)
    ref = _norm_linear_grads("torch", x_dtype, w_dtype, cache)
    for g, r in zip(got, ref):
        assert torch.isfinite(g).all()
        assert ((g.float() - r.float()).norm() / r.float().norm()).item() < 1e-3


def test_hf_llama_with_fp32_master_weights_trains_like_the_reference():
    """fp32 master weights under bf16 autocast (what the Trainer does without DeepSpeed): the Triton path's gradients
    are as close to the unquantized model's as the torch reference path's (both carry FP8 noise; a bug shows as a
    multiple of it)."""
    transformers = pytest.importorskip("transformers")
    from coat_hf import convert_to_coat

    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).cuda()
    x = torch.randint(0, 2048, (4, 256), device="cuda")

    def grads(model):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(input_ids=x, labels=x).loss.backward()
        return {n: p.grad.float() for n, p in model.named_parameters()}

    exact = grads(copy.deepcopy(base))
    errors = {}
    for backend in ("triton", "torch"):
        g = grads(convert_to_coat(copy.deepcopy(base), ActivationConfig(backend=backend)))
        assert all(torch.isfinite(t).all() for t in g.values()), backend
        errors[backend] = {n: ((g[n] - exact[n]).norm() / exact[n].norm()).item() for n in g}
    table = "\n".join(f"{n}: triton {errors['triton'][n]:.4f} torch {errors['torch'][n]:.4f}" for n in exact)
    assert all(errors["triton"][n] <= 1.25 * errors["torch"][n] + 0.01 for n in exact), table
