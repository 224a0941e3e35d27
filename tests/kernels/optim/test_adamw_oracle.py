"""CoatFP8AdamW against oracles that share no code with the library: torch.optim.AdamW for the update, and the
method's formulas evaluated here in float64 for the stored moments and the Dynamic Range Expansion metadata.

The method (coat_kernels.optim.dre_reference): per group of 128, M = max|x|, m = min nonzero |x|, R = M/m,
k = floor(E log2(Q^2/2) / log2 R) / E clamped to [1/E, k_max] (k = 1 when log2 R <= 2^-19), centre c = sqrt(M m),
stored as (k, log2 c, log2(M/c)^k); code = fp8(sign(x) (|x|/c)^k / s) with s = (M/c)^k / Q, Q the format's maximum.

Each step is checked against torch.optim.AdamW run from the very state CoatFP8AdamW holds before that step (its codes
decoded here in float64): the parameter must agree to fp32 rounding plus the decoder's documented accuracy, so
bias correction, weight decay, lr and betas are checked to a few parts in 10^5 at every step; the moments CoatFP8AdamW
stores must lie within one rounding of the FP8 format of torch's fp32 moments, measured where the format rounds (the
expanded value (|x|/c)^k / s, using the stored metadata), with the bounds taken from torch.finfo of the format.
"""
import math

import pytest
import torch

from coat_kernels.optim import CoatFP8AdamW

N = 1000  # 7 groups of 128 and a ragged one of 104
GROUP = 128
EXPAND_MIN, K_MAX = 16, 16.0
# portable_math's documented accuracies: the decoder's exp2 (degree 4) and the encoder's coarse pair, whose codes land
# at most 0.2% of a value from where exact math puts them
DECODE_EXP2_REL = 4e-6
ENCODE_REL = 2e-3


