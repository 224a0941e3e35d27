"""CoatFP8AdamW as a torch optimizer: training quality, state size, checkpoints, bad input, NaN/Inf gradients."""
import copy
import warnings

import pytest
import torch

from coat_ds import CoatFP8AdamW
from coat_kernels.optim import dre_reference as ref
from coat_kernels.optim.grouping import build_layout

warnings.filterwarnings("ignore", category=RuntimeWarning)


def mlp(seed=0, hidden=128):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 8))


def data(n=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 8, generator=g)
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 8, generator=g)


def train(model, opt, steps, batch=64):
    x, y = data()
    losses = []
    for step in range(steps):
        i = (step * batch) % len(x)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[i:i + batch]), y[i:i + batch])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def codes_equal(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_200_steps_track_torch_adamw():
    a, b = mlp(), mlp()
    coat = train(a, CoatFP8AdamW(a.parameters(), lr=3e-3, weight_decay=0.01), 200)
    adamw = train(b, torch.optim.AdamW(b.parameters(), lr=3e-3, weight_decay=0.01), 200)
    assert coat[-1] < 0.5 * coat[0]
    window = slice(-20, None)
    mean_c, mean_a = sum(coat[window]) / 20, sum(adamw[window]) / 20
    assert abs(mean_c - mean_a) < 0.1 * mean_a, (mean_c, mean_a)
    drift = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    assert drift < 0.1  # lr 3e-3 x 200 steps: parameters move up to ~0.6


def test_triton_backend_matches_reference_bit_for_bit():
    a, b = mlp(hidden=48), mlp(hidden=48)
    opt_a = CoatFP8AdamW(a.parameters(), lr=1e-2, backend="torch")
    opt_b = CoatFP8AdamW(b.parameters(), lr=1e-2, backend="triton")  # one multi-tensor launch, interpreted
    train(a, opt_a, 4)
    train(b, opt_b, 4)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.view(torch.int32), q.view(torch.int32))
        sa, sb = opt_a.state[p], opt_b.state[q]
        for key in ("exp_avg_q", "exp_avg_sq_q"):
            assert codes_equal(sa[key], sb[key]), key
        for key in ("exp_avg_meta", "exp_avg_sq_meta"):
            assert torch.equal(sa[key].view(torch.int32), sb[key].view(torch.int32)), key


def test_kernel_follows_state_tensors_that_move():
    """An offloading engine may swap state tensors between steps: the launch must use the new ones."""
    a, b = mlp(hidden=48), mlp(hidden=48)
    opt_a = CoatFP8AdamW(a.parameters(), lr=1e-2, backend="torch")
    opt_b = CoatFP8AdamW(b.parameters(), lr=1e-2, backend="triton")
    train(a, opt_a, 1)
    train(b, opt_b, 1)
    for state in opt_b.state.values():
        for key in ("exp_avg_q", "exp_avg_sq_q", "exp_avg_meta", "exp_avg_sq_meta"):
            state[key] = state[key].clone()
    train(a, opt_a, 1)
    train(b, opt_b, 1)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        assert codes_equal(opt_a.state[p]["exp_avg_q"], opt_b.state[q]["exp_avg_q"])


def test_state_bytes_per_parameter():
    model = torch.nn.Linear(1024, 1024, bias=False)
    opt = CoatFP8AdamW(model.parameters())
    model.weight.grad = torch.randn_like(model.weight)
    opt.step()
    state = opt.state[model.weight]
    assert state["exp_avg_q"].dtype == torch.float8_e4m3fn and state["exp_avg_sq_q"].dtype == torch.float8_e4m3fn
    assert opt.state_bytes() / model.weight.numel() <= 2.2


