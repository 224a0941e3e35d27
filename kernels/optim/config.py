"""CoatFP8AdamW's COAT options: one frozen, validated object, and the one place their names and defaults live.

`OptimizerConfig` is what keyword arguments, DeepSpeed's ds_config `"params"` and Megatron's `--coat-*` flags map
onto. Types are strict (coat_kernels.options): `"false"` (a string) is not a boolean, `128.0` and `True` are not a
group size.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

from ..formats import FORMATS
from ..options import BACKENDS, check_bool, check_choice, check_int, check_number, from_mapping
from .dre_reference import DREConfig

NONFINITE_POLICIES = ("skip_group", "error")


@dataclass(frozen=True)
class OptimizerConfig:
    """exp_avg_format / exp_avg_sq_format: "e4m3" or "e5m2". expand_exp_avg / expand_exp_avg_sq: Dynamic Range
    Expansion on the moment (else plain per-group scaling). group_size: elements per quantization group.
    expand_min: the expansion exponent k is a multiple of 1 / expand_min. k_max: cap on k.
    nonfinite: "skip_group" (a group whose gradient holds NaN/Inf keeps its parameters and moments) or "error"
    (the same, then FloatingPointError). backend: "auto" (Triton kernel for CUDA tensors, the C++ step for CPU
    tensors), "triton" (needs a power-of-two group_size >= 4) or "torch" (the bit-exact torch reference everywhere).
    Any group size works with "auto" and "torch": sizes the Triton kernel or the C++ step do not take (the C++ step
    takes groups of up to 1024 elements) are stepped by the torch reference, with the same results.
    master_remainders: bf16 parameters are their own fp32 master weights, losslessly: each state entry of a bf16
    tensor keeps the low 16 bits of every fp32 master value (`master_remainder`, int16), and the step reads and
    writes the fp32 master as (bf16 parameter, remainder) (coat_kernels.optim.master_remainders). The bf16 parameter
    is the master rounded to nearest, ties away from zero. fp32 parameters are unaffected."""

    exp_avg_format: str = "e4m3"
    exp_avg_sq_format: str = "e4m3"
    expand_exp_avg: bool = True
    expand_exp_avg_sq: bool = True
    group_size: int = 128
    expand_min: int = 16
    k_max: float = 16.0
    nonfinite: str = "skip_group"
    backend: str = "auto"
    master_remainders: bool = False

    def __post_init__(self):
        for name in ("exp_avg_format", "exp_avg_sq_format"):
            check_choice(name, getattr(self, name), tuple(FORMATS))
        for name in ("expand_exp_avg", "expand_exp_avg_sq", "master_remainders"):
            check_bool(name, getattr(self, name), spelled="a bool (true/false)")
        for name in ("group_size", "expand_min"):
            check_int(name, getattr(self, name), minimum=1)
        k_max = check_number("k_max", self.k_max)
        if not k_max >= 1 or k_max == float("inf"):
            raise ValueError(f"k_max must be finite and >= 1, got {self.k_max}")
        object.__setattr__(self, "k_max", k_max)
        check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        check_choice("backend", self.backend, BACKENDS)
        if self.backend == "triton" and not triton_supports_group_size(self.group_size):
            raise ValueError(f"backend='triton' needs a power-of-two group_size >= 4, got {self.group_size}")

    @classmethod
    def from_options(cls, options: Mapping | None = None, **overrides) -> "OptimizerConfig":
        """From a mapping of option names (unknown names are an error that lists the valid ones)."""
        return from_mapping(cls, options, "COAT optimizer option(s)", **overrides)

    def replace(self, **changes) -> "OptimizerConfig":
        return dataclasses.replace(self, **changes)

    @property
    def group_options(self) -> dict:
        """The options that may differ between param groups (they are stored in each group's dict)."""
        return {name: getattr(self, name) for name in GROUP_OPTION_NAMES}

    def moment_configs(self) -> tuple[DREConfig, DREConfig]:
        """The quantizers of exp_avg and exp_avg_sq (a nonzero second moment never rounds to code 0)."""
        return _moment_configs(self.exp_avg_format, self.expand_exp_avg, self.exp_avg_sq_format,
                               self.expand_exp_avg_sq, self.expand_min, self.k_max)


def triton_supports_group_size(group_size: int) -> bool:
    """The Triton kernels take power-of-two groups of at least 4 elements (backend="auto" steps other group sizes
    of CUDA tensors with the torch reference; the CPU step takes any)."""
    return group_size >= 4 and group_size & (group_size - 1) == 0



OPTION_NAMES = tuple(f.name for f in dataclasses.fields(OptimizerConfig))
GROUP_OPTION_NAMES = ("exp_avg_format", "exp_avg_sq_format", "expand_exp_avg", "expand_exp_avg_sq", "group_size",
                      "expand_min", "k_max")
DEFAULTS = OptimizerConfig()


@lru_cache(maxsize=64)
def _moment_configs(m_format, m_expand, v_format, v_expand, expand_min, k_max) -> tuple[DREConfig, DREConfig]:
    common = dict(expand_min=expand_min, k_max=k_max)
    return (DREConfig(m_format, expand=m_expand, **common),
            DREConfig(v_format, expand=v_expand, keep_nonzero=True, **common))
