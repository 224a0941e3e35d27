"""Triton launches without `JITFunction.run`'s per-call work.

`bound_kernel(jit_fn)[grid](*args, **kwargs)` launches what `jit_fn[grid](*args, **kwargs)` launches. The first
call with a new key goes through `JITFunction.run` (which compiles when it has to and returns the compiled kernel);
later calls with that key call the compiled kernel's launcher directly, skipping Triton's binder, its string cache
key, its device and hook look-ups. The key holds everything Triton specializes a compiled kernel on, at least as
finely as Triton does:
- constexpr parameters and launch options (num_warps, ...): their values;
- tensors: dtype and whether the address is a multiple of 16;
- ints: whether equal to 1, whether a multiple of 16, and the integer type they need (i32, i64 or u64);
- floats, bools and None: their kind;
- the current CUDA device.
So a key never maps to a kernel that Triton would not have chosen for the same call (Triton's debug and
instrumentation knobs count as they stood when the key was first seen). Launch hooks (Triton's profilers), a
callable grid and the interpreter (TRITON_INTERPRET=1) take `jit_fn`'s own path on every call, and an argument of
any other kind sends that call there too. Each `BoundKernel` remembers one compiled kernel per key it has seen: a
few per call site (alignments and size classes), as Triton's own cache does.
"""
from __future__ import annotations

import torch
from triton import knobs

from .triton_fp8 import INTERPRET

_I32 = (-(2 ** 31), 2 ** 31 - 1)
_I64 = (-(2 ** 63), 2 ** 63 - 1)
_NOT_KEYABLE = object()


def _runtime_key(v):
    """What Triton specializes a non-constexpr argument on (see the module docstring)."""
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() % 16 == 0
    if v is None:
        return None
    if isinstance(v, bool):
        return bool
    if isinstance(v, int):
        kind = 0 if _I32[0] <= v <= _I32[1] else 1 if _I64[0] <= v <= _I64[1] else 2
        return kind, v == 1, v % 16 == 0
    if isinstance(v, float):
        return float
    return _NOT_KEYABLE


def _value_key(v):
    """A constexpr's value as a key (its exact value selects the kernel); unhashable values are not keyable."""
    if v is _NOT_KEYABLE:
        return v
    try:
        hash(v)
    except TypeError:
        return _NOT_KEYABLE
    return type(v), v


class BoundKernel:
    """A `triton.jit` function launched through its compiled kernels' launchers (see the module docstring).
    `interpret`: launch through `jit_fn` always (Triton's interpreter has no compiled kernels)."""

    def __init__(self, jit_fn, interpret: bool = INTERPRET):
        self.jit_fn = jit_fn
        self.interpret = interpret
        self._compiled = {}
        if interpret:
            return
        params = jit_fn.params
        self._index = {p.name: i for i, p in enumerate(params)}
        self._defaults = [p.default if p.has_default else _NOT_KEYABLE for p in params]
        self._keyers = [_value_key if p.is_constexpr else _runtime_key for p in params]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        jit_fn = self.jit_fn
        if (self.interpret or callable(grid) or knobs.runtime.launch_enter_hook.calls
                or knobs.runtime.launch_exit_hook.calls):
            return jit_fn[grid](*args, **kwargs)
        values, key = self.key(args, kwargs)
        device = torch.cuda.current_device()
        if key is not None:
            key = (device, key)
        kernel = self._compiled.get(key) if key is not None else None
        if kernel is None:
            kernel = jit_fn[grid](*args, **kwargs)
            if hasattr(kernel, "result"):  # Triton's asynchronous compile mode hands back a future
                kernel = kernel.result()
            if key is not None:
                self._compiled[key] = kernel
            return kernel
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)  # the stream Triton itself launches on
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *values)
        return kernel

    def key(self, args, kwargs):
        """(every parameter's value in order with defaults filled in, the compiled-kernel key less the device) of a
        call; (None, None) when an argument is missing, repeated or of a kind the key does not cover, so that the
        call takes Triton's own path (which also reports what is wrong with it)."""
        defaults = self._defaults
        if len(args) > len(defaults):
            return None, None
        values = list(args) + defaults[len(args):]
        options = []
        for name, v in kwargs.items():
            i = self._index.get(name)
            if i is None:
                options.append((name, v))
            elif i < len(args):
                return None, None
            else:
                values[i] = v
        options = tuple(options)
        try:
            hash(options)
        except TypeError:
            return None, None
        per_arg = tuple([k(v) for k, v in zip(self._keyers, values)])
        if _NOT_KEYABLE in per_arg:
            return None, None
        return values, (options, per_arg)


def bound_kernel(jit_fn) -> BoundKernel:
    """Decorator above `@triton.jit`: the kernel launches through `BoundKernel`."""
    return BoundKernel(jit_fn)