def test_state_dict_round_trip_is_exact_and_keeps_fp8():
    model = mlp().to(torch.bfloat16)  # bf16 params: torch's load would cast the fp32 metadata to bf16
    opt = CoatFP8AdamW(model.parameters(), lr=1e-2)
    x, y = data()
    def train_bf16(m, o):
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x.bfloat16()), y.bfloat16()).backward()
        o.step()

    for _ in range(3):
        train_bf16(model, opt)
    saved = copy.deepcopy(opt.state_dict())
    clone = copy.deepcopy(model)
    opt2 = CoatFP8AdamW(clone.parameters(), lr=1e-2)
    opt2.load_state_dict(saved)
    for p, q in zip(model.parameters(), clone.parameters()):
        s, t = opt.state[p], opt2.state[q]
        assert t["exp_avg_q"].dtype == torch.float8_e4m3fn and t["exp_avg_meta"].dtype == torch.float32
        assert t["segments"].dtype == torch.int64
        assert codes_equal(s["exp_avg_q"], t["exp_avg_q"]) and torch.equal(s["exp_avg_sq_meta"], t["exp_avg_sq_meta"])
    train_bf16(model, opt)
    train_bf16(clone, opt2)
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)
        assert codes_equal(opt.state[p]["exp_avg_sq_q"], opt2.state[q]["exp_avg_sq_q"])
        assert opt.state[p]["step"] == opt2.state[q]["step"] == 4


def test_fp32_moments_in_state_are_quantized_at_the_next_step():
    """DeepSpeed's universal-checkpoint loader writes fp32 exp_avg/exp_avg_sq straight into optimizer.state."""
    model = torch.nn.Linear(16, 300, bias=False)
    p = model.weight
    torch.manual_seed(4)
    m0, v0 = torch.randn(p.numel()) * 1e-3, torch.rand(p.numel()) * 1e-6
    opt = CoatFP8AdamW([p], lr=1e-3)
    opt.state[p].update(step=torch.tensor(5.0), exp_avg=m0.clone(), exp_avg_sq=v0.clone())
    p.grad = torch.randn_like(p) * 1e-3
    before = p.detach().clone()
    opt.step()
    assert set(opt.state[p]) >= {"exp_avg_q", "exp_avg_sq_q"} and "exp_avg" not in opt.state[p]
    assert opt.state[p]["step"] == 6
    # Expected: quantize the injected moments, then one reference step.
    layout = build_layout(None, p.numel(), 128)
    cfg = ref.DREConfig("e4m3")
    mq, mm = ref.quantize(m0, layout, cfg)
    vq, vm = ref.quantize(v0, layout, cfg)
    expected = before.clone().view(-1)
    ref.fused_adamw_step(expected, p.grad.view(-1), mq, mm, vq, vm, layout,
                         ref.AdamWScalars.make(1e-3, 0.9, 0.999, 1e-8, 1e-2, 6), cfg, cfg)
    assert torch.equal(p.detach().view(-1), expected)
    deq = opt.fp32_moments(p)
    assert deq["exp_avg"].shape == (p.numel(),) and torch.isfinite(deq["exp_avg_sq"]).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nonfinite_gradients_skip_their_groups(backend):
    p = torch.nn.Parameter(torch.randn(4 * 128))
    opt = CoatFP8AdamW([p], lr=1e-2, backend=backend)
    p.grad = torch.randn_like(p)
    opt.step()
    before = p.detach().clone()
    state_before = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
    g = torch.randn_like(p)
    g[5], g[300], g[400] = float("nan"), float("inf"), 3e19  # groups 0, 2 and 3 (3e19 squared overflows fp32)
    p.grad = g
    opt.step()
    assert opt.skipped_groups == 3
    for lo, hi in ((0, 128), (256, 384), (384, 512)):
        assert torch.equal(p.detach()[lo:hi], before[lo:hi])
        assert codes_equal(opt.state[p]["exp_avg_q"][lo:hi], state_before["exp_avg_q"][lo:hi])
    assert not torch.equal(p.detach()[128:256], before[128:256])
    assert torch.isfinite(p).all() and torch.isfinite(opt.state[p]["exp_avg_meta"]).all()


