"""Quantization error of m/sqrt(v) on AdamW moments of a small MLP (CPU, torch reference): plain per-group E4M3
against Dynamic Range Expansion, for several caps on k. Usage: python benchmarks/moment_quantization_error.py"""
import torch

from coat_kernels.optim import dre_reference as ref
from coat_kernels.optim.grouping import build_layout


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


def roundtrip(x, cfg):
    layout = build_layout(None, x.numel(), 128)
    return ref.dequantize(*ref.quantize(x, layout, cfg), layout)


def main():
    m, v = adam_moments()
    exact = m / (v.sqrt() + 1e-8)
    print(f"{'first/second moment':<34} {'MSE of m/sqrt(v)':>18}")
    rows = [("E4M3 / E4M3, no expansion", dict(expand=False), dict(expand=False)),
            ("E4M3 / E5M2, no expansion", dict(expand=False), dict(fmt="e5m2", expand=False))]
    rows += [(f"E4M3+DRE / E4M3+DRE, k_max={k}", dict(k_max=k), dict(k_max=k)) for k in (4, 8, 12, 16, 32)]
    for name, mc, vc in rows:
        dm = roundtrip(m, ref.DREConfig(mc.pop("fmt", "e4m3"), **mc))
        dv = roundtrip(v, ref.DREConfig(vc.pop("fmt", "e4m3"), **vc))
        print(f"{name:<34} {((dm / (dv.sqrt() + 1e-8) - exact) ** 2).mean().item():18.4f}")


if __name__ == "__main__":
    main()
