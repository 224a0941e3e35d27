"""The FP8 optimizer half of COAT, engine-agnostic: CoatFP8AdamW, CoatFP8Lion and CoatFP8Muon, their options, their
state, and the quantizers.

Modules: `config` (OptimizerConfig), `base` (CoatFP8Optimizer: what the three share), `adamw` (CoatFP8AdamW: its step),
`lion` (CoatFP8Lion), `muon` (CoatFP8Muon, muon_param_groups), `lion_reference` / `lion_triton` / `cpu_lion.cpp`
(Lion's fused step), `unquantized` (the fp32 / bf16 reference arms of Lion and Muon), `state` (the state entry: zero,
from/to fp32, report), `validation` (checks of entries against their tensors), `checkpoint` (state dicts, torch.optim's
fp32 layout, pickling), `backends` (which implementation runs a step), `grouping` (segments -> quantization groups),
`dre_reference` (torch reference of Dynamic Range Expansion and of the fused step), `dre_triton` (the Triton/Gluon
kernels, bit-identical to the reference).
"""
from .adamw import CoatFP8AdamW
from .config import OptimizerConfig
from .lion import CoatFP8Lion
from .muon import CoatFP8Muon, muon_param_groups
from .state import from_fp32, is_coat_state, state_report, to_fp32
from .validation import StateError, validate_entry

__all__ = ["CoatFP8AdamW", "CoatFP8Lion", "CoatFP8Muon", "OptimizerConfig", "StateError", "from_fp32", "is_coat_state",
           "muon_param_groups", "state_report", "to_fp32", "validate_entry"]
