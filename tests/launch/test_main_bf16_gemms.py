"""launch.bf16_gemms: inside Bf16GemmsInFp32, bf16 CPU GEMMs are one fp32 GEMM of the bf16 operands rounded once to
bf16 (checked against the exact float64 product and against torch's own bf16 kernel); other ops are untouched; a
model's forward and backward under bf16 autocast give torch's results within bf16 rounding."""
import argparse
import contextlib

import pytest
import torch

from launch.bf16_gemms import Bf16GemmsInFp32


def bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at |x| (8 significant bits), for normal values."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -120))) - 7)


@pytest.mark.parametrize("op", ["mm", "mm_transposed", "bmm", "addmm"])
def test_a_bf16_gemm_is_the_fp32_gemm_of_its_operands_rounded_once(op):
    a, b, c = bf16(96, 640, seed=0), bf16(640, 48, seed=1), bf16(96, 48, seed=2)
    if op == "mm":
        call, exact = (lambda: a @ b), a.double() @ b.double()
    elif op == "mm_transposed":  # the layouts linear layers and their backward pass
        bt = b.t().contiguous()
        call, exact = (lambda: a @ bt.t()), a.double() @ b.double()
    elif op == "bmm":
        a3, b3 = a.reshape(4, 24, 640), b.expand(4, 640, 48)
        call, exact = (lambda: torch.bmm(a3, b3)), torch.bmm(a3.double(), b3.double())
    else:
        call = lambda: torch.addmm(c, a, b, beta=0.5, alpha=2.0)  # noqa: E731
        exact = 0.5 * c.double() + 2.0 * (a.double() @ b.double())
    native = call()
    with Bf16GemmsInFp32():
        routed = call()
    assert routed.dtype == torch.bfloat16 and routed.shape == native.shape
    # the products are exact in fp32 and the fp32 sum of 640 of them is within 1e-4 relative of the exact sum, so
    # the one rounding to bf16 lands on one of the two bf16 values around the exact result
    assert ((routed.double() - exact).abs() <= ulp(exact)).all()
    # the one rounding, not several: the result is the fp32 GEMM rounded to nearest
    widened = {"bmm": lambda: torch.bmm(a.reshape(4, 24, 640).float(), b.float().expand(4, 640, 48)),
               "addmm": lambda: torch.addmm(c.float(), a.float(), b.float(), beta=0.5, alpha=2.0)}.get(
        op, lambda: a.float() @ b.float())()
    assert torch.equal(routed, widened.to(torch.bfloat16))
    # torch's own bf16 kernel does the same arithmetic: at most one bf16 step apart, nearly always equal
    assert ((routed.double() - native.double()).abs() <= ulp(exact)).all()
    assert (routed == native).float().mean() > 0.99


def test_the_mode_changes_which_kernel_runs():
    """On these operands torch's bf16 kernel sums in another order than the fp32 GEMM (some outputs differ by one
    bf16 step): the mode's output is the fp32 GEMM's, so it is not torch's bf16 kernel running underneath."""
    a, b = bf16(256, 2048, seed=3), bf16(2048, 64, seed=4)
    native = a @ b
    fp32_gemm = (a.float() @ b.float()).to(torch.bfloat16)
    if torch.equal(native, fp32_gemm):
        pytest.skip("this CPU's bf16 kernel sums in the fp32 GEMM's order: the two cannot be told apart here")
    with Bf16GemmsInFp32():
        assert torch.equal(a @ b, fp32_gemm)


def test_other_dtypes_and_mixed_operands_are_left_alone():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with Bf16GemmsInFp32():
        assert torch.equal(a @ b, torch.mm(a, b)) and (a @ b).dtype == torch.float32
        half = a.half() @ b.half()
        assert half.dtype == torch.float16
        with pytest.raises(RuntimeError, match="dtype|same type|expected"):
            torch.mm(a.to(torch.bfloat16), b)  # what torch says without the mode
    assert torch.equal(half, a.half() @ b.half())


def test_a_model_under_autocast_trains_as_with_torchs_bf16_kernels():
    """Forward loss and every gradient of a small MLP under bf16 autocast (fp32 masters): with the mode, within bf16
    rounding of torch's own bf16 kernels; gradients stay fp32, as autocast gives them."""
    def run(mode):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 64, bias=False))
        x, y = torch.randn(256, 64), torch.randn(256, 64)
        with mode, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with mode:
            loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    loss_native, grads_native = run(contextlib.nullcontext())
    loss_routed, grads_routed = run(Bf16GemmsInFp32())
    assert loss_routed.item() == pytest.approx(loss_native.item(), rel=1e-3)
    for native, routed in zip(grads_native, grads_routed):
        assert routed.dtype == torch.float32
        cosine = torch.nn.functional.cosine_similarity(native.flatten(), routed.flatten(), dim=0)
        assert cosine > 0.9999 and (routed - native).norm() < 0.02 * native.norm()


def test_the_main_job_routes_on_a_cpu_only_when_asked():
    from launch import main as M

    def args(choice):
        return argparse.Namespace(bf16_gemms=choice)

    assert isinstance(M.bf16_gemm_route(args("fp32"), torch.device("cpu")), Bf16GemmsInFp32)
    assert not isinstance(M.bf16_gemm_route(args("native"), torch.device("cpu")), Bf16GemmsInFp32)
    assert not isinstance(M.bf16_gemm_route(args("fp32"), torch.device("cuda")), Bf16GemmsInFp32)
    with pytest.raises(ValueError, match="--bf16-gemms must be fp32 or native"):
        M.bf16_gemm_route(args("bf16"), torch.device("cpu"))


@pytest.mark.parametrize("choice", ["fp32", "native"])
def test_the_main_jobs_training_loop_runs_its_gemms_through_the_mode_on_a_cpu(choice, monkeypatch):
    """run_arm on a CPU with --bf16-gemms fp32: the forward, backward and evaluation GEMMs go through the mode's
    fp32 route; with native, none do. A two-step run of a one-layer Llama."""
    from launch import bf16_gemms as B
    from launch import main as M

    routed = []
    monkeypatch.setitem(B.ROUTES, torch.ops.aten.mm.default,
                        (lambda a, b: routed.append(a.shape) or B.mm(a, b), 2))
    shape = argparse.Namespace(hidden=32, ffn=64, layers=1, heads=2, kv_heads=1, seq=16, seed=0)
    base = M.build_model(shape, 64, attention="eager")
    args = argparse.Namespace(steps=2, lr=1e-3, eval_every=2, bf16_gemms=choice)
    model, optimizer = M.make_arm("bf16", base, args, torch.device("cpu"))
    batches = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    result = M.run_arm("BF16", model, optimizer, batches[:2], batches[2:], args, torch.device("cpu"), False)
    assert len(result.train) == 2 and len(result.val) == 1
    if choice == "fp32":
        # per training step at least the 5 projections and the LM head forward, and their backward GEMMs
        assert len(routed) >= 2 * 3 * 6
    else:
        assert routed == []
