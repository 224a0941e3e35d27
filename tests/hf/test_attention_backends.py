"""Converted decoder layers attend through the model's own attention backend (coat_hf.attention): for sdpa, eager and
flex_attention, on causal, right-padded and packed batches (position ids restarting per document, no padding), and
for Mistral's sliding window, a converted model's loss and gradients track the unconverted model's within FP8
tolerance; packed documents stay isolated; the attention function gets the mask and keyword arguments the unconverted
model gives it; attention weights asked for come from Hugging Face's layer; an unknown backend is refused at
conversion."""
import copy
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from coat_hf import ActivationConfig, convert_to_coat
from coat_hf import attention as coat_attention

warnings.filterwarnings("ignore", category=RuntimeWarning)
VOCAB = 128
DOCS = (20, 25, 19)  # a packed row of three documents
# FP8 activations against BF16 on a 2-layer model at random init (measured: loss within 0.02%, the worst parameter's
# gradient 12-15%: E5M2 gradients); a layer attending across documents or to padding is off by 0.3-0.6% in loss and
# 90-140% in gradients
LOSS_REL, GRAD_REL, HIDDEN_REL = 0.002, 0.2, 0.08


def models(impl, family="llama", **extra):
    cls, cfg_cls = {"llama": (LlamaForCausalLM, LlamaConfig), "mistral": (MistralForCausalLM, MistralConfig)}[family]
    torch.manual_seed(0)
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, attn_implementation=impl, **extra)
    ref = cls(cfg).bfloat16()
    return ref, convert_to_coat(copy.deepcopy(ref), ActivationConfig(backend="torch"))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def batch(kind, seq=64):
    """Model inputs and labels of one batch: `causal` (2 full rows), `padded` (2 rows, the second left-padded, its
    positions counted from its first real token: right padding would hide a mask that is not applied, since causal
    attention never looks right), `packed` (one row of documents, position ids restarting at each, the first label
    of each document ignored, as DataCollatorWithFlattening gives)."""
    g = torch.Generator().manual_seed(1)
    if kind == "packed":
        ids = torch.randint(0, VOCAB, (1, sum(DOCS)), generator=g)
        position_ids = torch.cat([torch.arange(n) for n in DOCS])[None]
        labels = ids.clone()
        labels[position_ids == 0] = -100
        return dict(input_ids=ids, position_ids=position_ids), labels
    ids = torch.randint(0, VOCAB, (2, seq), generator=g)
    if kind == "causal":
        return dict(input_ids=ids), ids.clone()
    mask = torch.ones_like(ids)
    mask[1, :24] = 0
    labels = ids.masked_fill(mask == 0, -100)
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    return dict(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask, position_ids=position_ids), labels


def loss_and_grads(model, inputs, labels):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**inputs, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def hidden(model, inputs):
    return model.model(**inputs, use_cache=False).last_hidden_state


