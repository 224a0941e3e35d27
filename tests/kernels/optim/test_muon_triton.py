"""CoatFP8Muon's Triton momentum kernel under the interpreter against the torch reference of the same step: the FP8
momentum dequantized, torch's lerps (torch.optim.Muon's operations), re-quantized; and its parameter kernel against
torch.optim.Muon's `p.mul_(1 - lr wd).add_(O, alpha=-lr')`. The update Newton-Schulz starts from (bf16) must be
bit-equal (it depends on the decoder and the lerps, which the interpreter computes exactly), and so must the
parameters; codes and metadata within the interpreter's fp8 rounding (its fp32->fp8 casts do not round to nearest
even). Bit-exact codes are checked on the GPU (tests/gpu/test_lion_muon_gpu.py)."""
import pytest
import torch

from coat_kernels.optim import CoatFP8Muon, muon_triton
from coat_kernels.optim.dre_reference import DREConfig, dequantize, quantize
from coat_kernels.optim.grouping import build_layout

CFG = DREConfig("e4m3")


def momentum_state(shape, seed, group_size=128):
    gen = torch.Generator().manual_seed(seed)
    n = shape[0] * shape[1]
    layout = build_layout(None, n, group_size)
    m = torch.randn(n, generator=gen) * torch.logspace(-5, 0, n)
    codes, meta = quantize(m, layout, CFG)
    grad = torch.randn(shape, generator=gen) * torch.logspace(-4, -1, n).view(shape)
    return layout, codes, meta, grad


def reference_step(grad, codes, meta, layout, momentum, nesterov):
    m = dequantize(codes, meta, layout).view(grad.shape)
    m.lerp_(grad, 1 - momentum)
    update = grad.lerp(m, momentum) if nesterov else m.clone()
    return update, *quantize(m.reshape(-1), layout, CFG)


def assert_codes_close(codes, meta, ref_codes, ref_meta):
    torch.testing.assert_close(meta, ref_meta, rtol=1e-5, atol=1e-5)
    differ = (codes.view(torch.uint8).int() - ref_codes.view(torch.uint8).int()).abs()
    assert int(differ.max()) <= 1 and float((differ > 0).float().mean()) < 0.01  # fp8 casts round differently


def kernel_step(grads, states, momentum=0.95, nesterov=True):
    """MomentumBatch over the matrices of `states` ((layout, codes, meta) each), their momenta stepped in place."""
    batch = muon_triton.MomentumBatch([layout for layout, _, _ in states], torch.device("cpu"))
    updates, flags = batch.step(grads, [c for _, c, _ in states], [m for _, _, m in states], momentum, nesterov, CFG)
    return updates, flags, batch


@pytest.mark.parametrize("momentum,nesterov", [(0.95, True), (0.95, False), (0.3, True)])
def test_momentum_kernel_is_the_torch_step(momentum, nesterov):
    """0.95: the momentum's lerp takes the small-weight form and Nesterov's the large one; 0.3 the other way round."""
    layout, codes, meta, grad = momentum_state((40, 70), 0)
    ref_update, ref_codes, ref_meta = reference_step(grad, codes, meta, layout, momentum, nesterov)
    (update,), flags, _ = kernel_step([grad], [(layout, codes, meta)], momentum, nesterov)
    assert update.dtype == torch.bfloat16 and update.shape == grad.shape and flags.tolist() == [1]
    assert torch.equal(update.view(torch.int16), ref_update.bfloat16().view(torch.int16))
    assert_codes_close(codes, meta, ref_codes, ref_meta)


def test_one_launch_steps_several_matrices_and_skips_the_nonfinite_one():
    """Three matrices in one batch (sizes that end inside a launch row, bf16 gradients), the second with an Inf and
    a NaN: each of the others is its own torch step, the second keeps its codes and metadata, flags and the skipped
    groups say which."""
    shapes = [(40, 70), (24, 64), (9, 100)]
    states, grads, refs = [], [], []
    for i, shape in enumerate(shapes):
        layout, codes, meta, grad = momentum_state(shape, 10 + i)
        grad = grad.bfloat16()
        if i == 1:
            grad[3, 5], grad[7, 1] = float("inf"), float("nan")
            refs.append((None, codes.clone(), meta.clone()))
        else:
            refs.append(reference_step(grad.float(), codes, meta, layout, 0.95, True))
        states.append((layout, codes, meta))
        grads.append(grad)
    updates, flags, batch = kernel_step(grads, states)
    assert flags.tolist() == [1, 0, 1]
    assert int(batch.skipped(flags)) == states[1][0].num_groups
    for (layout, codes, meta), (ref_update, ref_codes, ref_meta), update in zip(states, refs, updates):
        if ref_update is None:
            assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)) and torch.equal(meta, ref_meta)
            continue
        assert torch.equal(update.view(torch.int16), ref_update.bfloat16().view(torch.int16))
        assert_codes_close(codes, meta, ref_codes, ref_meta)


