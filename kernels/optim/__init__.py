"""The FP8 optimizer half of COAT, engine-agnostic: CoatFP8AdamW, its options, its state, and the quantizers.

Modules: `config` (OptimizerConfig), `adamw` (CoatFP8AdamW), `state` (state entries: zero, from/to fp32,
validation, report), `grouping` (segments -> quantization groups), `dre_reference` (torch reference of Dynamic Range
Expansion and of the fused step), `dre_triton` (the Triton/Gluon kernels, bit-identical to the reference).
"""
from .adamw import CoatFP8AdamW
from .config import OptimizerConfig
from .state import StateError, from_fp32, is_coat_state, state_report, to_fp32, validate_entry

__all__ = ["CoatFP8AdamW", "OptimizerConfig", "StateError", "from_fp32", "is_coat_state", "state_report", "to_fp32",
           "validate_entry"]
