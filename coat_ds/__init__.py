"""COAT for DeepSpeed: `"optimizer": {"type": "CoatFP8AdamW"}` (or "CoatFP8Lion", "CoatFP8Muon") in ds_config.json.

`import coat_ds` (or only installing the package: its start-up hook) registers the optimizer with DeepSpeed as soon
as deepspeed is imported. The optimizer itself is engine-agnostic (coat_kernels.optim); `coat_ds.CoatFP8AdamW` adds
what ZeRO partitions need (coat_ds.optimizer). FP8 activations for Hugging Face models: `"coat": {"fp8_activations":
true}` in ds_config (coat_ds.ds_config, applied by coat_ds.engine_hooks through coat_hf), or `convert_to_coat(model)`
(coat_hf's, re-exported here).
"""
import sys as _sys

from coat_hf import coat_runtime, convert_to_coat
from coat_kernels.act import ActivationConfig
from coat_kernels.optim import OptimizerConfig

from . import _autoregister
from .optimizer import CoatFP8AdamW, CoatFP8Lion, CoatFP8Muon

__all__ = ["ActivationConfig", "CoatFP8AdamW", "CoatFP8Lion", "CoatFP8Muon", "OptimizerConfig", "coat_runtime",
           "convert_to_coat"]

if "deepspeed" in _sys.modules:
    from .deepspeed_plugin import register_with_deepspeed

    register_with_deepspeed()
else:
    _autoregister.install()
