"""CoatFP8Lion and CoatFP8Muon on the CPU: Lion's C++, torch-reference and (interpreted) Triton steps against each
other; Lion against a plain Lion written here; Muon with fp32 state against torch.optim.Muon and AdamW itself; FP8
runs tracking those oracles; state validation, checkpoints (state dicts, torch layouts, pickles) and the non-finite
policy like CoatFP8AdamW's."""
import copy
import pickle

import pytest
import torch

from coat_kernels.optim import CoatFP8AdamW, CoatFP8Lion, CoatFP8Muon, StateError, cpu_step, muon_param_groups
from coat_kernels.optim.dre_reference import DREConfig, quantize
from coat_kernels.optim.grouping import build_layout
from coat_kernels.optim.lion_reference import LionScalars, fused_lion_step


def plain_lion(params, grads, momenta, lr, beta1, beta2, wd):
    """Lion's formula, element by element in fp32 tensors."""
    for p, g, m in zip(params, grads, momenta):
        c = beta1 * m + (1 - beta1) * g
        p.mul_(1 - lr * wd).sub_(lr * torch.sign(c))
        m.mul_(beta2).add_((1 - beta2) * g)


def gradients(shapes, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) * torch.logspace(-4, 1, s.numel() if isinstance(s, torch.Size) else
                                                            int(torch.tensor(s).prod())).view(s)
             for s in shapes] for _ in range(steps)]


def lion_state(n, seed):
    gen = torch.Generator().manual_seed(seed)
    layout = build_layout(None, n, 64)
    codes, meta = quantize(torch.randn(n, generator=gen) * torch.logspace(-6, 1, n), layout, DREConfig("e4m3"))
    return layout, codes, meta


@pytest.mark.parametrize("param_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.float32, torch.float16)])
def test_lion_cpu_step_equals_the_reference_bit_for_bit(param_dtype, grad_dtype):
    assert cpu_step.lion_library() is not None, "the C++ Lion step must be built for this test"
    n = 1000
    layout, codes, meta = lion_state(n, 1)
    param = torch.randn(n).to(param_dtype)
    grad = (torch.randn(n) * torch.logspace(-7, 2, n)).to(grad_dtype)
    grad[7] = float("nan")  # its group is skipped on both paths
    h, cfg = LionScalars.make(3e-3, 0.9, 0.99, 0.1), DREConfig("e4m3")
    a, b = [param.clone(), codes.clone(), meta.clone()], [param.clone(), codes.clone(), meta.clone()]
    skipped_ref = fused_lion_step(a[0], grad, a[1], a[2], layout, h, cfg)
    skipped_cpu = cpu_step.fused_lion_step(b[0], grad, b[1], b[2], layout, h, cfg)
    assert int(skipped_ref) == int(skipped_cpu) == 1
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    assert torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))
    assert torch.equal(a[0][:64], param[:64])  # the skipped group kept its parameters