@pytest.mark.parametrize("kind", ["causal", "padded", "packed"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_loss_and_gradients_track_the_unconverted_model(impl, kind):
    ref, model = models(impl)
    assert model.config._attn_implementation == impl
    inputs, labels = batch(kind)
    (l_ref, g_ref), (l_coat, g_coat) = loss_and_grads(ref, inputs, labels), loss_and_grads(model, inputs, labels)
    assert abs(l_coat - l_ref) < LOSS_REL * l_ref, (l_coat, l_ref)
    errors = {n: rel(g_coat[n], g) for n, g in g_ref.items()}
    assert max(errors.values()) < GRAD_REL, errors


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_documents_are_isolated_and_padding_is_ignored(impl):
    ref, model = models(impl)
    inputs, _ = batch("packed")
    start = DOCS[0] + DOCS[1]  # the third document, alone
    alone = dict(input_ids=inputs["input_ids"][:, start:], position_ids=inputs["position_ids"][:, start:])
    with torch.no_grad():
        for m in (ref, model):
            packed_out = hidden(m, inputs)[:, start:]
            assert rel(packed_out, hidden(m, alone)) < (1e-2 if m is ref else HIDDEN_REL)
        # the same row without position ids is one causal sequence: the last document then sees the others
        assert rel(hidden(model, dict(input_ids=inputs["input_ids"]))[:, start:], hidden(model, alone)) > 0.3
        padded, _ = batch("padded")
        real = padded["attention_mask"][1] == 1
        short = dict(input_ids=padded["input_ids"][1:, real], position_ids=padded["position_ids"][1:, real])
        for m in (ref, model):
            assert rel(hidden(m, padded)[1:, real], hidden(m, short)) < (1e-2 if m is ref else HIDDEN_REL)


def test_mistral_sliding_window():
    ref, model = models("sdpa", "mistral", sliding_window=8)
    assert model.model.layers[0].coat.family.attention_kwargs(model.model.layers[0].self_attn) == {
        "sliding_window": 8}
    inputs, labels = batch("causal")
    (l_ref, g_ref), (l_coat, g_coat) = loss_and_grads(ref, inputs, labels), loss_and_grads(model, inputs, labels)
    assert abs(l_coat - l_ref) < LOSS_REL * l_ref
    assert max(rel(g_coat[n], g) for n, g in g_ref.items()) < GRAD_REL
    wide, _ = models("sdpa", "mistral", sliding_window=4096)
    with torch.no_grad():
        assert rel(hidden(wide, inputs), hidden(ref, inputs)) > 0.1  # the window matters on this batch


def test_flex_attention_forward():
    """Flex attention has no backward on CPU (the GPU tests train with it); its forward on 128 tokens (shorter
    sequences than a flex block give wrong results on CPU in torch itself), causal and packed."""
    ref, model = models("flex_attention")
    ids = torch.randint(0, VOCAB, (1, 128), generator=torch.Generator().manual_seed(2))
    position_ids = torch.cat([torch.arange(48), torch.arange(80)])[None]
    with torch.no_grad():
        for inputs in (dict(input_ids=ids), dict(input_ids=ids, position_ids=position_ids)):
            assert rel(hidden(model, inputs), hidden(ref, inputs)) < HIDDEN_REL
        alone = hidden(model, dict(input_ids=ids[:, 48:], position_ids=position_ids[:, 48:]))
        assert rel(hidden(model, dict(input_ids=ids, position_ids=position_ids))[:, 48:], alone) < HIDDEN_REL


def test_the_attention_function_gets_what_the_unconverted_layer_passes():
    """A backend registered by the user (AttentionInterface.register) records its arguments: the converted layer
    passes the same mask, the same keyword arguments (packed-sequence boundaries included) and the same q, k, v
    within FP8 error."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    calls = []

    def recording(module, q, k, v, mask, **kwargs):
        calls.append((q.detach().clone(), mask, kwargs))
        return sdpa_attention_forward(module, q, k, v, mask, **kwargs)

    AttentionInterface.register("coat_test_recording", recording)
    AttentionMaskInterface.register("coat_test_recording", sdpa_mask)
    ref, model = models("coat_test_recording")
    inputs, _ = batch("packed")
    cu = torch.tensor([0, 20, 45, 64], dtype=torch.int32)
    extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=25, max_length_k=25)
    with torch.no_grad():
        for m in (ref, model):
            hidden(m, dict(inputs, **extra))
    assert len(calls) == 4
    for (q_ref, mask_ref, kw_ref), (q, mask, kw) in zip(calls[:2], calls[2:]):
        assert torch.equal(mask, mask_ref) and kw.keys() == kw_ref.keys()
        for key, value in kw_ref.items():
            assert torch.equal(kw[key], value) if isinstance(value, torch.Tensor) else kw[key] == value, key
        assert rel(q, q_ref) < HIDDEN_REL
    assert {"position_ids", "cu_seq_lens_q", "max_length_k", "dropout", "scaling"} <= set(kw_ref)


def test_attention_weights_come_from_the_hugging_face_layer():
    ref, model = models("eager")
    ids = batch("causal")[0]["input_ids"]
    with torch.no_grad():
        out_ref = ref(input_ids=ids, output_attentions=True)
        out = model(input_ids=ids, output_attentions=True)
    assert len(out.attentions) == len(out_ref.attentions) == 2
    assert all(torch.equal(a, b) for a, b in zip(out.attentions, out_ref.attentions))  # the same BF16 layers


def test_o_proj_reuses_the_output_the_attention_kernel_keeps():
    """SDPA keeps its output for backward (o_proj saves nothing new); eager attention returns a copy nobody keeps."""
    for impl, kept in (("sdpa", True), ("eager", False)):
        _, model = models(impl)
        attn = model.model.layers[0].self_attn
        q = torch.randn(2, 4, 16, 16, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(2, 2, 16, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        o, reused = coat_attention.attend(attn, q.transpose(1, 2).contiguous().transpose(1, 2), k, v, None, {}, {})
        assert o.shape == (32, 64) and reused is kept, impl
        with torch.no_grad():
            assert coat_attention.attend(attn, q, k, v, None, {}, {})[1] is False  # nothing kept without grad


def test_an_unknown_backend_is_refused_at_conversion():
    ref, _ = models("sdpa")
    ref.config._attn_implementation = "no_such_backend"
    with pytest.raises(ValueError, match="'no_such_backend' is not registered"):
        convert_to_coat(ref)
    assert type(ref.model.layers[0]).__name__ == "LlamaDecoderLayer"
