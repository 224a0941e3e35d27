"""The FP8 optimizer half of COAT, engine-agnostic: CoatFP8AdamW, its options, its state, and the quantizers.

Modules: `config` (OptimizerConfig), `adamw` (CoatFP8AdamW: its step), `state` (the state entry: zero, from/to
fp32, report), `validation` (checks of entries against their tensors), `checkpoint` (state dicts, torch.optim's fp32
layout, pickling), `backends` (which implementation runs a step), `grouping` (segments -> quantization groups),
`dre_reference` (torch reference of Dynamic Range Expansion and of the fused step), `dre_triton` (the Triton/Gluon
kernels, bit-identical to the reference).
"""
from .adamw import CoatFP8AdamW
from .config import OptimizerConfig
from .state import from_fp32, is_coat_state, state_report, to_fp32
from .validation import StateError, validate_entry

__all__ = ["CoatFP8AdamW", "OptimizerConfig", "StateError", "from_fp32", "is_coat_state", "state_report", "to_fp32",
           "validate_entry"]
