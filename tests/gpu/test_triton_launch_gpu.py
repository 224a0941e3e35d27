"""BoundKernel on the GPU: after the first call of a key the compiled kernel's launcher runs it, with the results of
Triton's own launch, on the current stream and inside CUDA graph capture."""
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from coat_kernels.triton_launch import BoundKernel, bound_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@bound_kernel
@triton.jit
def _affine_kernel(x_ptr, y_ptr, n, scale, ADD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    tl.store(y_ptr + offs, (x * scale + ADD + n).to(y_ptr.dtype.element_ty), mask=mask)


def launch(x, scale=0.5, add=3, block=128):
    y = torch.empty_like(x)
    _affine_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), scale, ADD=add, BLOCK=block)
    return y


def expected(x, scale=0.5, add=3):
    return (x.float() * scale + add + x.numel()).to(x.dtype)


@pytest.fixture
def jit_runs(monkeypatch):
    """How many launches went through JITFunction.run."""
    count = [0]
    original = JITFunction.run

    def counted(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counted)
    return count


def test_repeated_keys_skip_jit_run_and_match_it(jit_runs):
    base = torch.randn(4096, device="cuda")
    half = base.to(torch.bfloat16)
    cases = [base, base[1:], base[:1], base[:16], base[:17], half, half[3:]]  # alignments, n == 1, n % 16, dtypes
    known = len(_affine_kernel._compiled)
    for x in cases:  # first call of each key: through JITFunction.run
        torch.testing.assert_close(launch(x), expected(x), rtol=0, atol=0)
    first = jit_runs[0]
    assert first == len(_affine_kernel._compiled) - known > 1  # the cases do not all share one key
    for x in cases:  # again, now through the bound launchers; other data, same keys
        x = x * 2
        torch.testing.assert_close(launch(x), expected(x), rtol=0, atol=0)
    torch.testing.assert_close(launch(base, scale=1.5), expected(base, scale=1.5), rtol=0, atol=0)
    assert jit_runs[0] == first
    y = launch(base, add=5)  # another constexpr: a new key, compiled by Triton
    torch.testing.assert_close(y, expected(base, add=5), rtol=0, atol=0)
    assert jit_runs[0] == first + 1


def test_bound_launch_on_a_side_stream_and_in_a_cuda_graph():
    x = torch.randn(1000, device="cuda")
    launch(x)  # the key is known: the launches below are bound
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = launch(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(y, expected(x), rtol=0, atol=0)

    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = launch(static_x)
    static_x.copy_(torch.randn_like(static_x))
    graph.replay()
    torch.testing.assert_close(static_y, expected(static_x), rtol=0, atol=0)


def test_a_wrong_call_gets_tritons_error():
    x = torch.randn(64, device="cuda")
    with pytest.raises(TypeError):
        _affine_kernel[(1,)](x, x, 64, 0.5, BLOCK=64)  # ADD missing
    assert isinstance(_affine_kernel, BoundKernel)
