"""How many Triton kernels one converted decoder layer launches per forward and backward (the Triton kernels under the
interpreter on CPU: the same Python launches a GPU makes). On a GPU each launch costs the host about as much as the
kernel behind it costs the GPU at small micro-batches, so the counts are held here: a change that adds launches to
the layer step has to change these numbers on purpose.

Weights quantized at every forward: forward 17 (norm + its FP8 cast twice, RoPE, SwiGLU + its cast, and for each
of the 4 GEMM weights and the o_proj input an amax and a cast), backward 16. With the weight cache warm (a later
micro-batch of the same optimizer step) no weight is quantized: forward 9, backward 12."""
import collections

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from coat_hf import ActivationConfig, coat_runtime, convert_to_coat
from test_hf import tiny


def launches_of_one_step(monkeypatch, layer, x, position_embeddings):
    """(forward, backward) Counters of Triton kernel names for one forward + backward of `layer`."""
    names = []
    original = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    y = layer(x, position_embeddings=position_embeddings)
    n_forward = len(names)
    y.backward(torch.ones_like(y))
    monkeypatch.setattr(InterpretedFunction, "run", original)
    return collections.Counter(names[:n_forward]), collections.Counter(names[n_forward:])


@pytest.mark.parametrize("warm_cache", [False, True])
def test_triton_launches_per_layer_step(monkeypatch, warm_cache):
    model = convert_to_coat(tiny("llama"), ActivationConfig(backend="triton", cache_weights=warm_cache))
    if warm_cache:
        coat_runtime(model).attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    layer = model.model.layers[0]
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    position_embeddings = model.model.rotary_emb(x, torch.arange(16)[None].expand(2, -1))
    if warm_cache:
        layer(x, position_embeddings=position_embeddings).sum().backward()  # fills the cache
    forward, backward = launches_of_one_step(monkeypatch, layer, x, position_embeddings)
    expected = (9, 12) if warm_cache else (17, 16)
    assert (sum(forward.values()), sum(backward.values())) == expected, (forward, backward)
