"""COAT for Hugging Face decoders (coat_hf.convert_to_coat, and the ds_config "coat" section through coat_ds), on tiny
models: one decoder layer against the fp32 layer, loss and gradients against the unconverted BF16 model, what is
saved for backward, unchanged parameter names and checkpoints, idempotence, generation, gradient checkpointing, the
chunked LM loss, bad input, and DeepSpeed ZeRO-2 / ZeRO-3 and the Trainer driven by the ds_config alone."""
import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Olmo2Config, Olmo2ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

import coat_hf
from coat_hf import ActivationConfig, coat_runtime, convert_to_coat
from coat_ds.ds_config import parse_section
from compile_helpers import loss_and_grads
from rank_helpers import JOBS, free_port

warnings.filterwarnings("ignore", category=RuntimeWarning)
VOCAB, SEQ = 128, 32
FAMILIES = {"llama": (LlamaForCausalLM, LlamaConfig, {}), "mistral": (MistralForCausalLM, MistralConfig, {}),
            "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}), "qwen3": (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 16}),
            "olmo2": (Olmo2ForCausalLM, Olmo2Config, {}),
            # one sliding-window layer (window shorter than SEQ) and one full one; q scaled by query_pre_attn_scalar
            "gemma3_text": (Gemma3ForCausalLM, Gemma3TextConfig,
                            {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
                             "layer_types": ["sliding_attention", "full_attention"]})}
# FP8 GEMMs (E4M3 forward, E5M2 gradients) against BF16 on a 2-layer model at random init. Measured worst cases:
# loss 8.5e-4 relative (OLMo-2); gradients 0.12 (Llama, Mistral, Qwen2) to 0.28 (OLMo-2's k_norm): at random init
# the q/k projections' and q/k norms' gradients are small sums through a near-uniform softmax, and E5M2 (two mantissa
# bits: up to 12.5% per element) dominates them, so no tighter bound holds for every family
LOSS_REL, GRAD_REL = 0.003, 0.3


def tiny(family, **extra):
    cls, cfg_cls, kw = FAMILIES[family]
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2 * SEQ)
    cfg = cfg_cls(**{**shape, **kw, **extra})
    return cls(cfg).bfloat16()


def batch(seed=1, size=2):
    return torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(seed))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# Triton (interpreter) with grouped-query attention only; with as many k/v heads as query heads the Llama layer's
# kernels run on the GPU in tests/gpu/test_act_gpu.py (against this layer on the torch references)
@pytest.mark.parametrize("backend,kv_heads", [("torch", 4), ("torch", 2), ("triton", 2)])
def test_decoder_layer_matches_the_fp32_layer(backend, kv_heads):
    """One converted decoder layer against the same Hugging Face layer in fp32 (outputs and gradients within the FP8
    blocks' error bounds); every parameter gets a finite gradient."""
    ref = tiny("llama", num_key_value_heads=kv_heads).float()
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 1:
                p.uniform_(0.8, 1.2)  # norm weights away from one
    model = convert_to_coat(copy.deepcopy(ref).bfloat16(), ActivationConfig(backend=backend))
    x, dy = torch.randn(2, 24, 64), torch.randn(2, 24, 64)
    positions = torch.arange(24)[None]
    xr = x.clone().requires_grad_()
    out_ref = ref.model.layers[0](xr, position_embeddings=ref.model.rotary_emb(xr, positions))
    out_ref.backward(dy)
    xb = x.bfloat16().requires_grad_()
    layer = model.model.layers[0]
    out = layer(xb, position_embeddings=model.model.rotary_emb(xb, positions))
    out.backward(dy.bfloat16())
    assert out.dtype == torch.bfloat16 and rel(out, out_ref) < 0.05
    assert rel(xb.grad, xr.grad) < 0.12
    for name, prm in layer.named_parameters():
        assert prm.grad is not None and torch.isfinite(prm.grad.float()).all(), name


# On the Triton kernels (about a minute each under the interpreter): the Llama model in tests/gpu/test_attention_gpu.py
# (converted vs unconverted loss and gradients), the newer families' in tests/gpu/test_families_gpu.py; the Llama
# layer on the interpreter in test_decoder_layer_matches_the_fp32_layer above.
@pytest.mark.parametrize("family", list(FAMILIES))
def test_converted_model_tracks_the_bf16_model(family):
    ref, model = tiny(family), tiny(family)
    names = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    assert convert_to_coat(model, ActivationConfig(backend="torch")) is model
    assert {n: tuple(p.shape) for n, p in model.state_dict().items()} == names  # names and shapes unchanged
    assert type(model.model.layers[0]).__name__.startswith("Coat")
    ids = batch()
    (l_ref, g_ref), (l_coat, g_coat) = loss_and_grads(ref, ids), loss_and_grads(model, ids)
    assert abs(l_coat - l_ref) < LOSS_REL * l_ref
    errors = {n: rel(g, r) for (n, _), g, r in zip(model.named_parameters(), g_coat, g_ref)}
    assert max(errors.values()) < GRAD_REL, errors


