"""Quantization error of COAT's moment quantizer (CPU, torch reference). Usage:
python benchmarks/moment_quantization_error.py

1. MSE of m/sqrt(v) on AdamW moments of a small MLP: plain per-group E4M3 against Dynamic Range Expansion, for
   several caps on k.
2. Groups whose magnitudes span 3, 4 or 5 decades (log-uniform |g|, m = g, v = g^2 (1 + noise)): relative MSE of
   m/(sqrt(v) + eps) for this quantizer (k may fall to 1/16, compressing groups wider than the format), the same
   with k held at 1 or above, and the method in exact float64 arithmetic (what NVlabs/COAT's kernel computes in
   fp32, without its portable log2/exp2).
3. The same moments (1. and the groups of 2.) in every storage the optimizer comparison runs (launch/moment_schemes:
   COAT with and without expansion, torchao's FP8, FlashOptim's 8-bit, bf16): relative L2 error of the update
   direction and the share of elements it moves by more than 10%. On a real run's moments, over training:
   `python -m launch.optimizer_parity --arm fp32 --moment-error-every N` (the same schemes).
"""
import math
import os
import sys

import torch

from coat_kernels.optim import dre_reference as ref
from coat_kernels.optim.grouping import build_layout

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root: `launch`
from launch.moment_schemes import SCHEMES, relative_errors  # noqa: E402

G = 128


def adam_moments(steps=30, seed=3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(512, 64), torch.randn(512, 64)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    states = [opt.state[p] for p in model.parameters()]
    return (torch.cat([s["exp_avg"].flatten() for s in states]), torch.cat([s["exp_avg_sq"].flatten() for s in states]))


def wide_range_moments(decades: float, groups: int = 512, seed: int = 0):
    """m, v of `groups` groups whose |m| is log-uniform over `decades` decades (v over twice as many)."""
    gen = torch.Generator().manual_seed(seed)
    g = 1e-2 * 10 ** (-decades * torch.rand(groups * G, generator=gen))
    g = g * torch.where(torch.rand(groups * G, generator=gen) < 0.5, -1.0, 1.0)
    v = g * g * (1 + 0.1 * torch.rand(groups * G, generator=gen))
    return g, v


def roundtrip(x, cfg):
    layout = build_layout(None, x.numel(), G)
    return ref.dequantize(*ref.quantize(x, layout, cfg), layout)


def padded(x):
    """x flat, zero-padded to whole groups (zeros change no group's metadata)."""
    return torch.nn.functional.pad(x, (0, -x.numel() % G))


def roundtrip_k_at_least_1(x, cfg):
    """This quantizer with k held at >= 1 (groups wider than the format flush their small end)."""
    n, x = x.numel(), padded(x)
    layout = build_layout(None, x.numel(), G)
    codes, meta = ref.quantize(x, layout, cfg)
    compressed = meta[0] < 1
    if compressed.any():
        k = meta[0]
        half_range = meta[2] / k  # log2(M / c)
        meta = torch.stack([torch.where(compressed, 1.0, k), meta[1], torch.where(compressed, half_range, meta[2])])
        codes = ref.encode(x.view(-1, G), meta, cfg).reshape(-1)
    return ref.dequantize(codes, meta, layout)[:n]


def roundtrip_exact_math(x, cfg):
    """The method in float64 (exact powers and logs); FP8 rounding as the formats do it."""
    n, x64 = x.numel(), padded(x).double().view(-1, G)
    ax = x64.abs()
    big = ax.amax(dim=1)
    small = torch.where(ax > 0, ax, torch.inf).amin(dim=1)
    log2_ratio = torch.log2(big / small)
    numerator = cfg.expand_min * math.log2(cfg.fmt.max ** 2 / 2)
    k = (torch.floor(numerator / log2_ratio) / cfg.expand_min).clamp(1 / cfg.expand_min, cfg.k_max)
    k = torch.where(log2_ratio <= 2 ** -19, 1.0, k)[:, None]
    center = (big.sqrt() * small.sqrt())[:, None]
    scale = (big[:, None] / center) ** k / cfg.fmt.max
    y = x64.sign() * (ax / center) ** k / scale
    q = cfg.fmt.quantize(y.float()).double()
    return (q.sign() * (q.abs() * scale) ** (1 / k) * center).float().reshape(-1)[:n]


def ratio_error(quantize, m, v, m_cfg, v_cfg, eps=1e-8):
    exact = m / (v.sqrt() + eps)
    approx = quantize(m, m_cfg) / (quantize(v, v_cfg).sqrt() + eps)
    return (((approx - exact) ** 2).mean() / (exact ** 2).mean()).item()


def main():
    m, v = adam_moments()
    exact = m / (v.sqrt() + 1e-8)
    print(f"{'first/second moment':<34} {'MSE of m/sqrt(v)':>18}")
    rows = [("E4M3 / E4M3, no expansion", dict(expand=False), dict(expand=False)),
            ("E4M3 / E5M2, no expansion", dict(expand=False), dict(fmt="e5m2", expand=False))]
    rows += [(f"E4M3+DRE / E4M3+DRE, k_max={k}", dict(k_max=k), dict(k_max=k)) for k in (4, 8, 12, 16, 32)]
    for name, mc, vc in rows:
        dm = roundtrip(m, ref.DREConfig(mc.pop("fmt", "e4m3"), **mc))
        dv = roundtrip(v, ref.DREConfig(vc.pop("fmt", "e4m3"), keep_nonzero=True, **vc))
        print(f"{name:<34} {((dm / (dv.sqrt() + 1e-8) - exact) ** 2).mean().item():18.5f}")
    m_cfg, v_cfg = ref.DREConfig("e4m3"), ref.DREConfig("e4m3", keep_nonzero=True)
    for name, f in (("  the same, k held at >= 1", roundtrip_k_at_least_1),
                    ("  the same, exact math", roundtrip_exact_math)):
        dm, dv = f(m, m_cfg), f(v, v_cfg)
        print(f"{name:<34} {((dm / (dv.sqrt() + 1e-8) - exact) ** 2).mean().item():18.5f}")

    print(f"\n{'decades of |m|':<16} {'k >= 1/16':>10} {'k >= 1':>10} {'exact math':>11}   "
          "relative MSE of m/(sqrt(v)+eps)")
    for decades in (1, 2, 3, 4, 5):
        m, v = wide_range_moments(decades)
        errors = [ratio_error(f, m, v, m_cfg, v_cfg) for f in (roundtrip, roundtrip_k_at_least_1, roundtrip_exact_math)]
        print(f"{decades:<16} " + " ".join(f"{e:10.5f}" for e in errors))

    print(f"\n{'moments':<22} " + " ".join(f"{s:>20}" for s in SCHEMES)
          + "   relative L2 error of the update direction / share of elements off by > 10%")
    cases = [("AdamW on the MLP", adam_moments())] + [(f"{d} decades of |m|", wide_range_moments(d)) for d in (2, 4)]
    for name, (m, v) in cases:
        whole = m.numel() - m.numel() % 256  # whole torchao blocks (it keeps other tensors in fp32)
        m, v = m[:whole], v[:whole]
        errors = relative_errors([(m, v)], step=30, betas=(0.9, 0.999), eps=1e-8)
        print(f"{name:<22} " + " ".join(f"{errors['relative_l2'][s]:>11.4g} / {errors['share_far'][s]:6.2%}"
                                        for s in SCHEMES))


if __name__ == "__main__":
    main()