def gradients(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        grad = torch.randn(N, generator=g) * torch.exp(torch.randn(N, generator=g) * 2) * 1e-3
        grad[::97] = 0.0  # some elements without gradient
        out.append(grad)
    return out


def groups_of(x: torch.Tensor):
    return [x[i:i + GROUP] for i in range(0, x.numel(), GROUP)]


def decode64(codes: torch.Tensor, meta: torch.Tensor):
    """float64 values of FP8 codes with per-group (k, log2 c, log2 sQ), and per element the relative accuracy the
    library's fp32 decoder has against them (exp2's accuracy plus a few fp32 roundings of the exponent)."""
    q = codes.float().double()  # torch's own FP8 -> float conversion
    log2_q_max = math.log2(torch.finfo(codes.dtype).max)
    values, accuracy = torch.zeros(N, dtype=torch.float64), torch.zeros(N, dtype=torch.float64)
    for g, sl in enumerate(range(0, N, GROUP)):
        k, log2_c, log2_sq = (float(v) for v in meta[:, g])
        part = q[sl:sl + GROUP]
        log2_abs = torch.log2(part.abs())
        exponent = (log2_abs + log2_sq - log2_q_max) / k + log2_c
        values[sl:sl + GROUP] = torch.where(part == 0, 0.0, torch.sign(part) * torch.exp2(exponent))
        size = log2_abs.abs().nan_to_num(posinf=0.0) / k + abs(log2_sq - log2_q_max) / k + abs(log2_c) + 1
        accuracy[sl:sl + GROUP] = DECODE_EXP2_REL + math.log(2) * 2.0 ** -22 * size
    return values, accuracy


def expanded(x: torch.Tensor, meta: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """|x| in the format's domain, (|x|/c)^k / s = 2^(k log2|x| - (log2 sQ - log2 Q + k log2 c)), in float64."""
    out = torch.zeros(N, dtype=torch.float64)
    for g, sl in enumerate(range(0, N, GROUP)):
        k, log2_c, log2_sq = (float(v) for v in meta[:, g])
        part = x[sl:sl + GROUP].double().abs()
        out[sl:sl + GROUP] = torch.exp2(k * torch.log2(part) - (log2_sq - math.log2(fmt_max) + k * log2_c))
    return out


def rounding_bound(y: torch.Tensor, dtype, keep_nonzero: bool) -> torch.Tensor:
    """How far a code may lie from the exact expanded value y: half the format's spacing at y (normal spacing
    y_binade * eps, subnormal spacing tiny * eps), widened by the encoder's 0.2%; a second moment whose code would
    round to zero keeps the smallest subnormal instead."""
    info = torch.finfo(dtype)
    reach = y * (1 + ENCODE_REL)
    binade = torch.exp2(torch.floor(torch.log2(reach.clamp(min=info.tiny))))
    bound = binade * info.eps / 2 + y * ENCODE_REL
    if keep_nonzero:
        bound = torch.maximum(bound, torch.where(y > 0, info.tiny * info.eps, 0.0))
    return bound


def check_stored_moment(codes, meta, exact: torch.Tensor, keep_nonzero: bool, what: str, spread=None):
    """Each stored code within one rounding (`rounding_bound`) of the exact value's expanded form; `spread`: how far
    the library's own fp32 moment may lie from `exact` (it updated the moment decoded by its fp32 decoder)."""
    fmt_max = torch.finfo(codes.dtype).max
    magnitude = exact.double().abs()
    spread = torch.zeros_like(magnitude) if spread is None else spread
    low = expanded(torch.clamp(magnitude - spread, min=0.0), meta, fmt_max).clamp(max=fmt_max)
    high = expanded(magnitude + spread, meta, fmt_max).clamp(max=fmt_max)
    stored = codes.float().double()
    signed = (magnitude > spread) & (stored != 0)
    assert torch.equal(torch.sign(stored[signed]), torch.sign(exact.double()[signed])), f"{what}: signs"
    below = low - rounding_bound(low, codes.dtype, keep_nonzero) - stored.abs()
    above = stored.abs() - high - rounding_bound(high, codes.dtype, keep_nonzero)
    worst = int(torch.argmax(torch.maximum(below, above)))
    assert (below <= 0).all() and (above <= 0).all(), (
        f"{what}: element {worst} stored {float(stored[worst])}, exact {float(low[worst])}..{float(high[worst])}")


def expected_meta(x: torch.Tensor, fmt_max: float):
    """The method's (k, log2 c, log2 sQ) of every group of x, in float64, and where k's floor sits so close to an
    integer that the library's fp32 logarithms (error < 3e-5) may take the neighbouring multiple of 1/E."""
    rows, ambiguous = [], []
    numerator = EXPAND_MIN * math.log2(fmt_max ** 2 / 2)
    for part in groups_of(x.double().abs()):
        nonzero = part[part >= 2.0 ** -126]
        if nonzero.numel() == 0:
            rows.append((1.0, 0.0, 0.0))
            ambiguous.append(False)
            continue
        big, small = float(nonzero.max()), float(nonzero.min())
        log2_ratio = math.log2(big / small)
        if log2_ratio <= 2.0 ** -19:
            k, near = 1.0, False
        else:
            quotient = numerator / log2_ratio
            k = min(max(math.floor(quotient) / EXPAND_MIN, 1 / EXPAND_MIN), K_MAX)
            near = abs(quotient - round(quotient)) < 1e-3 * quotient
        centre = math.sqrt(big * small)
        rows.append((k, math.log2(centre), k * math.log2(big / centre)))
        ambiguous.append(near)
    return torch.tensor(rows, dtype=torch.float64).T, torch.tensor(ambiguous)


def check_meta(meta: torch.Tensor, x: torch.Tensor, fmt_max: float, what: str):
    expected, ambiguous = expected_meta(x, fmt_max)
    meta = meta.double()
    k_ok = (meta[0] == expected[0]) | (ambiguous & ((meta[0] - expected[0]).abs() <= 1 / EXPAND_MIN))
    assert k_ok.all(), f"{what}: k {meta[0].tolist()} != {expected[0].tolist()}"
    assert torch.allclose(meta[1], expected[1], rtol=0, atol=1e-4), f"{what}: log2 centre"
    # log2 sQ = k log2(M / c) with the stored k: the logarithms' error times k
    log2_sq = meta[0] * (expected[2] / expected[0])
    assert torch.allclose(meta[2], log2_sq, rtol=0, atol=1e-4 * K_MAX), f"{what}: log2 scale"


def coat_moments(opt, p):
    st = opt.state[p]
    return st["exp_avg_q"], st["exp_avg_meta"], st["exp_avg_sq_q"], st["exp_avg_sq_meta"]


# ---- the steps --------------------------------------------------------------------------------------------------
HYPER = [
    dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0),
    dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1),
    dict(lr=3e-2, betas=(0.8, 0.95), weight_decay=0.1),
    dict(lr=1e-4, betas=(0.95, 0.9999), weight_decay=0.01),
]


