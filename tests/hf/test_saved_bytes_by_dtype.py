"""Everything a converted Llama decoder layer saves for backward, in bytes per dtype (each storage once; parameters
excluded), against the formulas of what each part keeps. A block that also kept a BF16 (or fp32) copy of an
activation changes a total and fails here."""
import torch

from coat_hf import ActivationConfig, convert_to_coat
from test_hf import SEQ, tiny

BATCH, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 2, 64, 96, 4, 2, 16
GROUP = 16  # 1 x 16 quantization groups, one bf16 scale each
GEMMS = 4  # q/k/v, o_proj, gate/up, down: one fp32 input scale and one weight scale each


def saved_bytes_by_dtype(model):
    layer = model.model.layers[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = (t.dtype, storage.nbytes())
        return t

    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=model.model.rotary_emb(x, torch.arange(SEQ)[None]))
    totals = {}
    for dtype, nbytes in storages.values():
        totals[dtype] = totals.get(dtype, 0) + nbytes
    return totals


def test_a_decoder_layer_saves_what_each_block_needs_and_nothing_more():
    model = convert_to_coat(tiny("llama", attn_implementation="sdpa"), ActivationConfig(backend="torch"))
    tokens = BATCH * SEQ
    grouped = tokens * (HIDDEN + HIDDEN + 2 * FFN)  # the two norm inputs and gate/up outputs, E4M3 1 x 16
    expected = {
        torch.float8_e4m3fn: grouped,
        torch.bfloat16: 2 * (grouped // GROUP  # their scales
                             + 2 * SEQ * HEAD_DIM // 2  # RoPE cos and sin
                             + tokens * (HEADS + 2 * KV_HEADS) * HEAD_DIM  # q, k, v after RoPE (SDPA's)
                             + tokens * HIDDEN),  # the attention output, which o_proj reuses as its input
        torch.float32: 4 * (2 * tokens  # the norms' 1 / rms
                            + BATCH * HEADS * SEQ  # SDPA's log-sum-exp
                            + 2 * GEMMS),
    }
    assert saved_bytes_by_dtype(model) == expected