def test_gradients_of_another_size_or_mixed_dtypes_are_refused():
    layout, codes, meta, grad = momentum_state((8, 64), 2)
    other = momentum_state((8, 64), 3)
    with pytest.raises(ValueError, match="gradients of \\[256\\] elements for momentum layouts of \\[512\\]"):
        kernel_step([grad[:4]], [(layout, codes, meta)])
    with pytest.raises(TypeError, match="one launch steps gradients of one dtype"):
        kernel_step([grad, other[3].bfloat16()], [(layout, codes, meta), other[:3]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_steps_like_the_torch_backend(dtype):
    """CoatFP8Muon on the kernel (backend "triton", interpreted) against backend "torch" over a few steps, an Inf
    gradient included, fp32 and bf16 parameters (bf16 gradients): the same parameters within the codes' interpreter
    rounding, the same skipped groups."""
    gen = torch.Generator().manual_seed(3)
    init = [(torch.randn(s, generator=gen) * 0.1).to(dtype) for s in ((48, 32), (32, 80))]
    runs = {}
    for backend in ("torch", "triton"):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = CoatFP8Muon(params, lr=0.02, backend=backend, group_size=32)
        grads_gen = torch.Generator().manual_seed(4)
        for step in range(4):
            for p in params:
                p.grad = (torch.randn(p.shape, generator=grads_gen) * 1e-2).to(dtype)
            if step == 2:
                params[1].grad[0, 0] = float("inf")
            opt.step()
        runs[backend] = params, opt.skipped_groups
    for a, b in zip(runs["torch"][0], runs["triton"][0]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-3)  # bf16: 2 ulps at 0.1
    assert int(runs["torch"][1]) == int(runs["triton"][1]) == 32 * 80 // 32


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_matrix_its_segments_cover_only_in_part_is_refused(backend):
    """An engine whose param_segments leave part of a Muon matrix outside every group gets an error before anything
    is written (Newton-Schulz needs the whole matrix's momentum), on the kernel and on the reference alike."""

    class PartialSegments(CoatFP8Muon):
        def param_segments(self, param, group_index):
            return [(0, param.numel() - 16, 0)]

    w = torch.nn.Parameter(torch.randn(8, 64))
    before = w.detach().clone()
    opt = PartialSegments([w], lr=0.02, backend=backend, group_size=32)
    w.grad = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="param_segments gives 496 of the \\(8, 64\\) matrix's 512 elements"):
        opt.step()
    assert torch.equal(w.detach(), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tall", [False, True])
def test_parameter_kernel_is_torch_muons_update(dtype, tall):
    """Newton-Schulz returns a transposed view for tall matrices: the kernel reads it by its strides. Shapes that
    are not multiples of the kernel's tile, weight decay on. bf16 parameters against the formula torch's CUDA add
    computes (the GPU test checks it against torch on CUDA)."""
    gen = torch.Generator().manual_seed(7)
    shape = (150, 70) if tall else (70, 150)
    p = (torch.randn(shape, generator=gen) * 0.1).to(dtype)
    orthogonal = torch.randn(shape[::-1], generator=gen).bfloat16().T if tall else torch.randn(
        shape, generator=gen).bfloat16()
    decay, lr = 1 - 0.02 * 0.1, 0.02 * 0.2 * 150 ** 0.5
    expected = p.clone().mul_(decay)
    if dtype == torch.float32:
        expected.add_(orthogonal, alpha=-lr)
    else:  # torch on CUDA: alpha in fp32, one rounding to bf16 (on the CPU torch rounds alpha to bf16 first)
        alpha = torch.tensor(-lr, dtype=torch.float32).double()
        expected = (expected.double() + alpha * orthogonal.double()).float().bfloat16()
    muon_triton.apply_update_(p, orthogonal, decay, lr, torch.tensor(True))
    assert torch.equal(p.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_parameter_kernel_writes_nothing_when_the_gradient_was_not_finite():
    p = torch.randn(40, 90)
    before = p.clone()
    muon_triton.apply_update_(p, torch.full((40, 90), float("nan")).bfloat16(), 0.99, 0.1, torch.tensor(False))
    assert torch.equal(p.view(torch.int32), before.view(torch.int32))


def test_parameter_kernel_refuses_an_update_of_another_shape():
    with pytest.raises(ValueError, match="update of shape \\(8, 4\\) for a parameter of shape \\(4, 8\\)"):
        muon_triton.apply_update_(torch.zeros(4, 8), torch.zeros(8, 4).bfloat16(), 1.0, 0.1, torch.tensor(True))
