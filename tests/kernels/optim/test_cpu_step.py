"""The C++ CPU step of CoatFP8AdamW (coat_kernels.optim.cpu_step): bit-exact with the torch reference on ragged
segments, both formats, expansion on and off, fp32 / bf16 / fp16 gradients, bf16 parameters, NaN/Inf groups, group
sizes 128 and 32; over several steps, both of the library's implementations (the AVX-512 one where the CPU has it, and
the portable one), on the groups each of the AVX-512 path's cases covers (zeros, k < 1, k above its limit, magnitudes
near fp32's extremes, group sizes up to the maximum, mixed formats); the same bits at 1 and 2 threads; the optimizer
uses it for CPU tensors; a failed build falls back to the reference with one warning; DeepSpeed ZeRO-2 with the
optimizer offloaded to the CPU resumes bit-exactly."""
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
from rank_helpers import JOBS, free_port

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


@pytest.fixture(scope="module")
def portable_library():
    """The library built with its portable implementation alone."""
    return cpu_step.load(cpu_step.build(extra_flags=("-DCOAT_PORTABLE",)))


N_PATHS = 12_000


def path_state(m_cfg, v_cfg, layout, seed):
    """Moments whose groups take each of the AVX-512 path's cases (and its fallbacks), quantized; regions of whole
    groups for every group size tested."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(N_PATHS, generator=g) * torch.exp(torch.randn(N_PATHS, generator=g)) * 1e-3
    v = m * m * (torch.rand(N_PATHS, generator=g) + 0.5)
    zero = torch.zeros(N_PATHS, dtype=torch.bool)
    zero[5:1500:89] = True  # with zero gradients these stay exact zeros: the encoder's general lanes
    m[zero], v[zero] = 0.0, 0.0
    m[1500:2700] = torch.randn(1200, generator=g) * torch.exp(torch.randn(1200, generator=g) * 15)  # k < 1
    v[1500:2700] = m[1500:2700].abs() * 1e-3
    m[2700:3300] = torch.randn(600, generator=g) * 1e-36  # near 2^-126: codes decoding below it, subnormals
    v[2700:3300] = torch.rand(600, generator=g) * 1e-37
    m[3100:3110] = 1e-40
    m[3300:3700] = torch.rand(400, generator=g) * 3e38  # near fp32's maximum: the decoder saturates
    v[3700:4100] = torch.rand(400, generator=g) * 3e38
    v[4100:5300] = torch.rand(1200, generator=g) * torch.exp(torch.randn(1200, generator=g) * 6)  # y below the
    m[5400:5410], v[5400:5410] = -1e-11, 0.0  # -0 codes without expansion                   # smallest subnormal
    m[7100:9900] = 1.0 + torch.rand(2800, generator=g) * 1e-4  # a narrow range: k at k_max
    v[7100:9900] = 3.0 + torch.rand(2800, generator=g) * 1e-5
    mq, mm = ref.quantize(m, layout, m_cfg)
    vq, vm = ref.quantize(v, layout, v_cfg)
    return mq, mm, vq, vm, zero


@pytest.mark.parametrize("formats,expand,group_size,k_max,grad_dtype,param_dtype", [
    (("e4m3", "e4m3"), (True, True), 128, 16.0, torch.float32, torch.float32),
    (("e5m2", "e5m2"), (True, True), 128, 16.0, torch.bfloat16, torch.float32),
    (("e4m3", "e5m2"), (False, True), 100, 16.0, torch.float32, torch.bfloat16),
    (("e5m2", "e4m3"), (True, False), 48, 16.0, torch.bfloat16, torch.bfloat16),
    (("e4m3", "e4m3"), (True, True), 1024, 16.0, torch.float32, torch.float32),
    (("e4m3", "e4m3"), (True, True), 200, 1000.0, torch.float32, torch.float32),  # k above the AVX-512 path's limit
    (("e5m2", "e5m2"), (False, False), 128, 16.0, torch.float32, torch.float32),
])
@pytest.mark.parametrize("implementation", ["default", "portable"])
def test_cpu_step_paths_equal_the_reference_over_several_steps(formats, expand, group_size, k_max, grad_dtype,
                                                                param_dtype, implementation, portable_library,
                                                                monkeypatch):
    if implementation == "portable":
        monkeypatch.setattr(cpu_step, "library", lambda: portable_library)
    segments = [(0, 2999, 0), (2999, 4001, 5), (7000, 5000, 1 << 20)]
    layout = build_layout(segments, N_PATHS, group_size)
    m_cfg = ref.DREConfig(formats[0], expand=expand[0], k_max=k_max)
    v_cfg = ref.DREConfig(formats[1], expand=expand[1], k_max=k_max, keep_nonzero=True)
    mq, mm, vq, vm, zero = path_state(m_cfg, v_cfg, layout, seed=group_size)
    g = torch.Generator().manual_seed(1)
    p = torch.randn(N_PATHS, generator=g) * 0.02
    p[5400:5410] = -0.0  # with -0 gradients and moments decoded from -0 codes: the signs of zeros matter
    p = p.to(param_dtype)
    a = [t.clone() for t in (p, mq, mm, vq, vm)]
    b = [t.clone() for t in (p, mq, mm, vq, vm)]
    for step in range(1, 5):
        h = ref.AdamWScalars.make(1e-3, 0.9, 0.95, 1e-8, 0.1, step)
        grad = torch.randn(N_PATHS, generator=g) * 1e-3
        grad[zero] = 0.0
        grad[2700:3300] *= 1e-33
        grad[7100:9900] *= 1e-4
        grad[5400:5410] = -0.0
        if step == 2:
            grad[6001], grad[9500] = float("nan"), float("inf")
        if step == 3:  # larger group maxima: earlier small values fall below the smallest subnormal's half
            grad[4100:5300:5] = 1e5
        grad = grad.to(grad_dtype)
        skipped_a = ref.fused_adamw_step(a[0], grad, a[1], a[2], a[3], a[4], layout, h, m_cfg, v_cfg)
        skipped_b = cpu_step.fused_adamw_step(b[0], grad, b[1], b[2], b[3], b[4], layout, h, m_cfg, v_cfg)
        for x, y, what in zip(a, b, ("params", "exp_avg codes", "exp_avg meta", "exp_avg_sq codes",
                                     "exp_avg_sq meta")):
            assert torch.equal(bits(x), bits(y)), f"step {step}: {what}"
        assert int(skipped_a) == int(skipped_b) == (2 if step == 2 else 0)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cpu_step_encodes_log2_boundaries_exactly(fmt):
    """With beta1 = 0 the new first moment is the gradient itself: mantissas at and around the log2 fold (sqrt 2),
    at the ends of the binade, in every group, over a range of exponents."""
    mantissas = torch.tensor([0x3504F2, 0x3504F3, 0x3504F4, 0x3504F5, 0, 1, 0x7FFFFF, 0x400000], dtype=torch.int32)
    exponents = torch.arange(-40, 41, 5, dtype=torch.int32)
    values = ((exponents[:, None] + 127) << 23 | mantissas[None, :]).reshape(-1).view(torch.float32)
    g = torch.Generator().manual_seed(3)
    n = 128 * 24
    grad = values[torch.randint(len(values), (n,), generator=g)]
    grad = torch.where(torch.rand(n, generator=g) < 0.5, -grad, grad)
    layout = build_layout(None, n, 128)
    m_cfg, v_cfg = ref.DREConfig(fmt), ref.DREConfig(fmt, keep_nonzero=True)
    h = ref.AdamWScalars.make(1e-3, 0.0, 0.95, 1e-8, 0.1, 3)
    mq, mm = ref.quantize(grad * 0.5, layout, m_cfg)
    vq, vm = ref.quantize(grad * grad, layout, v_cfg)
    p = torch.randn(n, generator=g)
    a = [t.clone() for t in (p, mq, mm, vq, vm)]
    b = [t.clone() for t in (p, mq, mm, vq, vm)]
    ref.fused_adamw_step(a[0], grad, a[1], a[2], a[3], a[4], layout, h, m_cfg, v_cfg)
    cpu_step.fused_adamw_step(b[0], grad, b[1], b[2], b[3], b[4], layout, h, m_cfg, v_cfg)
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


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
                           str(free_port()), str(JOBS / "ds_offload_resume_job.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("offload resume bit-exact") == 2, proc.stdout