def test_nonfinite_error_mode_raises_after_leaving_state_clean():
    p = torch.nn.Parameter(torch.randn(256))
    opt = CoatFP8AdamW([p], nonfinite="error")
    p.grad = torch.full_like(p, float("nan"))
    with pytest.raises(FloatingPointError, match="2 quantization groups"):
        opt.step()
    assert torch.isfinite(p).all()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(amsgrad=True), ValueError, "amsgrad"),
    (dict(maximize=True), ValueError, "maximize"),
    (dict(max_grad_norm=1.0), ValueError, "valid options: lr, betas"),
    (dict(exp_avg_format="e3m4"), ValueError, "exp_avg_format must be one of"),
    (dict(expand_exp_avg="false"), TypeError, "expand_exp_avg must be a bool"),
    (dict(expand_exp_avg_sq=0), TypeError, "expand_exp_avg_sq must be a bool"),
    (dict(group_size=128.0), TypeError, "group_size must be an integer"),
    (dict(group_size=True), TypeError, "group_size must be an integer"),
    (dict(expand_min="16"), TypeError, "expand_min must be an integer"),
    (dict(k_max="8"), TypeError, "k_max must be a number"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(group_size=0), ValueError, "group_size"),
    (dict(k_max=0.5), ValueError, "k_max"),
    (dict(betas=(0.9, 1.0)), ValueError, "hyper-parameters"),
    (dict(nonfinite="ignore"), ValueError, "nonfinite"),
])
def test_bad_options_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        CoatFP8AdamW([torch.nn.Parameter(torch.randn(4))], **kwargs)


def test_unknown_option_error_lists_only_valid_options():
    with pytest.raises(ValueError) as info:
        CoatFP8AdamW([torch.nn.Parameter(torch.randn(4))], max_grad_norm=1.0)
    valid = str(info.value).split("valid options: ")[1]
    assert "group_size" in valid and "lr" in valid
    assert not any(rejected in valid for rejected in ("amsgrad", "maximize", "capturable", "differentiable"))


def test_options_changed_in_param_groups_are_validated_or_refused():
    """A group's COAT options may be edited between steps like lr: invalid values fail at the next step, and a
    format or group size that the stored codes do not have is refused instead of silently misread."""
    p = torch.nn.Parameter(torch.randn(300))
    opt = CoatFP8AdamW([p], lr=1e-2)
    p.grad = torch.randn(300)
    opt.step()
    for key, value, error, match in (("expand_exp_avg", "false", TypeError, "bool"),
                                     ("group_size", 64.0, TypeError, "integer"),
                                     ("exp_avg_sq_format", "e5m2", RuntimeError, "stored as"),
                                     ("group_size", 64, RuntimeError, "groups of 128"),
                                     ("betas", (0.9, 1.0), ValueError, "hyper-parameters")):
        before = opt.param_groups[0][key]
        opt.param_groups[0][key] = value
        with pytest.raises(error, match=match):
            opt.step()
        opt.param_groups[0][key] = before
    opt.step()  # back to valid options: steps again
    assert float(opt.state[p]["step"]) == 2


def test_format_change_through_fp32_moments():
    p = torch.nn.Parameter(torch.randn(300))
    opt = CoatFP8AdamW([p], lr=1e-2)
    p.grad = torch.randn(300)
    opt.step()
    moments = opt.fp32_moments(p)
    opt.state[p].clear()
    opt.param_groups[0]["exp_avg_sq_format"] = "e5m2"
    opt.set_fp32_moments(p, moments["exp_avg"], moments["exp_avg_sq"], step=1)
    assert opt.state[p]["exp_avg_sq_q"].dtype == torch.float8_e5m2
    opt.step()


def test_deepcopy_and_pickle_then_step():
    import pickle

    model = mlp(hidden=48)
    opt = CoatFP8AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 2)
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        params = [p for g in clone.param_groups for p in g["params"]]
        for p in params:
            p.grad = torch.randn_like(p)
        clone.step()
        assert all(float(clone.state[p]["step"]) == 3 for p in params)
    assert all(float(s["step"]) == 2 for s in opt.state.values())


