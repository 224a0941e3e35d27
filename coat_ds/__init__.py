"""COAT for DeepSpeed: CoatFP8AdamW (FP8 AdamW moments with Dynamic Range Expansion)."""
from .optimizer import CoatFP8AdamW, dequantize_state_entry

__all__ = ["CoatFP8AdamW", "dequantize_state_entry"]

# DeepSpeed (issue 3): register "CoatFP8AdamW" now if deepspeed is imported, else as soon as it is.
import sys as _sys

from . import _autoregister
from .deepspeed_plugin import register_with_deepspeed

if "deepspeed" in _sys.modules:
    register_with_deepspeed()
else:
    _autoregister.install()
