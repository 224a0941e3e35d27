"""The C++ CPU step of CoatFP8AdamW (coat_kernels.optim.cpu_step): bit-exact with the torch reference on ragged
segments, both formats, expansion on and off, fp32 / bf16 / fp16 gradients, bf16 parameters, NaN/Inf groups, group
sizes 128 and 32; the same bits at 1 and 2 threads; the optimizer uses it for CPU tensors; a failed build falls back to
the reference with one warning; DeepSpeed ZeRO-2 with the optimizer offloaded to the CPU resumes bit-exactly."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from coat_kernels.optim import CoatFP8AdamW, cpu_step
from coat_kernels.optim import dre_reference as ref
from coat_kernels.optim.grouping import build_layout
from rank_jobs import free_port

HERE = Path(__file__).resolve().parent
N = 5000
SEGMENTS = [(0, 301, 0), (301, 5, 7), (310, 3000, 1_000_003), (3400, 1600, 64)]


def bits(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(
        {2: torch.int16, 4: torch.int32}[t.element_size()])


def inputs(grad_dtype, param_dtype, layout, m_cfg, v_cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(N, generator=g) * 0.02).to(param_dtype)
    m = torch.randn(N, generator=g) * torch.exp(torch.randn(N, generator=g) * 2) * 1e-3
    m[::97] = 0
    v = m * m * torch.rand(N, generator=g) * 10
    m[256:320] = torch.rand(64, generator=g) * 3.4e38  # up to fp32's maximum, 40+ decades in one group (k < 1)
    v[640:704] = torch.rand(64, generator=g) * 3.4e38
    mq, mm = ref.quantize(m, layout, m_cfg)
    vq, vm = ref.quantize(v, layout, v_cfg)
    grad = (torch.randn(N, generator=g) * 1e-3).to(grad_dtype)
    grad[123], grad[3456] = float("nan"), float("inf")
    return p, grad, mq, mm, vq, vm


@pytest.mark.parametrize("fmt,expand,group_size", [("e4m3", (True, True), 128), ("e5m2", (False, True), 128),
                                                   ("e4m3", (True, False), 32)])
@pytest.mark.parametrize("grad_dtype,param_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                    (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_cpu_step_equals_the_reference_bit_for_bit(fmt, expand, group_size, grad_dtype, param_dtype):
    layout = build_layout(SEGMENTS, N, group_size)
    m_cfg, v_cfg = ref.DREConfig(fmt, expand=expand[0]), ref.DREConfig(fmt, expand=expand[1], keep_nonzero=True)
    h = ref.AdamWScalars.make(1e-3, 0.9, 0.95, 1e-8, 0.1, 7)
    p, grad, mq, mm, vq, vm = inputs(grad_dtype, param_dtype, layout, m_cfg, v_cfg)
    a = [t.clone() for t in (p, mq, mm, vq, vm)]
    b = [t.clone() for t in (p, mq, mm, vq, vm)]
    skipped_a = ref.fused_adamw_step(a[0], grad, a[1], a[2], a[3], a[4], layout, h, m_cfg, v_cfg)
    skipped_b = cpu_step.fused_adamw_step(b[0], grad, b[1], b[2], b[3], b[4], layout, h, m_cfg, v_cfg)
    for x, y, what in zip(a, b, ("params", "exp_avg codes", "exp_avg meta", "exp_avg_sq codes", "exp_avg_sq meta")):
        assert torch.equal(bits(x), bits(y)), what
    assert int(skipped_a) == int(skipped_b) == 2


def test_threads_do_not_change_bits():
    layout = build_layout(None, 200_000, 128)
    m_cfg, v_cfg = ref.DREConfig("e4m3"), ref.DREConfig("e4m3", keep_nonzero=True)
    h = ref.AdamWScalars.make(1e-3, 0.9, 0.95, 1e-8, 0.1, 3)
    g = torch.Generator().manual_seed(4)
    p, grad = torch.randn(200_000, generator=g) * 0.02, torch.randn(200_000, generator=g) * 1e-3
    mq, mm = ref.quantize(grad, layout, m_cfg)
    vq, vm = ref.quantize(grad * grad, layout, v_cfg)
    results, before = [], torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            state = [t.clone() for t in (p, mq, mm, vq, vm)]
            cpu_step.fused_adamw_step(state[0], grad, state[1], state[2], state[3], state[4], layout, h, m_cfg, v_cfg)
            results.append(state)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(*results))


def test_optimizer_steps_cpu_tensors_with_the_library():
    torch.manual_seed(0)
    shapes = [(300, 17), (4096,), (33,)]
    a = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    fast, slow = CoatFP8AdamW(a, lr=1e-3), CoatFP8AdamW(b, lr=1e-3, backend="torch")
    for _ in range(3):
        for p, q in zip(a, b):
            p.grad = torch.randn_like(p) * 1e-2
            q.grad = p.grad.clone()
        fast.step()
        slow.step()
    for p, q in zip(a, b):
        assert torch.equal(bits(p.detach()), bits(q.detach()))
        for key in ("exp_avg_q", "exp_avg_meta", "exp_avg_sq_q", "exp_avg_sq_meta"):
            assert torch.equal(bits(fast.state[p][key]), bits(slow.state[q][key])), key


def test_failed_build_falls_back_to_the_reference_with_one_warning(monkeypatch):
    def broken(compiler=None):
        raise RuntimeError("no C++ compiler (simulated)")

    cpu_step.library.cache_clear()
    monkeypatch.setattr(cpu_step, "build", broken)
    try:
        layout = build_layout(SEGMENTS, N, 128)
        m_cfg, v_cfg = ref.DREConfig("e4m3"), ref.DREConfig("e4m3", keep_nonzero=True)
        h = ref.AdamWScalars.make(1e-3, 0.9, 0.95, 1e-8, 0.1, 2)
        p, grad, mq, mm, vq, vm = inputs(torch.float32, torch.float32, layout, m_cfg, v_cfg)
        a, b = [t.clone() for t in (p, mq, mm, vq, vm)], [t.clone() for t in (p, mq, mm, vq, vm)]
        with pytest.warns(RuntimeWarning, match="fast CPU optimizer step is unavailable"):
            cpu_step.fused_adamw_step(a[0], grad, a[1], a[2], a[3], a[4], layout, h, m_cfg, v_cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cpu_step.fused_adamw_step(a[0], grad, a[1], a[2], a[3], a[4], layout, h, m_cfg, v_cfg)
        ref.fused_adamw_step(b[0], grad, b[1], b[2], b[3], b[4], layout, h, m_cfg, v_cfg)
        ref.fused_adamw_step(b[0], grad, b[1], b[2], b[3], b[4], layout, h, m_cfg, v_cfg)
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))
    finally:
        cpu_step.library.cache_clear()


def test_deepspeed_zero2_cpu_offload_resumes_bit_exactly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(HERE / "ds_offload_resume_script.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("offload resume bit-exact") == 2, proc.stdout
