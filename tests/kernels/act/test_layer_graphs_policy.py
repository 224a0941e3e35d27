"""What GraphedLayer decides before any CUDA graph exists, checked on CPU with the capture itself replaced: at most
`max_shapes` input signatures get graphs (others run eagerly, with one warning per model), captures made for
parameter addresses that changed are released, and the limit comes from ActivationConfig / the ds_config section.
The graphs themselves are checked on the GPU (tests/gpu/test_layer_graphs_gpu.py)."""
import warnings
from types import SimpleNamespace

import pytest
import torch

from coat_ds.ds_config import parse_section
from coat_kernels.act import ActivationConfig
from coat_kernels.act.layer_graphs import GraphPool, GraphedLayer


def fake_captures(monkeypatch):
    """Replace the CUDA capture by a record of what would have been captured."""
    made = []

    def capture(self, inputs, pool_handle):
        made.append(tuple(tuple(t.shape) for t in inputs))
        return SimpleNamespace(output=torch.empty(1), pending=None, pool_handle=pool_handle)

    monkeypatch.setattr(GraphedLayer, "_capture", capture)
    monkeypatch.setattr(GraphPool, "handle", "shared pool")
    monkeypatch.setattr(GraphedLayer, "_new_pool_handle", staticmethod(lambda: "own pool"))
    return made


def graphed(pool=None, max_shapes=2):
    module = torch.nn.Linear(4, 4)
    return module, GraphedLayer(lambda x: module(x), module, pool=pool or GraphPool(), max_shapes=max_shapes)


def test_shapes_beyond_the_limit_run_eagerly_and_warn_once_per_model(monkeypatch):
    made = fake_captures(monkeypatch)
    pool = GraphPool()
    (_, first), (_, second) = graphed(pool), graphed(pool)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for layer in (first, second):
            for length in (8, 16, 8, 24, 32, 16):
                capture = layer._capture_for([torch.zeros(1, length, 4)])
                assert (capture is None) == (length in (24, 32))
    assert made == [((1, 8, 4),), ((1, 16, 4),)] * 2
    messages = [str(w.message) for w in caught if "cuda_graph_shapes" in str(w.message)]
    assert len(messages) == 1 and "[(1, 24, 4)]" in messages[0] and "2 it keeps" in messages[0], messages


def test_moved_parameters_release_the_old_captures_and_capture_into_a_pool_of_their_own(monkeypatch):
    """A layer capturing again after its parameters moved comes after the layers behind it in the shared pool but
    replays before them: its graphs go to a pool of its own, so they cannot reuse those layers' temporary memory."""
    made = fake_captures(monkeypatch)
    module, layer = graphed(max_shapes=2)
    x = torch.zeros(2, 4)
    old = layer._capture_for([x])
    assert old.pool_handle == "shared pool"
    layer.pool.outputs[old.output.data_ptr()] = old.output
    with torch.no_grad():
        module.weight.data = module.weight.data.clone()  # a new storage: the old graphs can never replay
    new = layer._capture_for([x])
    assert new is not None and new is not old and len(made) == 2
    assert list(layer.captures.values()) == [new] and old.output.data_ptr() not in layer.pool.outputs
    assert new.pool_handle == "own pool" and layer._capture_for([torch.zeros(3, 4)]).pool_handle == "own pool"


def test_the_limit_is_a_validated_option_of_the_config_and_the_ds_config_section():
    assert ActivationConfig().cuda_graph_shapes == 4
    section = parse_section({"coat": {"fp8_activations": True, "cuda_graphs": True, "cuda_graph_shapes": 8}})
    assert section.activation_config(zero_stage=2, gradient_accumulation_steps=1).cuda_graph_shapes == 8
    for bad, error in ((0, ValueError), (True, TypeError), (2.0, TypeError), ("4", TypeError)):
        with pytest.raises(error, match="cuda_graph_shapes"):
            ActivationConfig(cuda_graph_shapes=bad)
        with pytest.raises(error, match="cuda_graph_shapes"):
            parse_section({"coat": {"cuda_graph_shapes": bad}})