@pytest.mark.parametrize("family", ["olmo2", "gemma3_text"])
def test_sandwich_norm_families_track_the_bf16_model_with_trained_norms(family):
    """OLMo-2 and Gemma 3 with every norm weight moved off its initial value (Gemma's (1 + w) scale included), so that
    the post norms, the q/k norms and the offset matter: loss and gradients as the unconverted model's."""
    ref = tiny(family)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 1:  # Gemma's weights act as 1 + w (initial 0), OLMo's as w (initial 1)
                p.add_((torch.rand(p.shape, generator=g) * 0.4 - 0.2).to(p.dtype))
    model = convert_to_coat(copy.deepcopy(ref), ActivationConfig(backend="torch"))
    ids = batch()
    (l_ref, g_ref), (l_coat, g_coat) = loss_and_grads(ref, ids), loss_and_grads(model, ids)
    assert abs(l_coat - l_ref) < LOSS_REL * l_ref
    errors = {n: rel(g, r) for (n, _), g, r in zip(model.named_parameters(), g_coat, g_ref)}
    assert max(errors.values()) < GRAD_REL, errors


def test_soft_capped_logits_keep_the_models_own_head():
    """The chunked loss computes plain logits: a Gemma 3 whose config soft-caps them keeps Hugging Face's head and
    loss (its layers still convert)."""
    ref, model = tiny("gemma3_text", final_logit_softcapping=5.0), tiny("gemma3_text", final_logit_softcapping=5.0)
    convert_to_coat(model, ActivationConfig(backend="torch"))
    assert type(model).__name__ == "Gemma3ForCausalLM" and type(model.model.layers[0]).__name__.startswith("Coat")
    ids = batch()
    (l_ref, _), (l_coat, _) = loss_and_grads(ref, ids), loss_and_grads(model, ids)
    assert abs(l_coat - l_ref) < LOSS_REL * l_ref


def test_decoder_layers_save_fp8():
    model = convert_to_coat(tiny("llama"), ActivationConfig(backend="torch"))
    layer = model.model.layers[0]
    params = {id(p) for p in model.parameters()}
    counts = {}

    def pack(t):
        if id(t) not in params:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel() * t.element_size()
        return t

    x = torch.randn(2, SEQ, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=model.model.rotary_emb(x, torch.arange(SEQ)[None]))
    tokens = 2 * SEQ
    # norm 1 and norm 2 inputs and gate/up as E4M3 1x16; o_proj reuses the attention output
    assert counts[torch.float8_e4m3fn] == tokens * 64 * 2 + tokens * 2 * 96


def test_idempotent_and_checkpoints_unchanged(tmp_path):
    model = convert_to_coat(tiny("qwen2"), ActivationConfig(backend="torch"))
    runtime, layer_class = coat_runtime(model), type(model.model.layers[1])
    assert convert_to_coat(model) is model and coat_runtime(model) is runtime
    assert type(model.model.layers[1]) is layer_class
    model.eval()
    ids = batch(seed=3)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "ckpt")
    plain = Qwen2ForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    saved = model.state_dict()
    assert plain.state_dict().keys() == saved.keys()
    assert all(torch.equal(t, saved[k]) for k, t in plain.state_dict().items())
    again = convert_to_coat(plain, ActivationConfig(backend="torch")).eval()
    with torch.no_grad():  # (the reloaded model keeps its rotary frequencies in fp32: not bit-identical logits)
        assert rel(again(input_ids=ids).logits, before) < 0.02


def test_generation_after_training():
    """Prefill runs the FP8 layers and fills the KV cache; each generated token then runs the BF16 layers."""
    ref, model = tiny("llama"), convert_to_coat(tiny("llama"), ActivationConfig(backend="torch"))
    ids = batch(seed=4, size=1)[:, :8]
    ref.eval()
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        expected = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 14) and torch.equal(out[:, :8], ids)
    assert (out == expected).float().mean() >= 0.75  # FP8 prefill may flip a near-tie, rarely


