"""bf16 GEMMs on a CPU without bf16 instructions, at fp32 GEMM speed.

Under bf16 autocast every linear layer multiplies bf16 operands. A GEMM of bf16 operands, as GPUs and torch's own
CPU kernels define it, multiplies the operands exactly, sums in fp32 and rounds the result once to bf16. On CPUs
without bf16 instructions (AVX2, AVX-512 without AVX512-BF16 or AMX) torch's CPU bf16 GEMMs run 10-35x slower than
fp32 GEMMs of the same shape. `Bf16GemmsInFp32` computes the same thing through the fast path: inside it, each
matrix product whose operands are all bf16 CPU tensors (`mm`, `addmm`, `bmm`, the ops linear layers and their
backward reach) widens its operands to fp32 (exact), runs one fp32 GEMM and rounds the result once to bf16. The
products and the fp32 sums are those of torch's bf16 kernel; only the order of the sums may differ, so an output
element can differ by one bf16 rounding step (one in several thousand, measured on the main job's shapes). Every
other op, and every GEMM with an operand of another dtype or device, runs as it would without the mode.

    with Bf16GemmsInFp32():
        loss = model(...).loss   # forward under bf16 autocast
        loss.backward()          # the backward's GEMMs too
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _all_bf16_on_cpu(tensors) -> bool:
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a.float(), b.float()).to(torch.bfloat16)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a.float(), b.float()).to(torch.bfloat16)


def addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    return torch.addmm(c.float(), a.float(), b.float(), beta=beta, alpha=alpha).to(torch.bfloat16)


ROUTES = {aten.mm.default: (mm, 2), aten.bmm.default: (bmm, 2), aten.addmm.default: (addmm, 3)}


class Bf16GemmsInFp32(TorchDispatchMode):
    """Inside this context, bf16 x bf16 CPU GEMMs run as fp32 GEMMs of the same operands rounded once to bf16."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = ROUTES.get(func)
        if route is not None:
            impl, operands = route
            if len(args) == operands and _all_bf16_on_cpu(args):
                return impl(*args, **kwargs)
        return func(*args, **kwargs)
