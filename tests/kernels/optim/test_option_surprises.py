"""CoatFP8AdamW options that would otherwise surprise silently: a checkpoint whose FP8 codes were made with other
quantization options than this run's is refused at load (lr and betas: the checkpoint's win, as in torch);
backend="triton" with CPU tensors and no interpreter is refused at construction; a group size the Triton kernel
cannot take warns once where CUDA tensors fall back to the torch reference; hyper-parameter and option errors name
the option; state_report takes one optimizer or several."""
import copy
import types
import warnings

import pytest
import torch

from coat_kernels import triton_fp8
from coat_kernels.optim import CoatFP8AdamW, OptimizerConfig, StateError, backends, state_report


def trained(steps=1, lr=1e-3, **options):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 24)
    opt = CoatFP8AdamW(model.parameters(), lr=lr, **options)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    return model, opt


@pytest.mark.parametrize("changed", [{"group_size": 64}, {"exp_avg_format": "e5m2"}, {"exp_avg_sq_format": "e5m2"},
                                     {"expand_exp_avg": False}, {"k_max": 8.0}])
def test_resuming_fp8_codes_with_other_quantization_options_is_refused(changed):
    _, source = trained()
    saved = copy.deepcopy(source.state_dict())
    model = torch.nn.Linear(16, 24)
    target = CoatFP8AdamW(model.parameters(), lr=1e-3, **changed)
    (name, value), = changed.items()
    with pytest.raises(StateError, match=rf"quantized with {name}=.*has {name}={value!r}.*set {name}=") as info:
        target.load_state_dict(saved)
    assert "set_fp32_moments" in str(info.value) and not target.state


def test_lr_and_betas_come_from_the_checkpoint_as_in_torch():
    _, source = trained(lr=1e-3, betas=(0.9, 0.95))
    target = CoatFP8AdamW(torch.nn.Linear(16, 24).parameters(), lr=5e-4, betas=(0.8, 0.99))
    target.load_state_dict(copy.deepcopy(source.state_dict()))
    assert target.param_groups[0]["lr"] == 1e-3 and tuple(target.param_groups[0]["betas"]) == (0.9, 0.95)


def test_same_options_and_torch_format_states_still_load():
    _, source = trained(group_size=64)
    CoatFP8AdamW(torch.nn.Linear(16, 24).parameters(), group_size=64).load_state_dict(source.state_dict())
    # fp32 moments (torch's layout) carry no grouping: they load whatever this run's options
    CoatFP8AdamW(torch.nn.Linear(16, 24).parameters()).load_state_dict(source.torch_adamw_state_dict())


def test_triton_backend_with_cpu_tensors_is_refused_at_construction(monkeypatch):
    monkeypatch.setattr(triton_fp8, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="backend='auto'"):
        CoatFP8AdamW(torch.nn.Linear(4, 8).parameters(), backend="triton")
    with pytest.raises(RuntimeError, match="backend='auto'"):
        CoatFP8AdamW([torch.nn.Parameter(torch.zeros(8))], config=OptimizerConfig(backend="triton"))


def test_group_size_the_triton_kernel_cannot_take_warns_once_on_cuda():
    cuda_tensor = types.SimpleNamespace(is_cuda=True)
    with pytest.warns(RuntimeWarning, match=r"group_size=96 is not a power of two.*torch reference"):
        assert not backends.use_triton("auto", cuda_tensor, 96)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not backends.use_triton("auto", cuda_tensor, 96)  # once
        assert backends.use_triton("auto", cuda_tensor, 128)
        assert not backends.use_triton("auto", types.SimpleNamespace(is_cuda=False), 100)  # CPU: the C++ step


@pytest.mark.parametrize("kwargs, match", [({"lr": "3e-4"}, r"lr must be a number, got '3e-4'"),
                                           ({"betas": 0.9}, r"betas must be a pair of numbers"),
                                           ({"betas": ("0.9", 0.95)}, r"betas must be a pair of numbers"),
                                           ({"eps": None}, r"eps must be a number"),
                                           ({"lr": -1.0}, r"lr must be >= 0"),
                                           ({"betas": (0.9, 1.0)}, r"betas\[1\] must be in \[0, 1\)")])
def test_hyper_parameter_errors_name_the_option(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        CoatFP8AdamW(torch.nn.Linear(4, 8).parameters(), **kwargs)


def test_unknown_option_lists_the_options_a_ds_config_can_hold():
    with pytest.raises(ValueError, match="valid options") as info:
        CoatFP8AdamW(torch.nn.Linear(4, 8).parameters(), group_sise=64)
    listed = str(info.value).split("valid options: ")[1].split(" (")[0]
    assert "group_size" in listed and "config" not in listed.split(", ")
    with pytest.raises(TypeError, match="config must be an OptimizerConfig"):
        CoatFP8AdamW(torch.nn.Linear(4, 8).parameters(), config={"group_size": 64})


def test_state_report_takes_one_optimizer_or_several():
    _, opt = trained()
    assert state_report(opt) == state_report([opt])
    assert state_report((opt, opt))["stepped_numel"] == 2 * state_report(opt)["stepped_numel"]
