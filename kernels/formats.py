"""The two FP8 formats COAT uses, with the constants every kernel and reference needs."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FP8Format:
    name: str
    dtype: torch.dtype
    mantissa_bits: int
    min_normal_exp: int  # exponent of the smallest normal number
    max: float

    @property
    def min_normal(self) -> float:
        return 2.0 ** self.min_normal_exp

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.min_normal_exp - self.mantissa_bits)

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Round to nearest even, saturating at +-max (torch's plain cast turns out-of-range values into NaN)."""
        return x.clamp(-self.max, self.max).to(self.dtype)


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, mantissa_bits=3, min_normal_exp=-6, max=448.0)
E5M2 = FP8Format("e5m2", torch.float8_e5m2, mantissa_bits=2, min_normal_exp=-14, max=57344.0)
FORMATS = {f.name: f for f in (E4M3, E5M2)}


def get_format(name: str | FP8Format) -> FP8Format:
    if isinstance(name, FP8Format):
        return name
    try:
        return FORMATS[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown FP8 format {name!r}; choose one of {sorted(FORMATS)}") from None
