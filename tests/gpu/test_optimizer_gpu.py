"""The optimizer's Triton/Gluon kernels give bit-identical results to the PyTorch reference run on the same GPU:
quantize / dequantize (both formats, expansion on and off), and the fused AdamW step the optimizer launches (Gluon on
CUDA) over ragged segments, over full aligned rows (the vectorized path) and with group size 32, fp32 and bf16
gradients, NaN and Inf gradient groups: parameters, both code tensors and both metadata tensors, bit for bit."""
import pytest
import torch

from coat_kernels.optim import CoatFP8AdamW
from coat_kernels.optim import dre_reference as ref
from coat_kernels.optim import dre_triton as tri
from coat_kernels.optim.grouping import build_layout

N = 1 << 20
SEGMENTS = [(0, 300_001, 0), (300_001, 5, 7), (300_010, 700_000, 1_000_003), (1_000_010, 48_000, 64)]
LAYOUTS = {"ragged segments": build_layout(SEGMENTS, N, 128),
           "whole buffer (vectorized rows)": build_layout([(0, N, 0)], N, 128),
           "whole buffer, group 32": build_layout([(0, N, 0)], N, 32)}


def bits(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int32 if
                                                                                                t.element_size() == 4
                                                                                                else torch.int16)


def assert_same_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    diff = int((bits(a) != bits(b)).sum())
    assert diff == 0, f"{what}: {diff} elements differ"


def moments(n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    m = torch.randn(n, device="cuda", generator=g) * torch.exp(torch.randn(n, device="cuda", generator=g) * 2) * 1e-3
    m[::97] = 0
    v = m * m * torch.rand(n, device="cuda", generator=g) * 10
    # groups reaching fp32's maximum (exp2 saturates) and spanning 40+ decades (k < 1)
    m[256:320] = torch.rand(64, device="cuda", generator=g) * 3.4e38
    v[640:704] = torch.rand(64, device="cuda", generator=g) * 3.4e38
    return m, v


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("expand", [True, False])
def test_quantize_and_dequantize_kernels_equal_reference(fmt, expand):
    layout = LAYOUTS["ragged segments"]
    cfg = ref.DREConfig(fmt, expand=expand)
    for x in moments(N, 0):
        codes_ref, meta_ref = ref.quantize(x, layout, cfg)
        codes_tri, meta_tri = tri.quantize(x, layout, cfg)
        assert_same_bits(codes_tri, codes_ref, "codes")
        assert_same_bits(meta_tri, meta_ref, "metadata")
        assert_same_bits(tri.dequantize(codes_ref, meta_ref, layout), ref.dequantize(codes_ref, meta_ref, layout),
                         "dequantized")


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_fused_step_equals_reference_on_all_state_tensors(layout_name, grad_dtype):
    layout = LAYOUTS[layout_name]
    m_cfg, v_cfg = ref.DREConfig("e4m3"), ref.DREConfig("e4m3", keep_nonzero=True)
    torch.manual_seed(1)
    p0 = torch.randn(N, device="cuda") * 0.02
    m, v = moments(N, 2)
    mq, mm = ref.quantize(m, layout, m_cfg)
    vq, vm = ref.quantize(v, layout, v_cfg)
    g = (torch.randn(N, device="cuda") * 1e-3).to(grad_dtype)
    g[12345] = float("nan")
    g[500_000] = float("inf")
    h = ref.AdamWScalars.make(1e-3, 0.9, 0.95, 1e-8, 0.1, 7)
    a = [p0.clone(), mq.clone(), mm.clone(), vq.clone(), vm.clone()]
    b = [p0.clone(), mq.clone(), mm.clone(), vq.clone(), vm.clone()]
    skipped_ref = ref.fused_adamw_step(a[0], g, a[1], a[2], a[3], a[4], layout, h, m_cfg, v_cfg)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    tri.FusedAdamW([layout], torch.device("cuda"))([b[0]], [g], [b[1]], [b[2]], [b[3]], [b[4]], [h], m_cfg, v_cfg,
                                                    counter)
    for x, y, what in zip(b, a, ("params", "exp_avg codes", "exp_avg metadata", "exp_avg_sq codes",
                                 "exp_avg_sq metadata")):
        assert_same_bits(x, y, what)
    assert int(skipped_ref) == int(counter) == 2


def test_optimizer_on_cuda_equals_optimizer_on_cpu():
    """CoatFP8AdamW end to end: several tensors in one multi-tensor launch on the GPU, the reference on the CPU."""
    torch.manual_seed(3)
    shapes = [(1000, 129), (4096,), (77,), (256, 512)]
    cpu = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    opt_cpu, opt_gpu = CoatFP8AdamW(cpu, lr=1e-3, betas=(0.9, 0.95)), CoatFP8AdamW(gpu, lr=1e-3, betas=(0.9, 0.95))
    for _ in range(3):
        for p, q in zip(cpu, gpu):
            p.grad = torch.randn_like(p) * 1e-2
            q.grad = p.grad.cuda()
        opt_cpu.step()
        opt_gpu.step()
    for p, q in zip(cpu, gpu):
        assert_same_bits(q.detach().cpu(), p.detach(), "params")
        for key in ("exp_avg_q", "exp_avg_meta", "exp_avg_sq_q", "exp_avg_sq_meta"):
            assert_same_bits(opt_gpu.state[q][key].cpu(), opt_cpu.state[p][key], key)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_exact_export_on_cuda_round_trips_through_the_kernel(fmt):
    """fp32 moments exported on the GPU equal the CPU export bit for bit and quantize back (Triton kernel) to the
    same codes and metadata, including groups with k < 1 and values near fp32's maximum."""
    from coat_kernels.optim.exact_export import export, quantized_equal

    layout = LAYOUTS["ragged segments"]
    for x, cfg in zip(moments(N, 3), (ref.DREConfig(fmt), ref.DREConfig(fmt, keep_nonzero=True))):
        codes, meta = tri.quantize(x, layout, cfg)
        values, failed = export(codes, meta, layout, cfg)
        values_cpu, _ = export(codes.cpu(), meta.cpu(), layout, cfg)
        assert failed == 0
        assert_same_bits(values, values_cpu.cuda(), "exported values")
        assert quantized_equal(*tri.quantize(values, layout, cfg), codes, meta)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_exported_moments_quantize_back_to_their_codes_with_the_kernel(fmt):
    """A universal (or torch-format) checkpoint holds fp32 moments exported so that quantizing them again gives the
    saved codes and metadata (exact_export, searched with the reference); a load on a GPU quantizes them with the
    Triton kernel, which must give those codes back too."""
    from coat_kernels.optim import exact_export

    layout = LAYOUTS["ragged segments"]
    cfg = ref.DREConfig(fmt, expand=True)
    for x in moments(N, 1):
        codes, meta = tri.quantize(x, layout, cfg)
        exported, _ = exact_export.export(codes, meta, layout, cfg)
        for name, quantize in (("reference", ref.quantize), ("kernel", tri.quantize)):
            codes2, meta2 = quantize(exported, layout, cfg)
            assert_same_bits(meta2, meta, f"{name}: metadata")
            assert_same_bits(ref.dequantize(codes2, meta2, layout), ref.dequantize(codes, meta, layout),
                             f"{name}: decoded codes")
