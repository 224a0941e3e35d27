"""CoatFP8Lion's fused Triton step gives the torch reference's bits on the same GPU (parameters, codes, metadata,
skipped groups; fp32 and bf16 parameters, fp32 / bf16 / fp16 gradients, ragged segments and group size 32, NaN and
Inf gradient groups), and the optimizers on CUDA: CoatFP8Lion backend="auto" == backend="torch" bit for bit over
several steps, CoatFP8Muon with fp32 state == torch.optim.Muon on the GPU, FP8 Muon tracking it; the FP8 Muon step
(Triton-batched momenta) == its torch reference bit for bit, without host synchronisation."""
import pytest
import torch

from coat_kernels.optim import CoatFP8Lion, CoatFP8Muon
from coat_kernels.optim import lion_triton
from coat_kernels.optim.dre_reference import DREConfig, quantize
from coat_kernels.optim.grouping import build_layout
from coat_kernels.optim.lion_reference import LionScalars, fused_lion_step

N = 1 << 20
LAYOUTS = {"ragged segments": build_layout([(0, 300_001, 0), (300_001, 5, 7), (300_010, 700_000, 1_000_003)], N,
                                           128),
           "whole buffer, group 32": build_layout([(0, N, 0)], N, 32)}


def same_bits(a, b):
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and int((a.contiguous().view(view) != b.contiguous().view(view)).sum()) == 0


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("param_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.float32, torch.float16)])
def test_fused_lion_kernel_is_the_reference_bit_for_bit(layout_name, param_dtype, grad_dtype):
    layout = LAYOUTS[layout_name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    m = torch.randn(N, device="cuda", generator=gen) * torch.exp(torch.randn(N, device="cuda", generator=gen) * 2)
    m[::97] = 0
    cfg = DREConfig("e4m3")
    codes, meta = quantize(m, layout, cfg)
    param = torch.randn(N, device="cuda", generator=gen).to(param_dtype)
    grad = (torch.randn(N, device="cuda", generator=gen) * 1e-2).to(grad_dtype)
    grad[1000], grad[5000] = float("nan"), float("inf")
    h = LionScalars.make(3e-4, 0.9, 0.99, 0.1)
    a, b = [param.clone(), codes.clone(), meta.clone()], [param.clone(), codes.clone(), meta.clone()]
    skipped_ref = fused_lion_step(a[0], grad, a[1], a[2], layout, h, cfg)
    skipped = torch.zeros(1, dtype=torch.int32, device="cuda")
    lion_triton.fused_lion_step(b[0], grad, b[1], b[2], layout, h, cfg, skipped)
    assert int(skipped) == int(skipped_ref) >= 2
    assert same_bits(a[0], b[0]) and same_bits(a[1], b[1]) and same_bits(a[2], b[2])


def test_lion_optimizer_backends_agree_on_cuda():
    def run(backend):
        torch.manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(512, 384, device="cuda")),
                  torch.nn.Parameter(torch.randn(1000, device="cuda"))]
        opt = CoatFP8Lion(params, lr=1e-3, weight_decay=0.1, backend=backend)
        gen = torch.Generator(device="cuda").manual_seed(2)
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=gen)
            opt.step()
        return params, opt

    (fused, opt), (reference, _) = run("auto"), run("torch")
    assert all(same_bits(p, q) for p, q in zip(fused, reference))
    assert opt.state_bytes() / sum(p.numel() for p in fused) < 1.11


