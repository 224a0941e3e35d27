"""Converted layers on the GPU through Hugging Face's attention backends (Triton kernels, BF16 model): sdpa and
flex_attention (which has no backward on CPU), and flash_attention_2 where the flash_attn package imports, train like
the unconverted model on causal, padded and packed batches; o_proj reuses the output SDPA's fused kernels keep."""
import copy
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from coat_hf import ActivationConfig, convert_to_coat
from coat_hf import attention as coat_attention

warnings.filterwarnings("ignore", category=RuntimeWarning)
VOCAB, DOCS = 512, (100, 156, 128)
LOSS_REL, GRAD_REL = 0.01, 0.2  # FP8 against BF16 at random init; attending across documents is off by ~1


def flash_available() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return is_flash_attn_2_available()


def models(impl):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attn_implementation=impl)
    ref = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    return ref, convert_to_coat(copy.deepcopy(ref), ActivationConfig(cache_weights=False))


def batch(kind):
    g = torch.Generator(device="cuda").manual_seed(1)
    if kind == "packed":
        ids = torch.randint(0, VOCAB, (1, sum(DOCS)), device="cuda", generator=g)
        position_ids = torch.cat([torch.arange(n, device="cuda") for n in DOCS])[None]
        labels = ids.masked_fill(position_ids == 0, -100)
        return dict(input_ids=ids, position_ids=position_ids), labels
    ids = torch.randint(0, VOCAB, (2, 256), device="cuda", generator=g)
    if kind == "causal":
        return dict(input_ids=ids), ids
    mask = torch.ones_like(ids)
    mask[1, 180:] = 0
    return dict(input_ids=ids, attention_mask=mask), ids.masked_fill(mask == 0, -100)


def loss_and_grads(model, inputs, labels):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**inputs, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kind", ["causal", "padded", "packed"])
@pytest.mark.parametrize("impl", ["sdpa", "flex_attention", "flash_attention_2"])
def test_training_tracks_the_unconverted_model(impl, kind):
    if impl == "flash_attention_2" and not flash_available():
        pytest.skip("flash_attn is not installed")
    ref, model = models(impl)
    inputs, labels = batch(kind)
    (l_ref, g_ref), (l_coat, g_coat) = loss_and_grads(ref, inputs, labels), loss_and_grads(model, inputs, labels)
    assert abs(l_coat - l_ref) < LOSS_REL * l_ref, (l_coat, l_ref)
    errors = {n: rel(g_coat[n], g) for n, g in g_ref.items()}
    assert max(errors.values()) < GRAD_REL, errors


@pytest.mark.parametrize("with_mask", [False, True])
def test_o_proj_reuses_the_sdpa_output(with_mask):
    """Flash (no mask) and memory-efficient (a mask) SDPA kernels both keep the output o_proj reads."""
    _, model = models("sdpa")
    attn = model.model.layers[0].self_attn
    q = torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True).transpose(1, 2)
    k, v = (torch.randn(2, 256, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True).transpose(1, 2)
            for _ in range(2))
    mask = torch.ones(2, 1, 256, 256, dtype=torch.bool, device="cuda").tril() if with_mask else None
    o, kept = coat_attention.attend(attn, q, k, v, mask, {}, {})
    assert kept and o.shape == (512, 256)
