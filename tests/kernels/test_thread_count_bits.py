"""The CPU path's bits do not depend on the thread count: a few CoatFP8AdamW steps (the C++ step, OpenMP) and an FP8
block's forward and backward (coat_kernels.act on its torch path) give the same bits on 1 thread and on 2. Each
count runs in its own process (OpenMP's pool is sized once per process); the two run side by side."""
import os
import subprocess
import sys

import pytest

RUN = r'''
import hashlib, sys
import torch
threads = int(sys.argv[1])
torch.set_num_threads(threads)
assert torch.get_num_threads() == threads
from coat_kernels.act import ActivationConfig, Fp8NormSwigluMLP
from coat_kernels.optim import CoatFP8AdamW, cpu_step
assert cpu_step.library() is not None  # the C++ step, not the torch reference, is what is checked

digest = hashlib.sha256()
def add(t):
    t = t.detach().contiguous()
    digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())

torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(200_000) * 0.02), torch.nn.Parameter(torch.randn(1024, 96) * 0.02)]
opt = CoatFP8AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
gen = torch.Generator().manual_seed(1)
for _ in range(3):
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * torch.exp(torch.randn(p.shape, generator=gen))
    opt.step()
for p in params:
    add(p)
    for value in opt.state[p].values():
        if torch.is_tensor(value):
            add(value)

block = Fp8NormSwigluMLP(256, 512, config=ActivationConfig(backend="auto"))
x = torch.randn(2, 64, 256, generator=gen).to(torch.bfloat16).requires_grad_()
y = block(x)
y.float().square().mean().backward()
for t in (y, x.grad, *(p.grad for p in block.parameters())):
    add(t)
print(digest.hexdigest())
'''


def test_cpu_bits_are_the_same_on_one_and_two_threads():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["TRITON_INTERPRET"] = "0"  # the CPU path proper: the C++ optimizer step and the torch blocks
    procs = {n: subprocess.Popen([sys.executable, "-c", RUN, str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env={**env, "OMP_NUM_THREADS": str(n)}) for n in (1, 2)}
    out = {}
    for n, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        out[n] = stdout.strip().splitlines()[-1]
    assert out[1] == out[2]
