"""Master remainders on the GPU: the Gluon/Triton step of (bf16 parameter, int16 remainder) is bit-identical to the
torch reference on the same CUDA tensors, to the CPU (C++) step, and to the step on the fp32 master; full rows
(vector loads) and ragged rows, fp32 and bf16 gradients, non-finite gradient groups."""
import pytest
import torch

from coat_kernels.optim import CoatFP8AdamW
from coat_kernels.optim import master_remainders as mr


def bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


STATE_KEYS = ("exp_avg_q", "exp_avg_meta", "exp_avg_sq_q", "exp_avg_sq_meta", "step")
SHAPES = [(4096, 1024), (1000, 3), (128 * 37 + 5,), (1536,)]  # full rows, ragged rows


class DecoupledGradients(CoatFP8AdamW):
    """Gradients of any dtype beside the parameters (as Megatron's precision-aware optimizer hands them)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.grads = {}

    def param_gradient(self, param):
        return self.grads.get(param)


def run(backend, device, remainders, grad_dtype, steps=4):
    g = torch.Generator().manual_seed(0)
    start = [(torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for s in SHAPES]
    params = [(p if remainders else p.float()).to(device) for p in start]
    optimizer = DecoupledGradients(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, backend=backend,
                                   master_remainders=remainders)
    for step in range(steps):
        for p in params:
            grad = torch.randn(p.shape, generator=g) * 1e-2
            if step == 2:
                grad.view(-1)[17] = float("nan")
            optimizer.grads[p] = grad.to(grad_dtype).to(device)
        optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_triton_remainder_step_equals_the_reference_and_the_fp32_master(grad_dtype):
    fp32, fp32_opt = run("torch", "cuda", False, grad_dtype)
    for backend, device in (("triton", "cuda"), ("torch", "cuda"), ("auto", "cpu")):
        params, optimizer = run(backend, device, True, grad_dtype)
        assert optimizer.skipped_groups == len(SHAPES)
        for p, q in zip(params, fp32):
            master = optimizer.fp32_master(p).to("cuda")
            assert torch.equal(bits(master), bits(q)), (backend, device, p.shape)
            assert torch.equal(bits(p.to("cuda")), bits(mr.round_to_bf16(q))), (backend, device, p.shape)
            for key in STATE_KEYS:
                assert torch.equal(bits(optimizer.state[p][key].to("cuda")), bits(fp32_opt.state[q][key].to("cuda")))
