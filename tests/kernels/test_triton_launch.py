"""BoundKernel's key: everything Triton specializes a compiled kernel on, and nothing that changes per call (the
launch through the compiled kernel itself runs on the GPU: tests/gpu/test_triton_launch_gpu.py)."""
import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from coat_kernels.triton_launch import BoundKernel


def _kernel(x_ptr, y_ptr, n, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 0):
    pass


def bound():
    return BoundKernel(JITFunction(_kernel), interpret=False)


def key(*args, **kwargs):
    return bound().key(args, kwargs)[1]


def test_calls_that_differ_only_in_what_triton_ignores_share_a_key():
    x, y = torch.zeros(64), torch.zeros(64)
    x2, y2 = torch.ones(32), torch.ones(128)  # other tensors, other sizes, same dtype and alignment
    a = key(x, y, 2, 0.5, True, BLOCK=64, num_warps=4)
    assert a == key(x2, y2, 3, 1.5, False, BLOCK=64, num_warps=4)
    assert a == key(x2, y_ptr=y2, n=5, scale=2.0, flag=False, BLOCK=64, num_warps=4)  # by keyword: no tensor in it
    hash(a)


def test_what_triton_specializes_on_changes_the_key():
    x, y = torch.zeros(64), torch.zeros(64)
    base = key(x, y, 2, 0.5, True, BLOCK=64)
    assert base != key(x[1:], y, 2, 0.5, True, BLOCK=64)  # address not a multiple of 16
    assert base != key(x.to(torch.bfloat16), y, 2, 0.5, True, BLOCK=64)  # dtype
    assert base != key(x, y, 1, 0.5, True, BLOCK=64)  # == 1 is a constant to Triton
    assert base != key(x, y, 32, 0.5, True, BLOCK=64)  # multiple of 16
    assert key(x, y, 16, 0.5, True, BLOCK=64) == key(x, y, 48, 0.5, True, BLOCK=64)
    assert base != key(x, y, 2 ** 31 + 2, 0.5, True, BLOCK=64)  # needs i64
    assert base != key(x, y, 2 ** 63 + 2, 0.5, True, BLOCK=64)  # needs u64
    assert base != key(x, None, 2, 0.5, True, BLOCK=64)  # None is a constant
    assert base != key(x, y, 2, 0.5, True, BLOCK=128)  # constexpr value
    assert base != key(x, y, 2, 0.5, True, BLOCK=64, MODE=1)  # constexpr default overridden
    assert base == key(x, y, 2, 0.5, True, BLOCK=64, MODE=0)
    assert base != key(x, y, 2, 0.5, True, BLOCK=64, num_warps=8)  # launch option


def test_values_come_in_parameter_order_with_defaults():
    x, y = torch.zeros(64), torch.zeros(64)
    values, _ = bound().key((x,), dict(flag=True, y_ptr=y, n=3, scale=1.0, BLOCK=16, num_warps=2))
    assert values[0] is x and values[1] is y and values[2:] == [3, 1.0, True, 16, 0]


@pytest.mark.parametrize("args, kwargs", [
    ((torch.zeros(4), torch.zeros(4), 2, 0.5), dict(BLOCK=64)),  # flag missing
    ((torch.zeros(4), torch.zeros(4), 2, 0.5, True), dict(BLOCK=64, n=3)),  # n given twice
    ((torch.zeros(4), torch.zeros(4), [2], 0.5, True), dict(BLOCK=64)),  # a list: not a kind the key covers
    ((torch.zeros(4), torch.zeros(4), 2, 0.5, True), dict(BLOCK=[64])),  # unhashable constexpr
    ((torch.zeros(4), torch.zeros(4), 2, 0.5, True, 64, 0, 9), {}),  # too many arguments
])
def test_calls_the_key_does_not_cover_take_tritons_own_path(args, kwargs):
    assert bound().key(args, kwargs) == (None, None)


def test_under_the_interpreter_every_launch_goes_through_the_jit_function():
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k)) or "launched"

    kernel = BoundKernel(Recorder(), interpret=True)
    assert kernel[(3,)](1, 2, BLOCK=4) == "launched"
    assert kernel[(5, 2)](7, BLOCK=8) == "launched"
    assert calls == [((3,), (1, 2), dict(BLOCK=4)), ((5, 2), (7,), dict(BLOCK=8))]
