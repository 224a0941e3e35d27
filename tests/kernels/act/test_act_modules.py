"""The activation half's nn.Modules: a step clock that re-quantizes weights once per optimizer step, the BF16 norm.
(The decoder layer composed of the FP8 blocks is coat_hf's: tests/hf.)"""
import warnings

import pytest
import torch
import torch.nn.functional as F

from coat_kernels.act import ActivationConfig, CoatRuntime, Fp8Linear, Norm

warnings.filterwarnings("ignore", category=RuntimeWarning)


def test_modules_warn_once_and_cache_after_attach():
    runtime = CoatRuntime()
    lin = Fp8Linear(64, 32, config=ActivationConfig(backend="torch"), runtime=runtime, params_dtype=torch.float32)
    x = torch.randn(8, 64)
    with pytest.warns(RuntimeWarning, match="attach_optimizer"):
        lin(x)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    runtime.attach_optimizer(opt)
    lin(x.requires_grad_()).sum().backward()  # dgrad needs the transposed weight
    assert lin.weight_cache.w8 is not None and lin.weight_cache.w8_t is not None
    before = lin.weight_cache.scale
    opt.step()
    lin(x)
    assert lin.weight_cache.scale is not before  # a new quantization after the step


def test_norm_module_is_bf16_rms_or_layer_norm():
    x = torch.randn(3, 32)
    n = Norm(32, norm="layernorm", params_dtype=torch.float32)
    assert torch.allclose(n(x), F.layer_norm(x, (32,), eps=1e-5), atol=1e-6)
    with pytest.raises(ValueError, match="norm must be one of"):
        Norm(32, norm="batchnorm")
