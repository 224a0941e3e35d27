"""COAT for DeepSpeed: CoatFP8AdamW (FP8 AdamW moments with Dynamic Range Expansion)."""
from .optimizer import CoatFP8AdamW, dequantize_state_entry

__all__ = ["CoatFP8AdamW", "dequantize_state_entry"]