def test_gradient_checkpointing_and_the_chunked_loss():
    base = convert_to_coat(tiny("llama"), ActivationConfig(backend="torch"), chunked_loss=False)
    chunked = convert_to_coat(tiny("llama"), ActivationConfig(backend="torch"))
    ckpt = convert_to_coat(tiny("llama"), ActivationConfig(backend="torch"))
    ckpt.gradient_checkpointing_enable()
    for m in (base, chunked, ckpt):
        m.train()
    ids = batch(seed=5)
    (l0, g0), (l1, g1), (l2, g2) = (loss_and_grads(m, ids) for m in (base, chunked, ckpt))
    assert abs(l1 - l0) < 1e-4 * l0 and abs(l2 - l1) < 1e-4 * l1
    assert max(rel(a, b) for a, b in zip(g1, g0)) < 0.02  # bf16 head gradients in another order
    assert max(rel(a, b) for a, b in zip(g2, g1)) < 1e-6  # recomputation repeats the same forward
    assert chunked(input_ids=ids, labels=ids).logits is None


def test_unsupported_models_and_bad_sections_fail_clearly():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="Hugging Face decoders with model_type .*llama, mistral, olmo2, qwen2, qwen3"):
        convert_to_coat(gpt2)
    with pytest.raises(ValueError, match=r"no decoder layer .*activation gelu"):
        convert_to_coat(tiny("llama", hidden_act="gelu"))  # nothing to convert: an error, not a BF16 model
    odd = tiny("llama", hidden_size=72, num_attention_heads=4, num_key_value_heads=2, head_dim=18)
    with pytest.raises(ValueError, match="not multiples of 16"):
        convert_to_coat(odd)
    assert not hasattr(odd, "coat_runtime") and type(odd.model.layers[0]).__name__ == "LlamaDecoderLayer"
    with pytest.raises(ValueError, match="valid: fp8_activations"):
        parse_section({"coat": {"fp8_activation": True}})
    with pytest.raises(TypeError, match="true or false"):
        parse_section({"coat": {"fp8_activations": "true"}})
    with pytest.raises(TypeError, match="cache_weights"):
        parse_section({"coat": {"fp8_activations": True, "cache_weights": "yes"}})
    assert parse_section({"optimizer": {}}) is None
    section = parse_section({"coat": {"fp8_activations": True}})
    assert section.activation_config(2, 4).cache_weights and not section.activation_config(3, 4).cache_weights
    assert not section.activation_config(2, 1).cache_weights


def test_config_is_an_activation_config_or_a_strict_mapping():
    model = convert_to_coat(tiny("llama"), {"backend": "torch", "cache_weights": False})
    assert model.model.layers[0].coat.config == ActivationConfig(backend="torch", cache_weights=False)
    with pytest.raises(ValueError, match="unknown FP8 activation option"):
        convert_to_coat(tiny("llama"), {"backend": "torch", "fp8": True})
    with pytest.raises(TypeError, match="cache_weights must be a bool"):
        convert_to_coat(tiny("llama"), {"cache_weights": "no"})
    with pytest.raises(TypeError, match="ActivationConfig or a mapping"):
        convert_to_coat(tiny("llama"), "torch")
    with pytest.raises(TypeError, match="chunked_loss must be True or False"):
        convert_to_coat(tiny("llama"), chunked_loss="no")


def test_coat_hf_imports_no_engine_and_coat_ds_reexports_it():
    code = ("import sys, coat_hf\n"
            "print(sorted(m for m in ('deepspeed', 'megatron', 'coat_ds', 'coat_megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    import coat_ds

    assert coat_ds.convert_to_coat is coat_hf.convert_to_coat and coat_ds.coat_runtime is coat_hf.coat_runtime


def test_deepspeed_zero2_and_zero3_from_the_ds_config_alone():
    """A torchrun script that never imports coat_ds (tests/jobs/hf_ds_job.py)."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(JOBS / "hf_ds_job.py")], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for stage in (2, 3):
        assert proc.stdout.count(f"ZeRO-{stage} coat section OK") == 2, proc.stdout


def test_hf_trainer_with_the_coat_section(tmp_path):
    proc = subprocess.run([sys.executable, str(JOBS / "hf_trainer_job.py"), str(tmp_path / "t"), "3", "--coat"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "MASTER_PORT": str(free_port())})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["optimizer"] == "CoatFP8AdamW" and out["converted_layers"] == 2 and len(out["losses"]) == 3
