"""The C++ CPU step and the GPU kernel step the same inputs to the same bits: parameters, both code tensors and both
metadata tensors (so a ZeRO-Offload run and a GPU run of CoatFP8AdamW are interchangeable)."""
import pytest
import torch

from coat_kernels.optim import cpu_step
from coat_kernels.optim import dre_reference as ref
from coat_kernels.optim import dre_triton as tri
from coat_kernels.optim.grouping import build_layout

N = 1 << 20
SEGMENTS = [(0, 300_001, 0), (300_001, 5, 7), (300_010, 700_000, 1_000_003), (1_000_010, 48_000, 64)]


def bits(t):
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_cpu_step_equals_the_gpu_kernel(fmt, grad_dtype):
    layout = build_layout(SEGMENTS, N, 128)
    m_cfg, v_cfg = ref.DREConfig(fmt), ref.DREConfig(fmt, keep_nonzero=True)
    g = torch.Generator().manual_seed(0)
    p = torch.randn(N, generator=g) * 0.02
    m = torch.randn(N, generator=g) * torch.exp(torch.randn(N, generator=g) * 2) * 1e-3
    v = m * m * 10
    m[256:320] = torch.rand(64, generator=g) * 3.4e38  # up to fp32's maximum, 40+ decades in one group (k < 1)
    v[640:704] = torch.rand(64, generator=g) * 3.4e38
    mq, mm = ref.quantize(m, layout, m_cfg)
    vq, vm = ref.quantize(v, layout, v_cfg)
    grad = (torch.randn(N, generator=g) * 1e-3).to(grad_dtype)
    grad[12345], grad[500_000] = float("nan"), float("inf")
    h = ref.AdamWScalars.make(1e-3, 0.9, 0.95, 1e-8, 0.1, 7)
    cpu = [t.clone() for t in (p, mq, mm, vq, vm)]
    gpu = [t.clone().cuda() for t in (p, mq, mm, vq, vm)]
    skipped_cpu = cpu_step.fused_adamw_step(cpu[0], grad, cpu[1], cpu[2], cpu[3], cpu[4], layout, h, m_cfg, v_cfg)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    tri.FusedAdamW([layout], torch.device("cuda"))([gpu[0]], [grad.cuda()], [gpu[1]], [gpu[2]], [gpu[3]], [gpu[4]],
                                                    [h], m_cfg, v_cfg, counter)
    assert cpu_step.library() is not None
    for x, y, what in zip(cpu, gpu, ("params", "exp_avg codes", "exp_avg meta", "exp_avg_sq codes", "exp_avg_sq meta")):
        assert torch.equal(bits(x), bits(y)), what
    assert int(skipped_cpu) == int(counter) == 2
