"""The BF16-moment AdamW of the optimizer comparison against AdamW's formulas written here, and the moment storage
schemes of launch/moment_schemes.py against what each format can and cannot hold."""
import importlib.util

import pytest
import torch

from launch.bf16_moment_adamw import BF16MomentAdamW
from launch.moment_schemes import SCHEMES, relative_errors, update_direction

BETAS, EPS, LR, WD = (0.9, 0.95), 1e-8, 1e-2, 0.1


def test_bf16_moment_adamw_follows_adamw_with_moments_rounded_to_bf16():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300))
    opt = BF16MomentAdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    ref_p, m, v = p.detach().clone().double(), torch.zeros(300, dtype=torch.bfloat16), torch.zeros(300,
                                                                                                    dtype=torch.bfloat16)
    for t in range(1, 8):
        g = torch.randn(300) * 10 ** (-t % 4)
        p.grad = g.clone()
        opt.step()
        m64 = BETAS[0] * m.double() + (1 - BETAS[0]) * g.double()
        v64 = BETAS[1] * v.double() + (1 - BETAS[1]) * g.double() ** 2
        ref_p = ref_p * (1 - LR * WD) - LR * (m64 / (1 - BETAS[0] ** t)) / ((v64 / (1 - BETAS[1] ** t)).sqrt() + EPS)
        m, v = m64.to(torch.bfloat16), v64.to(torch.bfloat16)
        state = opt.state[p]
        assert state["exp_avg"].dtype == torch.bfloat16 and int(state["step"]) == t
        # fp32 arithmetic against float64: the stored moments agree to the last bf16 bit but for ties
        assert (state["exp_avg"].float() - m.float()).abs().le(m.float().abs() * 2 ** -7).all()
        assert (state["exp_avg_sq"].float() - v.float()).abs().le(v.float().abs() * 2 ** -7).all()
        torch.testing.assert_close(p.detach().double(), ref_p, rtol=1e-5, atol=1e-6)


def test_bf16_moment_adamw_refuses_what_it_does_not_step():
    with pytest.raises(ValueError, match="betas"):
        BF16MomentAdamW([torch.nn.Parameter(torch.zeros(2))], betas=(0.9, 1.0))
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    with pytest.raises(TypeError, match="fp32 master weights"):
        BF16MomentAdamW([p]).step()


def test_bf16_scheme_is_the_bf16_cast():
    x = torch.randn(1000)
    m_hat, v_hat = SCHEMES["bf16"](x, x.abs())
    assert torch.equal(m_hat, x.to(torch.bfloat16).float()) and torch.equal(v_hat, x.abs().to(torch.bfloat16).float())


def test_torchao_scheme_blocks_of_256_in_e4m3_small_tensors_kept():
    torch.manual_seed(1)
    small = torch.randn(4095)
    m_hat, v_hat = SCHEMES["torchao_fp8"](small, small.abs())
    assert torch.equal(m_hat, small) and torch.equal(v_hat, small.abs())
    x = torch.randn(4096) * torch.logspace(0, -3, 4096)
    m_hat, _ = SCHEMES["torchao_fp8"](x, x.abs())
    block_max = x.view(-1, 256).abs().amax(1, keepdim=True)
    normal = x.view(-1, 256).abs() >= block_max * 2 ** -6 / 448 * 2 ** 3  # inside E4M3's normal range
    # E4M3 keeps 3 mantissa bits: rounding to nearest is within 2^-4 of the value
    relative = ((m_hat.view(-1, 256) - x.view(-1, 256)).abs() / x.view(-1, 256).abs())[normal]
    assert relative.max() <= 2 ** -4 + 1e-6 and relative.max() > 2 ** -6
    tiny = x.view(-1, 256).abs() < block_max / 448 * 2 ** -10  # below half the smallest subnormal: flushed to zero
    assert (m_hat.view(-1, 256)[tiny] == 0).all()


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
def test_torchao_scheme_matches_torchaos_optimizer_state():
    from torchao.optim.subclass_fp8 import OptimStateFp8

    torch.manual_seed(2)
    x = torch.randn(8192) * torch.logspace(0, -4, 8192)
    state = OptimStateFp8.zeros(x.shape, 256)
    state.copy_(x)
    assert torch.equal(state.dequantize(), SCHEMES["torchao_fp8"](x, x.abs())[0])


def test_flashoptim_scheme_groups_of_32_softsign_int8_and_sqrt_uint8():
    group = torch.zeros(32)
    group[0], group[1], group[2] = 3.0, -1.5, 0.75
    m = torch.cat([group, group * 1e-3, torch.tensor([2.0, -1.0])])  # the last group is short
    m_hat, v_hat = SCHEMES["flashoptim"](m, m.square())
    assert m_hat.shape == m.shape
    half = torch.tensor(3.0).half().float()
    assert m_hat[0] == half and m_hat[32] == torch.tensor(3e-3).half().float()  # absmax: the fp16 scale
    assert m_hat[3:32].eq(0).all() and v_hat[3:32].eq(0).all()
    # -1.5 / 3 = -0.5 -> softsign -2/3 -> code round(-84.67) = -85 -> y = -85/127 -> y / (2 - |y|) * 3
    y = -85 / 127
    assert m_hat[1].item() == pytest.approx(y / (2 - abs(y)) * 3, rel=1e-6)
    # sqrt(v) = 1.5 of 3 -> code round(127.5) = 128 -> (128 / 255 * 3)^2
    assert v_hat[1].item() == pytest.approx((128 / 255 * 3) ** 2, rel=1e-6)
    assert m_hat[-2:].tolist() == [2.0, pytest.approx(-1.0, rel=1e-2)]


def test_relative_errors_count_a_flushed_second_moment():
    """One block where v spans more than E4M3 holds: torchao's absmax scaling flushes the small v to zero (the
    update becomes m / eps), CoatFP8AdamW keeps every nonzero v nonzero, bf16 holds the range."""
    v = torch.full((4096,), 1e-14)
    v[::256] = 1.0
    m = torch.full((4096,), 1e-3)
    errors = relative_errors([(m, v)], step=100, betas=BETAS, eps=EPS)
    assert errors["share_far"]["torchao_fp8"] > 0.99 and errors["relative_l2"]["torchao_fp8"] > 5
    for name in ("coat", "bf16"):
        assert errors["relative_l2"][name] < 0.05, name
    exact = update_direction(m, v, 100, BETAS, EPS)
    assert torch.isfinite(exact).all()
    same = relative_errors([(m.bfloat16().float(), v.bfloat16().float())], step=100, betas=BETAS, eps=EPS,
                           schemes=("bf16",))
    assert same == {"relative_l2": {"bf16": 0.0}, "share_far": {"bf16": 0.0}}


def test_expansion_beats_plain_scaling_on_a_wide_group():
    torch.manual_seed(3)
    m = torch.randn(1024) * 10 ** (-4 * torch.rand(1024))
    v = m.square() * (1 + 0.1 * torch.rand(1024))
    errors = relative_errors([(m, v)], step=1000, betas=BETAS, eps=EPS, schemes=("coat", "coat_noexp"))
    assert errors["relative_l2"]["coat"] < errors["relative_l2"]["coat_noexp"]