def test_lion_triton_kernel_tracks_the_reference_under_the_interpreter():
    from coat_kernels.optim import lion_triton

    n = 700
    layout, codes, meta = lion_state(n, 2)
    param, grad = torch.randn(n), torch.randn(n) * 1e-2
    h, cfg = LionScalars.make(1e-3, 0.9, 0.99, 0.05), DREConfig("e4m3")
    a, b = [param.clone(), codes.clone(), meta.clone()], [param.clone(), codes.clone(), meta.clone()]
    fused_lion_step(a[0], grad, a[1], a[2], layout, h, cfg)
    skipped = torch.zeros(1, dtype=torch.int32)
    lion_triton.fused_lion_step(b[0], grad, b[1], b[2], layout, h, cfg, skipped)
    assert int(skipped) == 0
    torch.testing.assert_close(b[0], a[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(b[2], a[2], rtol=1e-5, atol=1e-5)
    differ = (a[1].view(torch.uint8).int() - b[1].view(torch.uint8).int()).abs()
    assert int(differ.max()) <= 1 and float((differ > 0).float().mean()) < 0.01  # fp8 casts round differently


@pytest.mark.parametrize("state_dtype,atol", [("fp32", 1e-6), ("fp8", 5e-3)])
def test_lion_tracks_a_plain_lion(state_dtype, atol):
    shapes = [(40, 30), (77,)]
    lr, betas, wd = 1e-3, (0.9, 0.99), 0.1
    init = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = CoatFP8Lion(params, lr=lr, betas=betas, weight_decay=wd, state_dtype=state_dtype, group_size=32)
    plain, momenta = [t.clone() for t in init], [torch.zeros(s) for s in shapes]
    for grads in gradients(shapes, 20):
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        plain_lion(plain, grads, momenta, lr, *betas, wd)
    for p, q in zip(params, plain):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=atol)
    if state_dtype == "fp8":
        # one byte per element, 12 bytes of metadata per group of 32, and a step and segment table per tensor
        assert opt.state_bytes() / sum(p.numel() for p in params) < 1 + 12 / 32 + 0.1


def test_lion_backends_give_the_same_bits_and_state_round_trips():
    def run(backend, steps, opt=None, params=None):
        params = params or [torch.nn.Parameter(torch.randn(33, 20, generator=torch.Generator().manual_seed(3)))]
        opt = opt or CoatFP8Lion(params, lr=1e-2, weight_decay=0.1, backend=backend)
        for grads in steps:
            params[0].grad = grads[0]
            opt.step()
        return params, opt

    steps = gradients([(33, 20)], 6, seed=4)
    (p_auto,), opt = run("auto", steps)
    (p_torch,), _ = run("torch", steps)
    assert torch.equal(p_auto, p_torch)
    # resume from a state dict, a torch-layout state dict and a pickle after 3 steps: the same bits as 6 straight
    params, first = run("auto", steps[:3])
    saved, torch_layout, pickled = copy.deepcopy(first.state_dict()), first.torch_format_state_dict(), \
        pickle.dumps((params, first))
    assert set(torch_layout["state"][0]) == {"step", "exp_avg"}
    assert torch_layout["state"][0]["exp_avg"].shape == (33, 20)
    for load in (saved, torch_layout):
        resumed = [torch.nn.Parameter(params[0].detach().clone())]
        opt2 = CoatFP8Lion(resumed, lr=1e-2, weight_decay=0.1)
        opt2.load_state_dict(load)
        assert torch.equal(run("auto", steps[3:], opt2, resumed)[0][0], p_auto)
    unpickled_params, unpickled = pickle.loads(pickled)
    assert torch.equal(run("auto", steps[3:], unpickled, unpickled_params)[0][0], p_auto)


def test_lion_state_validation_and_nonfinite_policy():
    p = torch.nn.Parameter(torch.randn(300))
    opt = CoatFP8Lion([p], lr=1e-2)
    p.grad = torch.randn(300)
    opt.step()
    assert set(opt.state[p]) == {"step", "segments", "group_size", "exp_avg_q", "exp_avg_meta"}
    good = copy.deepcopy(opt.state_dict())
    for damage, match in ((lambda e: e.pop("exp_avg_meta"), "lacks"),
                          (lambda e: e.update(exp_avg_sq_q=e["exp_avg_q"]), "unknown state key"),
                          (lambda e: e["exp_avg_q"].view(torch.uint8).__setitem__(3, 0x7F), "NaN"),
                          (lambda e: e.update(segments=torch.tensor([[0, 100, 0]])), "segments")):
        bad = copy.deepcopy(good)
        damage(bad["state"][0])
        with pytest.raises(StateError, match=match):
            opt.load_state_dict(bad)
    before = p.detach().clone()
    p.grad = torch.full((300,), float("inf"))
    opt.step()
    assert torch.equal(p.detach(), before) and opt.skipped_groups == 3
    with pytest.raises(ValueError, match="master_remainders"):
        CoatFP8Lion([p], master_remainders=True)
    with pytest.raises(ValueError, match="unknown option 'eps'"):
        CoatFP8Lion([p], eps=1e-8)
    with pytest.raises(ValueError, match="state_dtype"):
        CoatFP8Lion([p], state_dtype="fp16")


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(50, 32)
        self.up, self.norm, self.down = torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 32)
        self.lm_head = torch.nn.Linear(32, 50, bias=False)

    def forward(self, x):
        return self.lm_head(self.down(self.norm(self.up(self.embed_tokens(x)))))


@pytest.mark.parametrize("nesterov,adjust_lr_fn,shape", [(True, None, (48, 32)), (False, "match_rms_adamw", (24, 40)),
                                                         (True, "original", (64, 16))])
