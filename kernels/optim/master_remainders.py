"""An fp32 master weight kept as its bf16 parameter plus a 16-bit remainder, losslessly (OptimizerConfig.
master_remainders).

The fp32 bit pattern b of a master value splits into its upper half hi = b >> 16 and its lower half lo = b & 0xFFFF.
The parameter stores hi rounded by lo: hi + 1 when lo >= 0x8000 (round to nearest, ties away from zero: the
convention of TransformerEngine's FusedAdam `store_param_remainders`), and the remainder stores lo (as int16 bits).
Given both, hi is the parameter minus 1 where the remainder's top bit is set, so the pair gives b back exactly.

The bf16 parameter is therefore the fp32 master rounded to the nearest bf16, with ties away from zero. torch's
`.to(torch.bfloat16)` rounds ties to even instead; the two differ only where lo == 0x8000 exactly and hi is even (one
bf16 ulp, in about one element in 2^17). No 16-bit remainder can reproduce ties-to-even: an even bf16 value would
have 2^16 + 1 fp32 values rounding to it. A training run with master remainders is bit-identical to one with an fp32
master whose bf16 copy is made by `split(master)[0]` (`round_to_bf16`).

NaN masters: a master whose upper half is a NaN with all mantissa bits set (magnitude bits 0x7FFF) is never rounded
up (that would wrap it to a zero), so a NaN master never shows as a finite parameter (it shows as a NaN, or as an
infinity when its upper half is one); it may come back as another NaN. Every other master value, infinities
included, comes back bit for bit.

The Triton kernel (dre_triton) and the C++ step (cpu_adamw.cpp) implement the same integer operations.
"""
from __future__ import annotations

import torch

REMAINDER_DTYPE = torch.int16


def split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 master -> (bf16 parameter, int16 remainder), same shape."""
    bits = master.detach().to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi, lo = bits >> 16, bits & 0xFFFF
    carry = (lo >= 0x8000) & ((hi & 0x7FFF) != 0x7FFF)
    return _as16(hi + carry.to(torch.int64)).view(torch.bfloat16), _as16(lo)


def join(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """(bf16 parameter, int16 remainder) -> fp32 master, same shape."""
    hi = param.detach().contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    lo = remainder.detach().contiguous().to(torch.int64) & 0xFFFF
    borrow = (lo >= 0x8000) & ((hi & 0x7FFF) != 0x7FFF)
    bits = (((hi - borrow.to(torch.int64)) & 0xFFFF) << 16) | lo
    return torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32).view(torch.float32)


def round_to_bf16(master: torch.Tensor) -> torch.Tensor:
    """The bf16 parameter master remainders keep beside `master` (nearest, ties away from zero)."""
    return split(master)[0]


def _as16(values: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^16) as int16 bit patterns."""
    return torch.where(values >= 2 ** 15, values - 2 ** 16, values).to(torch.int16)