def test_bad_tensors_raise_clear_errors():
    p = torch.nn.Parameter(torch.randn(8, dtype=torch.float64))
    p.grad = torch.randn_like(p)
    with pytest.raises(TypeError, match="fp32 or bf16"):
        CoatFP8AdamW([p]).step()
    q = torch.nn.Parameter(torch.randn(8))
    q.grad = torch.randn(8).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        CoatFP8AdamW([q]).step()
    r = torch.nn.Parameter(torch.randn(8))
    if hasattr(r, "grad_dtype"):  # torch >= 2.12 checks grad dtypes unless told otherwise
        r.grad_dtype = None
    r.grad = torch.randn(8, dtype=torch.bfloat16)  # bf16 grads are fine
    CoatFP8AdamW([r]).step()
    assert CoatFP8AdamW([torch.nn.Parameter(torch.randn(3))], betas=[0.8, 0.9]).defaults["betas"] == (0.8, 0.9)


def test_migration_to_torch_adamw_and_back():
    """torch_adamw_state_dict: torch AdamW loads it and continues; CoatFP8AdamW loads it back bit for bit (its fp32
    moments quantize to the saved codes and metadata) and continues exactly like the uninterrupted run. A torch AdamW
    state dict loads into CoatFP8AdamW and is quantized."""
    from coat_kernels.optim.exact_export import quantized_equal

    def model_and_grads(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(24, 300), torch.nn.Linear(300, 7))
        return m

    def set_grads(model, step):
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g) * torch.exp(torch.randn(p.shape, generator=g) * 3) * 1e-3

    model = model_and_grads(0)
    opt = CoatFP8AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), exp_avg_sq_format="e5m2")
    for step in range(3):
        set_grads(model, step)
        opt.step()
    sd = opt.torch_adamw_state_dict()
    assert all(set(e) == {"step", "exp_avg", "exp_avg_sq"} for e in sd["state"].values())
    assert sd["param_groups"][0]["exp_avg_sq_format"] == "e5m2"  # the options travel with the groups

    adamw_model = model_and_grads(0)
    adamw_model.load_state_dict(model.state_dict())
    adamw = torch.optim.AdamW(adamw_model.parameters(), lr=1e-3)
    adamw.load_state_dict(copy.deepcopy(sd))  # torch AdamW steps the loaded tensors in place
    for (p, q) in zip(model.parameters(), adamw_model.parameters()):
        assert torch.equal(adamw.state[q]["exp_avg"], opt.fp32_moments(p)["exp_avg"].view(p.shape))
    set_grads(adamw_model, 3)
    adamw.step()
    assert float(adamw.state[next(adamw_model.parameters())]["step"]) == 4

    back_model = model_and_grads(0)
    back_model.load_state_dict(model.state_dict())
    back = CoatFP8AdamW(back_model.parameters(), lr=1e-3, exp_avg_sq_format="e5m2")
    back.load_state_dict(sd)
    back.initialize_state()
    for p, q in zip(model.parameters(), back_model.parameters()):
        a, b = opt.state[p], back.state[q]
        for key in ("exp_avg", "exp_avg_sq"):
            assert quantized_equal(a[key + "_q"], a[key + "_meta"], b[key + "_q"], b[key + "_meta"]), key
    for step in (3, 4):
        set_grads(model, step)
        set_grads(back_model, step)
        opt.step()
        back.step()
    for p, q in zip(model.parameters(), back_model.parameters()):
        assert torch.equal(p, q)

    into_coat = CoatFP8AdamW(adamw_model.parameters(), lr=1e-3)
    into_coat.load_state_dict(adamw.state_dict())
    into_coat.initialize_state()
    assert all(s["exp_avg_q"].dtype == torch.float8_e4m3fn and "exp_avg" not in s for s in into_coat.state.values())
    set_grads(adamw_model, 4)
    into_coat.step()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only machine gives")
def test_triton_backend_on_a_cpu_says_what_to_use_instead():
    import os
    import subprocess
    import sys

    code = ("import torch\nfrom coat_kernels.optim import CoatFP8AdamW\n"
            "p = torch.nn.Parameter(torch.randn(256))\nopt = CoatFP8AdamW([p], backend='triton')\n"
            "p.grad = torch.randn(256)\nopt.step()")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "backend='auto'" in proc.stderr and "TRITON_INTERPRET=1" in proc.stderr, proc.stderr[-2000:]
