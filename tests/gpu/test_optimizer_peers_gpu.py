"""The peers of the optimizer comparison (launch/optimizer_arms.py) on CUDA: the storage schemes of
launch/moment_schemes.py give what FlashOptim's and torchao's own quantizers store, the compiled BF16-moment step
gives the eager one's results, and every arm builds, steps a small Llama and reports the bytes its recipe holds.
FlashOptim and torchao tests skip where the package is not installed."""
import importlib.util

import pytest
import torch

from launch.bf16_moment_adamw import BF16MomentAdamW
from launch.moment_schemes import SCHEMES
from launch.optimizer_arms import ARMS, ArmContext, Hyper, optimizer_side_bytes

needs_flashoptim = pytest.mark.skipif(importlib.util.find_spec("flashoptim") is None, reason="flashoptim missing")
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao missing")


def moments(n=1_000_003, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scale = 10 ** (-5 * torch.rand(n, device="cuda", generator=gen))
    m = torch.randn(n, device="cuda", generator=gen) * scale
    return m, m.square() * (1 + torch.rand(n, device="cuda", generator=gen))


def assert_same_codes_off_rounding_ties(ours, theirs, q, decode):
    """ours equals theirs (to the last fp32 bit of the decoding division) except where q, the value rounded as
    floor(q + 0.5), lies within 1e-4 of a half-integer: FlashOptim's Triton kernel divides with the GPU's approximate
    fp32 division, ours with IEEE division, so there the last bit can round the other way. Those elements, at most
    1e-5 of them, hold the neighbouring code: decode(code) at code = ours' code +- 1."""
    close = lambda a, b: (a - b).abs() <= 1e-6 * b.abs()  # noqa: E731
    differ = ~close(ours, theirs)
    assert int(differ.sum()) <= 1e-5 * ours.numel()
    q, theirs = q[differ], theirs[differ]
    assert torch.all((q - torch.floor(q) - 0.5).abs() < 1e-4), q
    code = torch.floor(q + 0.5)
    assert torch.all(close(decode(code - 1, differ), theirs) | close(decode(code + 1, differ), theirs))


@needs_flashoptim
def test_flashoptim_scheme_is_flashoptims_quantizer():
    from flashoptim.optimizers import dequantize, quantize

    m, v = moments()
    m_codes, m_scales = quantize(m, signed=True, sqrt=False, softsign=True)
    v_codes, v_scales = quantize(v, signed=False, sqrt=True, softsign=False)
    m_theirs = dequantize(m_codes, m_scales, signed=True, sqrt=False, softsign=True)
    v_theirs = dequantize(v_codes, v_scales, signed=False, sqrt=True, softsign=False)
    m_ours, v_ours = SCHEMES["flashoptim"](m, v)
    # FlashOptim's formulas, written out on the whole groups of 32: each group over its absmax (kept in fp16);
    # m through softsign 2x / (1 + |x|) into int8 codes (x 127), v as sqrt(v) into uint8 codes (x 255)
    cut = m.numel() // 32 * 32
    groups = m[:cut].view(-1, 32)
    m_scale = groups.abs().amax(1, keepdim=True)
    n = groups / m_scale
    q_m = (2 * n / (1 + n.abs()) * 127).flatten()
    m_scale = m_scale.half().float().expand(-1, 32).flatten()
    assert_same_codes_off_rounding_ties(m_ours[:cut], m_theirs[:cut], q_m,
                                        lambda c, at: (c / 127) / (2 - (c / 127).abs()) * m_scale[at])
    roots = v[:cut].view(-1, 32).sqrt()
    v_scale = roots.amax(1, keepdim=True)
    q_v = (roots / v_scale * 255).flatten()
    v_scale = v_scale.half().float().expand(-1, 32).flatten()
    assert_same_codes_off_rounding_ties(v_ours[:cut], v_theirs[:cut], q_v, lambda c, at: (c / 255 * v_scale[at]) ** 2)
    # the last, short group
    torch.testing.assert_close(m_ours[cut:], m_theirs[cut:], rtol=1e-6, atol=0)
    torch.testing.assert_close(v_ours[cut:], v_theirs[cut:], rtol=1e-6, atol=0)


@needs_torchao
def test_torchao_scheme_is_torchaos_state():
    from torchao.optim.subclass_fp8 import OptimStateFp8

    m, v = moments(n=1 << 20)
    for x, ours in zip((m, v), SCHEMES["torchao_fp8"](m, v)):
        state = OptimStateFp8.zeros(x.shape, 256, device="cuda")
        state.copy_(x)
        assert torch.equal(state.dequantize(), ours)


def test_compiled_bf16_moment_step_matches_the_eager_one():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (4096, 1000, 77)]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    eager = BF16MomentAdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    compiled = BF16MomentAdamW(copies, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, compile_step=True)
    for step in range(5):
        for p, q in zip(params, copies):
            p.grad = torch.randn_like(p) * 1e-3
            q.grad = p.grad.clone()
        for opt in (eager, compiled):
            opt.param_groups[0]["lr"] = 1e-3 * (step + 1)
            opt.step()
    for p, q in zip(params, copies):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(compiled.state[q]["exp_avg"].float(), eager.state[p]["exp_avg"].float(),
                                   rtol=2 ** -7, atol=0)


EXPECTED_STATE = {"fp32": 8.0, "bf16_moments": 4.0, "coat": 2.1875, "coat_noexp": 2.1875, "torchao_fp8": 2.03125,
                  "flashoptim": 2.125,  # moments and their scales or metadata per parameter
                  # one momentum (the two 2-D layers are Muon matrices)
                  "lion_fp32": 4.0, "coat_lion": 1.09375, "muon_fp32": 4.0, "muon_bf16": 2.0, "coat_muon": 1.09375}


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_each_arm_builds_steps_and_counts_its_bytes(arm):
    reason = ARMS[arm].unavailable(torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(1024, 1024, bias=False))
    model.cuda()
    optimizer = ARMS[arm].build(model, ArmContext(torch.device("cuda"), Hyper(1e-3, (0.9, 0.95), 1e-8, 0.1), True))
    x = torch.randn(64, 1024, device="cuda")
    before = [p.detach().float().clone() for p in model.parameters()]
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert all(not torch.equal(b, p.detach().float()) for b, p in zip(before, model.parameters()))
    n = sum(p.numel() for p in model.parameters())
    counted = optimizer_side_bytes(model, optimizer, grads)
    assert counted["state"] / n == pytest.approx(EXPECTED_STATE[arm], abs=2e-3)
    master, gradient = (3.0, 2.0) if arm == "flashoptim" else (4.0, 4.0)  # bf16 weights + int8 error bits
    assert counted["master"] / n == master and counted["gradients"] / n == gradient
