"""The two FP8 formats COAT uses, with the constants every kernel and reference needs."""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class FP8Format:
    name: str
    dtype: torch.dtype
    mantissa_bits: int
    min_normal_exp: int  # exponent of the smallest normal number
    max: float

    @property
    def log2_max(self) -> float:
        """log2(max) rounded to fp32 (a constant of the quantization kernels)."""
        return struct.unpack("f", struct.pack("f", math.log2(self.max)))[0]

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.min_normal_exp - self.mantissa_bits)

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Round to nearest even, saturating at +-max (torch's plain cast turns out-of-range values into NaN)."""
        return x.clamp(-self.max, self.max).to(self.dtype)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """fp32 values of FP8 codes, bit-identical to `codes.float()`: on CPU a contiguous tensor is decoded through
        a 256-entry table (torch's element-wise FP8 conversion runs several times slower there)."""
        if codes.device.type != "cpu" or not codes.is_contiguous():
            return codes.float()
        table = _decode_table(self.name)
        return table.index_select(0, codes.view(torch.uint8).reshape(-1).int()).view(codes.shape)

    def log2_table(self, device="cpu") -> torch.Tensor:
        """fp32 [256]: log2 of the magnitude of each code (-inf for +-0; NaN/Inf codes give NaN/Inf): a code byte
        indexes it directly, sign bit or not."""
        return _log2_table(self.name, str(device))


@lru_cache(maxsize=None)
def _log2_table(name: str, device: str) -> torch.Tensor:
    values = torch.arange(128, dtype=torch.uint8).view(FORMATS[name].dtype).double().tolist()
    logs = [math.log2(v) if 0 < v < math.inf else (-math.inf if v == 0 else v) for v in values]
    return torch.tensor(logs * 2, dtype=torch.float32, device=device)


@lru_cache(maxsize=None)
def _decode_table(name: str) -> torch.Tensor:
    """fp32 [256]: the value of each code byte, as torch converts it."""
    return torch.arange(256, dtype=torch.uint8).view(FORMATS[name].dtype).float()


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, mantissa_bits=3, min_normal_exp=-6, max=448.0)
E5M2 = FP8Format("e5m2", torch.float8_e5m2, mantissa_bits=2, min_normal_exp=-14, max=57344.0)
FORMATS = {f.name: f for f in (E4M3, E5M2)}


def get_format(name: str | FP8Format | torch.dtype) -> FP8Format:
    if isinstance(name, FP8Format):
        return name
    if isinstance(name, torch.dtype):
        for fmt in FORMATS.values():
            if fmt.dtype == name:
                return fmt
    try:
        return FORMATS[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown FP8 format {name!r}; choose one of {sorted(FORMATS)}") from None