@pytest.mark.parametrize("steps", [1, 20])
@pytest.mark.parametrize("hyper", HYPER, ids=lambda h: f"lr{h['lr']}-b{h['betas']}-wd{h['weight_decay']}")
def test_each_step_is_torch_adamw_from_the_state_held(hyper, steps):
    eps = 1e-8
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(N) * 0.1)
    opt = CoatFP8AdamW([p], eps=eps, backend="torch", **hyper)
    for t, grad in enumerate(gradients(steps), start=1):
        if t == 1:
            m = v = torch.zeros(N, dtype=torch.float64)
            m_acc = v_acc = torch.zeros(N, dtype=torch.float64)
        else:
            m_codes, m_meta, v_codes, v_meta = coat_moments(opt, p)
            (m, m_acc), (v, v_acc) = decode64(m_codes, m_meta), decode64(v_codes, v_meta)
        q = torch.nn.Parameter(p.detach().clone())
        torch_adamw = torch.optim.AdamW([q], eps=eps, foreach=False, **hyper)
        torch_adamw.state[q] = {"step": torch.tensor(float(t - 1)), "exp_avg": m.float(), "exp_avg_sq": v.float()}
        q.grad, p.grad = grad.clone(), grad.clone()
        before = p.detach().clone()
        torch_adamw.step()
        opt.step()
        assert float(opt.state[p]["step"]) == t
        # the parameter: fp32 rounding (a few ulps of p and of the update) plus what the decoder's accuracy moves
        # the update step_size * m / (sqrt(v) / sqrt(1 - beta2^t) + eps): the new moments m = beta1 m' + (1 - beta1) g
        # carry beta1 |m'| times the accuracy of the decoded m' (relative to m', not to m, which may cancel)
        beta1, beta2 = hyper["betas"]
        exact = {k: value.double() for k, value in torch_adamw.state[q].items() if k != "step"}
        m_new, v_new = exact["exp_avg"], exact["exp_avg_sq"]
        m_spread = beta1 * m.abs() * m_acc + 2.0 ** -22 * m_new.abs()
        v_spread = beta2 * v * v_acc + 2.0 ** -22 * v_new
        denom = v_new.sqrt() / math.sqrt(1 - beta2 ** t) + eps
        step_size = hyper["lr"] / (1 - beta1 ** t)
        update = step_size * m_new.abs() / denom
        v_share = torch.where(v_new > 0, v_spread / (2 * v_new.clamp(min=1e-300)), 0.0)
        ulp = torch.finfo(torch.float32).eps * torch.maximum(q.detach().abs(), before.abs()).double()
        bound = 3 * ulp + step_size * m_spread / denom + update * (v_share + 2.0 ** -20)
        error = (p.detach().double() - q.detach().double()).abs()
        worst = int(torch.argmax(error / bound))
        assert (error <= bound).all(), (f"step {t}: element {worst}: CoatFP8AdamW {float(p.detach()[worst])}, "
                                        f"torch AdamW {float(q.detach()[worst])}, bound {float(bound[worst])}")
        # the stored moments: torch's fp32 moments after this step, rounded by the FP8 format
        m_codes, m_meta, v_codes, v_meta = coat_moments(opt, p)
        check_stored_moment(m_codes, m_meta, m_new, False, f"step {t} exp_avg", m_spread)
        check_stored_moment(v_codes, v_meta, v_new, True, f"step {t} exp_avg_sq", v_spread)


# ---- the metadata of a quantization, exactly -------------------------------------------------------------------
@pytest.mark.parametrize("exp_avg_sq_format", ["e4m3", "e5m2"])
def test_expansion_metadata_follows_the_formulas(exp_avg_sq_format):
    """Moments set directly (no step between): each group's stored (k, log2 c, log2 sQ) against the formulas, groups
    of every kind: narrow ranges (k > 1, capped at k_max), wide ones (k < 1 compresses), constant magnitude (k = 1),
    a single nonzero element, all zeros."""
    g = torch.Generator().manual_seed(1)
    m = torch.randn(N, generator=g) * 1e-3
    m[0:128] = torch.sign(m[0:128]) * 1e-3 * torch.exp(torch.randn(128, generator=g) * 0.01)  # narrow: k at the cap
    m[128:256] = torch.randn(128, generator=g) * torch.exp(torch.randn(128, generator=g) * 6)  # wide: k < 1
    m[256:384] = -0.5  # constant magnitude
    m[384:512] = 0.0
    m[400] = 3e-7  # one nonzero element
    m[512:640] = 0.0  # all zero
    v = m * m + 1e-12
    p = torch.nn.Parameter(torch.zeros(N))
    opt = CoatFP8AdamW([p], backend="torch", exp_avg_sq_format=exp_avg_sq_format)
    opt.set_fp32_moments(p, m, v)
    m_codes, m_meta, v_codes, v_meta = coat_moments(opt, p)
    expected_k = expected_meta(m, 448.0)[0][0]
    assert expected_k[0] == K_MAX and expected_k[1] < 1 and expected_k[2] == 1 and expected_k[4] == 1
    check_meta(m_meta, m, torch.finfo(m_codes.dtype).max, "exp_avg")
    check_meta(v_meta, v, torch.finfo(v_codes.dtype).max, "exp_avg_sq")
    check_stored_moment(m_codes, m_meta, m, False, "exp_avg")
    check_stored_moment(v_codes, v_meta, v, True, "exp_avg_sq")
