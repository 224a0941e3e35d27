"""State validation on CUDA tensors: the Triton step refuses state tensors that do not fit the layout before it
launches (and changes nothing), and load_state_dict scans CUDA states (NaN codes, negative second-moment codes,
damaged metadata) like CPU ones."""
import copy

import pytest
import torch

from coat_kernels.optim import CoatFP8AdamW, StateError


def trained(steps=2):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, device="cuda") * 0.02) for shape in ((300, 24), (300,), (7, 300))]
    opt = CoatFP8AdamW(params, lr=1e-3)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
    return params, opt


@pytest.mark.parametrize("key, make", [("exp_avg_sq_meta", lambda t: t[:, :10].clone()),
                                       ("exp_avg_sq_q", lambda t: t[:100].clone()),
                                       ("exp_avg_meta", lambda t: t[:, :-1].clone()),
                                       ("exp_avg_meta", lambda t: t.t().contiguous()),
                                       ("exp_avg_meta", lambda t: t.cpu())])
def test_triton_step_refuses_state_tensors_that_do_not_fit(key, make):
    params, opt = trained()
    state = opt.state[params[0]]
    state[key] = make(state[key])
    before = [p.detach().clone() for p in params] + [float(opt.state[p]["step"]) for p in params]
    with pytest.raises(StateError, match=rf"parameter 0 \(shape \(300, 24\), param group 0\): {key}"):
        opt.step()
    torch.cuda.synchronize()
    after = [p.detach() for p in params] + [float(opt.state[p]["step"]) for p in params]
    assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(before, after))


@pytest.mark.parametrize("key, byte, match", [("exp_avg_q", 0x7F, "non-finite"), ("exp_avg_sq_q", 0x81, "negative")])
def test_load_scans_cuda_states(key, byte, match):
    _, source = trained()
    saved = copy.deepcopy(source.state_dict())
    saved["state"][2][key].view(torch.uint8)[5] = byte
    _, target = trained(1)
    with pytest.raises(StateError, match=rf"parameter 2 \(shape \(7, 300\), param group 0\): {key} holds 1 {match}"):
        target.load_state_dict(saved)
    saved = copy.deepcopy(source.state_dict())
    saved["state"][1]["exp_avg_meta"][0, 1] = float("nan")
    with pytest.raises(StateError, match="NaN/Inf metadata"):
        target.load_state_dict(saved)
