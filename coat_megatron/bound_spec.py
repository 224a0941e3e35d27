"""ModuleSpecs that carry a COAT layer's constructor arguments, for the submodules Megatron instantiates.

Megatron builds some submodules with `build_module(spec, ...)` and calls others directly (megatron-core 0.19's MLP
calls `submodules.linear_fc2(...)`), so a bound spec is a ModuleSpec that can also be called like a class.
"""
from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec, build_module


class CallableSpec(ModuleSpec):
    """A ModuleSpec that Megatron can also call like a class (for submodules it instantiates directly)."""

    def __call__(self, *args, **kwargs):
        return build_module(self, *args, **kwargs)


def bind(spec, **params) -> CallableSpec:
    """`spec` (a class or a ModuleSpec) with these constructor arguments added to its own."""
    if isinstance(spec, ModuleSpec):
        return CallableSpec(module=spec.module, params={**spec.params, **params}, submodules=spec.submodules)
    return CallableSpec(module=spec, params=params)
