"""Strict parsing shared by COAT's configuration objects (OptimizerConfig, ActivationConfig, the ds_config "coat"
section): JSON configs and command lines produce look-alikes that would otherwise be accepted silently (`"false"`
is not a boolean; `128.0` and `True` are not a group size), so each value is checked for its exact type, and an
unknown name is an error that lists the valid ones (and the closest, when one is close).

BACKENDS: the backends every COAT kernel family offers. "auto": the Triton kernels for CUDA tensors, the CPU
implementation (torch references; the optimizer's C++ step) for CPU tensors; "triton": the Triton kernels (CUDA
tensors, or CPU tensors under the Triton interpreter, TRITON_INTERPRET=1); "torch": the bit-exact torch references
on any device.
"""
from __future__ import annotations

import difflib
from typing import Iterable, Mapping

BACKENDS = ("auto", "triton", "torch")


def check_choice(name: str, value, choices: tuple, where: str = "") -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{where}{name} must be one of {choices}, got {value!r}")


def check_bool(name: str, value, where: str = "", spelled: str = "a bool") -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where}{name} must be {spelled}, got {value!r}")


def check_int(name: str, value, where: str = "", minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}{name} must be an integer, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}{name} must be at least {minimum}, got {value}")


def check_number(name: str, value, where: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def check_names(given: Iterable[str], valid: Iterable[str], what: str) -> None:
    """Raise ValueError naming the unknown names among `given`, the valid ones, and the closest match."""
    valid = tuple(valid)
    unknown = sorted(set(given) - set(valid))
    if not unknown:
        return
    hints = [f"{u!r} -> {c[0]!r}" for u in unknown if (c := difflib.get_close_matches(str(u), valid, n=1))]
    hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    raise ValueError(f"unknown {what} {unknown}{hint}; valid: {', '.join(valid)}")


def from_mapping(cls, options: Mapping | None, what: str, **overrides):
    """cls(**options, **overrides) for a dataclass whose field names are the valid option names."""
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"{what} must be given as a mapping of option names, got {type(options).__name__}")
    values = {**(options or {}), **overrides}
    check_names(values, [f for f in cls.__dataclass_fields__], what)
    return cls(**values)
