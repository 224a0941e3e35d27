"""COAT for DeepSpeed: `"optimizer": {"type": "CoatFP8AdamW"}` in ds_config.json.

`import coat_ds` (or only installing the package: its start-up hook) registers the optimizer with DeepSpeed as soon
as deepspeed is imported. The optimizer itself is engine-agnostic (coat_kernels.optim); `coat_ds.CoatFP8AdamW` adds
what ZeRO partitions need (coat_ds.optimizer).
"""
import sys as _sys

from coat_kernels.optim import OptimizerConfig

from . import _autoregister
from .optimizer import CoatFP8AdamW

__all__ = ["CoatFP8AdamW", "OptimizerConfig"]

if "deepspeed" in _sys.modules:
    from .deepspeed_plugin import register_with_deepspeed

    register_with_deepspeed()
else:
    _autoregister.install()
