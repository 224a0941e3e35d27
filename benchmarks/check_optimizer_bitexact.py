"""GPU check: the Triton kernels give bit-identical results to the PyTorch reference run on the same GPU
(quantize, dequantize, fused AdamW step over ragged segments and over full aligned rows (the vectorized path), group
sizes 128 and 32; both formats; expansion on and off). The fused step runs the kernel the optimizer launches
(Gluon on CUDA when available).
Exits non-zero on any mismatch.  Usage: python benchmarks/check_optimizer_bitexact.py
"""
import sys

import torch

from coat_kernels import dre_reference as ref
from coat_kernels import dre_triton as tri
from coat_kernels.grouping import build_layout


def same(a, b):
    """Bitwise equality, except that +0 and -0 FP8 codes count as equal."""
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.float(), b.float()
    eq = (a == b) | (a.isnan() & b.isnan())
    return int((~eq).sum())


def moments(n, device):
    g = torch.randn(n, device=device) * torch.exp(torch.randn(n, device=device) * 2) * 1e-3
    g[::97] = 0
    return g, g * g * torch.rand(n, device=device) * 10


def check_adamw(name, layout, grad_dtype, n, dev):
    m_cfg, v_cfg = ref.DREConfig("e4m3"), ref.DREConfig("e4m3")
    p0 = torch.randn(n, device=dev) * 0.02
    m, v = moments(n, dev)
    mq, mm = ref.quantize(m, layout, m_cfg)
    vq, vm = ref.quantize(v, layout, v_cfg)
    g = (torch.randn(n, device=dev) * 1e-3).to(grad_dtype)
    g[12345] = float("nan")
    g[500_000] = float("inf")
    h = ref.AdamWScalars.make(1e-3, 0.9, 0.95, 1e-8, 0.1, 7)
    a = [p0.clone(), mq.clone(), mm.clone(), vq.clone(), vm.clone()]
    b = [p0.clone(), mq.clone(), mm.clone(), vq.clone(), vm.clone()]
    skipped_ref = ref.fused_adamw_step(a[0], g, a[1], a[2], a[3], a[4], layout, h, m_cfg, v_cfg)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    launch = tri.FusedAdamW([layout], torch.device(dev))
    launch([b[0]], [g], [b[1]], [b[2]], [b[3]], [b[4]], [h], m_cfg, v_cfg, counter)
    bad = [same(x, y) for x, y in zip(a, b)]
    print(f"fused AdamW, {name}, grads {grad_dtype}: param/m/m_meta/v/v_meta mismatches {bad}, skipped groups "
          f"{int(skipped_ref)} vs {int(counter)}")
    return sum(bad) + int(int(skipped_ref) != int(counter))


def main():
    torch.manual_seed(0)
    dev = "cuda"
    n = 1 << 20
    segments = [(0, 300_001, 0), (300_001, 5, 7), (300_010, 700_000, 1_000_003), (1_000_010, 48_000, 64)]
    layout = build_layout(segments, n, 128)
    failures = 0
    for fmt in ("e4m3", "e5m2"):
        for expand in (True, False):
            cfg = ref.DREConfig(fmt, expand=expand)
            for x in moments(n, dev):
                c1, m1 = ref.quantize(x, layout, cfg)
                c2, m2 = tri.quantize(x, layout, cfg)
                d1, d2 = ref.dequantize(c1, m1, layout), tri.dequantize(c1, m1, layout)
                bad = (same(c1, c2), same(m1, m2), same(d1, d2))
                failures += sum(bad)
                print(f"quantize {fmt} expand={expand}: code/meta/dequant mismatches {bad}")
    whole = build_layout([(0, n, 0)], n, 128)  # full, aligned rows: the vectorized path
    for name, lay in (("ragged segments", layout), ("whole buffer", whole),
                      ("whole buffer, group 32", build_layout([(0, n, 0)], n, 32))):
        for grad_dtype in (torch.float32, torch.bfloat16):
            failures += check_adamw(name, lay, grad_dtype, n, dev)
    print("BIT-EXACT" if failures == 0 else f"MISMATCHES: {failures}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
