"""What decides and feeds a graphed call of a converted layer (coat_hf.graphed_calls), checked on CPU: bucket lengths,
the shared inputs padded to a bucket (zero position rows, the mask in the top-left corner, padded keys masked, no
fully masked row), filled once per step by source identity, and the warnings that say why cuda_graphs does nothing
(gradient checkpointing, CPU tensors). The graphs themselves run on the GPU (tests/gpu/test_layer_graphs_gpu.py)."""
import copy

import pytest
import torch

from coat_hf import ActivationConfig, convert_to_coat
from coat_hf.graphed_calls import bucket_length, pad_shared
from coat_kernels.act.graph_pool import Generation, SharedInputs
from test_hf import batch, tiny


def test_bucket_lengths():
    assert [bucket_length(n, 128) for n in (1, 127, 128, 129, 2000)] == [128, 128, 128, 256, 2048]
    assert bucket_length(37, 1) == 37


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_shared_inputs_padded_to_the_bucket(dtype):
    cos, sin = torch.randn(1, 6, 8), torch.randn(1, 6, 8)
    allowed = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    allowed[1, :, :, :2] = False  # the second row left-padded by two
    allowed[1, :, :2, :2] = torch.eye(2, dtype=torch.bool)
    mask = allowed if dtype == torch.bool else torch.zeros(allowed.shape).masked_fill(~allowed, -1e9)
    out = pad_shared(8, (cos, sin, mask), 6)
    cos_p, sin_p, mask_p, valid = out
    assert cos_p.shape == (1, 8, 8) and torch.equal(cos_p[:, :6], cos) and not cos_p[:, 6:].any()
    assert torch.equal(sin_p[:, :6], sin) and valid.item() == 6
    attended = mask_p if dtype == torch.bool else mask_p == 0
    assert torch.equal(mask_p[..., :6, :6], mask)
    assert not attended[..., :6, 6:].any()  # real queries never see padded keys
    assert attended.any(-1).all()  # every row attends somewhere (a fully masked row would give NaN)
    assert torch.equal(attended[..., 6:, :], torch.ones(8, 8, dtype=torch.bool).tril()[6:].expand(2, 1, 2, 8))
    pad_shared(8, (cos[:, :4], sin[:, :4], mask[..., :4, :4]), 4, out)  # shorter, into the same buffers
    assert not cos_p[:, 4:].any() and valid.item() == 4 and not attended[..., :4, 4:].any()


def test_shared_inputs_are_filled_once_per_step():
    calls = []

    def pad(sources, n, out):
        calls.append(n)

    gen = Generation("key")
    gen.shared = []
    cos, sin = torch.randn(1, 6, 8), torch.randn(1, 6, 8)
    for _ in range(3):  # the layers of one step pass the same tensors
        gen.fill(SharedInputs(("k",), (cos, sin, None), pad), 6)
    assert calls == [6]
    sin.mul_(2)  # changed in place
    gen.fill(SharedInputs(("k",), (cos, sin, None), pad), 6)
    cos2 = cos.clone()  # a new step's tensor
    gen.fill(SharedInputs(("k",), (cos2, sin, None), pad), 6)
    gen.fill(SharedInputs(("k",), (cos2, sin, None), pad), 5)
    assert calls == [6, 6, 6, 5]


def test_cuda_graphs_say_why_they_do_nothing():
    model = convert_to_coat(tiny("llama"), ActivationConfig(backend="torch", cuda_graphs=True))
    ids = batch()
    with pytest.warns(UserWarning, match="no effect on cpu tensors") as caught:
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
    assert sum("cpu tensors" in str(w.message) for w in caught) == 1  # once per model
    ckpt = copy.deepcopy(model)
    ckpt.gradient_checkpointing_enable()
    with pytest.warns(UserWarning, match="not used with gradient checkpointing"):
        ckpt(input_ids=ids, labels=ids).loss.backward()