def test_muon_fp32_state_is_torch_muon_on_cuda_and_fp8_tracks_it():
    torch.manual_seed(3)
    w = torch.randn(1024, 768, device="cuda")
    oracle_w, ref_w, fp8_w = (torch.nn.Parameter(w.clone()) for _ in range(3))
    oracle = torch.optim.Muon([oracle_w], lr=0.02)
    ref, fp8 = CoatFP8Muon([ref_w], lr=0.02, state_dtype="fp32"), CoatFP8Muon([fp8_w], lr=0.02)
    gen = torch.Generator(device="cuda").manual_seed(4)
    for _ in range(10):
        g = torch.randn(w.shape, device="cuda", generator=gen)
        for p in (oracle_w, ref_w, fp8_w):
            p.grad = g.clone()
        oracle.step(), ref.step(), fp8.step()
    torch.testing.assert_close(ref_w, oracle_w, rtol=1e-6, atol=1e-7)
    assert (fp8_w - oracle_w).abs().max() < 0.02 * (oracle_w - w).abs().max()
    assert fp8.state_bytes() / w.numel() < 1.11


def test_fp8_muon_step_on_cuda_is_the_reference_and_never_waits_on_the_host(monkeypatch):
    """The Triton kernels (muon_triton: per batch of matrices the finiteness flags and the momenta, dequantized,
    stepped by torch's two lerps as fused multiply-adds and re-quantized; per matrix the parameter's update) = the
    torch reference (batched momenta, torch's own lerps and parameter update on CUDA) bit for bit, over several
    batches, a NaN gradient included; after the first step (which builds the kernel rows) a step makes no host
    synchronisation (the pointer table is copied from pinned memory)."""
    from coat_kernels.optim import moment_batch

    monkeypatch.setattr(moment_batch, "MAX_BATCH_NUMEL", 600_000)

    def run(backend, steps):
        torch.manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in ((512, 384), (300, 700), (1024, 256))]
        opt = CoatFP8Muon(params, lr=0.02, backend=backend)
        gen = torch.Generator(device="cuda").manual_seed(6)
        grads = [[torch.randn(p.shape, device="cuda", generator=gen) for p in params] for _ in range(steps)]
        grads[1][1][5, 5] = float("nan")
        for step, step_grads in enumerate(grads):
            for p, g in zip(params, step_grads):
                p.grad = g
            if step >= 1 and backend == "auto":
                torch.cuda.set_sync_debug_mode("error")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return params, opt

    (fused, opt), (reference, ref_opt) = run("auto", 4), run("torch", 4)
    assert all(same_bits(p, q) for p, q in zip(fused, reference))
    for p, q in zip(fused, reference):
        assert same_bits(opt.state[p]["exp_avg_q"], ref_opt.state[q]["exp_avg_q"])
        assert same_bits(opt.state[p]["exp_avg_meta"], ref_opt.state[q]["exp_avg_meta"])
    assert opt.skipped_groups == ref_opt.skipped_groups == 300 * 700 // 128 + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tall", [False, True])
def test_muon_parameter_kernel_is_torch_muons_update_on_cuda(dtype, tall):
    """muon_triton.apply_update_ = torch.optim.Muon's `p.mul_(1 - lr wd).add_(O, alpha=-lr')` on CUDA bit for bit,
    fp32 and bf16 parameters, O transposed (Newton-Schulz's output for tall matrices) or not; a matrix whose gradient
    was not finite is left as it was."""
    from coat_kernels.optim import muon_triton

    gen = torch.Generator(device="cuda").manual_seed(8)
    shape = (700, 300) if tall else (300, 700)
    p = (torch.randn(shape, device="cuda", generator=gen) * 0.1).to(dtype)
    o = torch.randn(shape[::-1], device="cuda", generator=gen).bfloat16().T if tall else torch.randn(
        shape, device="cuda", generator=gen).bfloat16()
    decay, lr = 1 - 0.02 * 0.1, 0.02 * 0.2 * 700 ** 0.5
    expected = p.clone().mul_(decay).add_(o, alpha=-lr)
    original, kept = p.clone(), p.clone()
    muon_triton.apply_update_(kept, o, decay, lr, torch.tensor(False, device="cuda"))
    muon_triton.apply_update_(p, o, decay, lr, torch.tensor(True, device="cuda"))
    assert same_bits(p, expected)
    assert same_bits(kept, original) and not same_bits(kept, expected)
