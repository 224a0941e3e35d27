"""The exact export (coat_kernels.optim.exact_export) on groups shaped like real AdamW moments: each group's fp32
values quantize back to its codes and metadata. The oracle is the reference quantizer itself: quantize the exported
values again and compare bits. A randomized search over such groups (about 1 in 5,000 missed before) found the cases
kept here: a group whose smallest (or largest) magnitude lies 20-60 fp32 steps from its estimate."""
import pytest
import torch

from coat_kernels.optim import dre_reference as ref
from coat_kernels.optim.exact_export import export, quantized_equal
from coat_kernels.optim.grouping import build_layout

G = 128


def adamw_moments(seed, groups):
    """(exp_avg, exp_avg_sq) after 1-5 AdamW steps (betas 0.9, 0.95) of gradients with a scale per group between 1e-7
    and 10, heavy tails, and 30% of the groups sparse (90% zero gradients, as rare embedding rows)."""
    gen = torch.Generator().manual_seed(seed)
    steps = int(torch.randint(1, 6, (1,), generator=gen))
    scale = 10 ** (torch.rand(groups, 1, generator=gen) * 8 - 7)
    m, v = torch.zeros(groups, G), torch.zeros(groups, G)
    sparse = torch.rand(groups, 1, generator=gen) < 0.3
    for _ in range(steps):
        g = torch.randn(groups, G, generator=gen) * scale
        g = g * torch.exp(torch.randn(groups, G, generator=gen) * float(torch.rand(1, generator=gen) * 3))
        g = torch.where(sparse & (torch.rand(groups, G, generator=gen) < 0.9), 0.0, g)
        m = 0.9 * m + 0.1 * g
        v = 0.95 * v + 0.05 * g * g
    return m.reshape(-1), v.reshape(-1)


def assert_exports_exactly(x, cfg):
    layout = build_layout(None, x.numel(), G)
    codes, meta = ref.quantize(x, layout, cfg)
    values, failed = export(codes, meta, layout, cfg)
    assert failed == 0
    assert quantized_equal(*ref.quantize(values, layout, cfg), codes, meta)


# (seed, moment, group): groups of adamw_moments(seed, 512) that an export searching only a few fp32 neighbours of
# the estimated extremes left inexact
MISSED_BEFORE = [(14, "exp_avg_sq", 103), (19, "exp_avg", 474), (29, "exp_avg_sq", 251), (33, "exp_avg_sq", 362)]


@pytest.mark.parametrize("seed, moment, group", MISSED_BEFORE)
def test_adamw_moment_groups_export_exactly(seed, moment, group):
    """The group and the 31 around it."""
    m, v = adamw_moments(seed, 512)
    first = min(group - group % 32, 512 - 32)
    window = slice(first * G, (first + 32) * G)
    if moment == "exp_avg":
        assert_exports_exactly(m[window], ref.DREConfig("e4m3"))
    else:
        assert_exports_exactly(v[window], ref.DREConfig("e4m3", keep_nonzero=True))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_groups_at_the_smallest_expansion_export_exactly(fmt):
    """Two magnitudes 2^90 to 2^200 apart per group (k near its floor 1/16, where log2(sQ) / k loses the most):
    the estimates lie hundreds of fp32 steps from the true extremes."""
    gen = torch.Generator().manual_seed(0)
    groups = 64
    top = torch.rand(groups, generator=gen) * 100 - 20
    bottom = top - 90 - torch.rand(groups, generator=gen) * 110
    x = torch.zeros(groups, G)
    x[:, 0], x[:, 1] = torch.exp2(top), torch.exp2(bottom.clamp(min=-125))
    x[:, 2:] = torch.exp2(bottom[:, None] + torch.rand(groups, G - 2, generator=gen) * (top - bottom)[:, None])
    assert_exports_exactly(x.reshape(-1), ref.DREConfig(fmt, keep_nonzero=True))