def test_muon_with_fp32_state_is_torch_muon(nesterov, adjust_lr_fn, shape):
    """The oracle is torch.optim.Muon itself (and torch.optim.AdamW for the AdamW group)."""
    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(shape, generator=gen), torch.randn(shape[0], generator=gen)
    torch_w, torch_b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
    ours_w, ours_b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
    kwargs = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    muon = torch.optim.Muon([torch_w], **kwargs)
    adamw = torch.optim.AdamW([torch_b], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    ours = CoatFP8Muon([dict(params=[ours_w], use_muon=True),
                        dict(params=[ours_b], use_muon=False, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)],
                       state_dtype="fp32", **kwargs)
    for grads in gradients([shape, (shape[0],)], 6, seed=6):
        torch_w.grad, ours_w.grad = grads[0], grads[0].clone()
        torch_b.grad, ours_b.grad = grads[1], grads[1].clone()
        muon.step(), adamw.step(), ours.step()
    torch.testing.assert_close(ours_w.detach(), torch_w.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_b.detach(), torch_b.detach(), rtol=1e-6, atol=1e-7)
    # ... and loads torch.optim.Muon's state dict: its momentum_buffer is the momentum
    fp8 = CoatFP8Muon([dict(params=[ours_w], use_muon=True)], **kwargs)
    fp8.load_state_dict(muon.state_dict())
    assert fp8.fp32_moments(ours_w)["exp_avg"].shape == (w.numel(),)


def test_fp8_muon_tracks_torch_muon_and_its_adamw_groups_are_coat_adamw():
    model = TinyLM()
    groups = muon_param_groups(model, lr=0.02)
    assert groups[0]["params"] == [model.up.weight, model.down.weight] and len(groups[1]["params"]) == 6
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(9))
    ours, theirs = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    fp8, oracle = CoatFP8Muon([ours], lr=0.02), torch.optim.Muon([theirs], lr=0.02)
    for (g,) in gradients([(64, 48)], 10, seed=10):
        ours.grad, theirs.grad = g.clone(), g
        fp8.step(), oracle.step()
    moved = (theirs - w).abs().max()
    assert (ours - theirs).abs().max() < 0.02 * moved, ((ours - theirs).abs().max(), moved)
    assert fp8.state_bytes() < 1.2 * w.numel()
    adamw_only = CoatFP8Muon([dict(params=[torch.nn.Parameter(torch.ones(8))], use_muon=False)], lr=0.1)
    twin_only = CoatFP8AdamW([torch.nn.Parameter(torch.ones(8))], lr=0.1, weight_decay=0.1)
    for opt in (adamw_only, twin_only):
        for step in range(3):
            opt.param_groups[0]["params"][0].grad = torch.linspace(-1, 1, 8) * (step + 1)
            opt.step()
    assert torch.equal(adamw_only.param_groups[0]["params"][0], twin_only.param_groups[0]["params"][0])


def test_muon_checkpoints_validation_and_nonfinite_policy():
    def fresh():
        torch.manual_seed(7)
        w, b = torch.nn.Parameter(torch.randn(32, 24)), torch.nn.Parameter(torch.randn(24))
        return [w, b], CoatFP8Muon([dict(params=[w], use_muon=True), dict(params=[b], use_muon=False)], lr=0.02)

    steps = gradients([(32, 24), (24,)], 6, seed=8)

    def run(params, opt, grads_list):
        for grads in grads_list:
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()

    straight, opt = fresh()
    run(straight, opt, steps)
    for make_saved in (lambda o: copy.deepcopy(o.state_dict()), lambda o: o.torch_format_state_dict()):
        params, first = fresh()
        run(params, first, steps[:3])
        saved = make_saved(first)
        resumed, second = fresh()
        with torch.no_grad():
            for p, q in zip(resumed, params):
                p.copy_(q)
        second.load_state_dict(saved)
        run(resumed, second, steps[3:])
        assert all(torch.equal(p, q) for p, q in zip(resumed, straight))
    assert set(opt.torch_format_state_dict()["state"][0]) == {"step", "momentum_buffer"}
    params, unpickled = pickle.loads(pickle.dumps((straight, opt)))
    assert set(unpickled.state[params[1]]) >= {"exp_avg_sq_q", "exp_avg_q"}
    bad = copy.deepcopy(opt.state_dict())
    bad["state"][0]["exp_avg_sq_q"] = bad["state"][0]["exp_avg_q"]
    with pytest.raises(StateError, match="unknown state key"):
        opt.load_state_dict(bad)
    flipped = copy.deepcopy(opt.state_dict())
    flipped["param_groups"][0]["use_muon"] = False
    with pytest.raises(StateError, match="use_muon"):
        opt.load_state_dict(flipped)
    w = straight[0]
    before = w.detach().clone()
    w.grad, straight[1].grad = torch.full_like(w, float("nan")), None
    skipped = opt.skipped_groups
    opt.step()
    assert torch.equal(w.detach(), before) and opt.skipped_groups - skipped == 6  # 768 elements in groups of 128
    with pytest.raises(ValueError, match="2D parameters"):
        CoatFP8Muon([dict(params=[torch.nn.Parameter(torch.randn(4))], use_muon=True)])
    with pytest.raises(ValueError, match="use_muon"):
        CoatFP8Muon([torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4, 4))])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        CoatFP8Muon([w], adjust_lr_fn="rms")
