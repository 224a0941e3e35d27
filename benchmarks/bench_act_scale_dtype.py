"""Which dtype should hold the 1x16 group scales? Quantization error of E4M3 / E5M2 1x16 groups with the scale
(computed in fp32 as amax / FP8_MAX) stored as fp32, as bf16 rounded to nearest (the largest element of a group then
saturates to FP8_MAX when the scale was rounded down; what the kernels do), as bf16 rounded up (nothing saturates) or
as a power-of-two exponent byte (E8M0, rounded up), on several activation-like distributions. CPU, seconds.

    python benchmarks/bench_act_scale_dtype.py
"""
import torch

from coat_kernels.formats import E4M3, E5M2

torch.manual_seed(0)
N = 1 << 20


def quantize(x, fmt, scale_kind):
    g = x.reshape(-1, 16)
    amax = g.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))
    if scale_kind == "bf16 nearest":
        s = s.bfloat16().float()
    elif scale_kind == "bf16 up":
        sb = s.bfloat16()
        s = torch.where(sb.float() < s, torch.nextafter(sb, torch.full_like(sb, float("inf"))), sb).float()
    elif scale_kind == "e8m0":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    return (fmt.quantize(g / s).float() * s).reshape(x.shape)


def distributions():
    gauss = torch.randn(N)
    g, u = torch.randn(N), torch.randn(N)
    yield "gaussian", gauss
    yield "student-t(3)", torch.distributions.StudentT(3.0).sample((N,))
    yield "swiglu product", g * torch.sigmoid(g) * u
    yield "channel outliers x100", gauss * torch.where(torch.arange(N) % 512 < 4, 100.0, 1.0)
    yield "one x100 outlier / group", gauss * torch.where(torch.arange(N) % 16 == 5, 100.0, 1.0)
    yield "log-uniform 1e-4..1e4", torch.exp(torch.empty(N).uniform_(-9.2, 9.2)) * torch.randn(N).sign()


def main():
    kinds = {"fp32": 4, "bf16 nearest": 2, "bf16 up": 2, "e8m0": 1}
    print("relative L2 error by scale storage; bytes/element")
    columns = "  ".join(f"{k} ({1 + b / 16:.4f} B)".rjust(24) for k, b in kinds.items())
    print(f"{'distribution':24s} {'fmt':5s} " + columns)
    for name, x in distributions():
        for fmt in (E4M3, E5M2):
            cells = []
            for kind in kinds:
                d = quantize(x, fmt, kind)
                l2 = ((d - x).norm() / x.norm()).item()
                cells.append(f"{l2:.5f}".rjust(24))
            print(f"{name:24s} {fmt.name:5s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
