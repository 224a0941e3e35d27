"""States the docs promise to complete at the next step are completed there (a bf16 entry without its master remainder,
fp32 moments beside FP8 codes), also after a step that failed; a torch-format state dict is a copy that stays as it
was while training goes on; a step refuses a bad live `step` before any param group is stepped; `set_fp32_master`
refuses NaN/Inf; a tensor listed twice (in one param group or in two) is refused when its group is added."""
import copy
import warnings

import pytest
import torch

from coat_kernels.optim import CoatFP8AdamW, StateError

warnings.filterwarnings("ignore", category=RuntimeWarning)

N = 700  # 5 full quantization groups of 128 and a ragged one


def grad_for(p, step):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype)


def raw(t):
    t = t.detach()
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(bits)


def same_entry(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(raw(a[k]), raw(b[k])) if torch.is_tensor(a[k]) else a[k] == b[k]
                                    for k in a)


def stepped(dtype=torch.float32, steps=1, **options):
    torch.manual_seed(0)
    p = torch.nn.Parameter((torch.randn(N) * 0.1).to(dtype))
    opt = CoatFP8AdamW([p], lr=1e-2, weight_decay=0.1, **options)
    for step in range(steps):
        p.grad = grad_for(p, step)
        opt.step()
    return p, opt


def step_both(pairs, step):
    for p, opt in pairs:
        p.grad = grad_for(p, step)
        opt.step()


# ---- states completed at the next step -------------------------------------------------------------------------
def test_a_bf16_entry_without_its_remainder_steps_from_the_bf16_master():
    p, opt = stepped(torch.bfloat16, master_remainders=True)
    q, ref = stepped(torch.bfloat16, master_remainders=True)
    opt.state[p].pop("master_remainder")
    ref.state[q]["master_remainder"].zero_()  # what a missing remainder means: the master is the bf16 parameter
    for step in (1, 2):
        step_both([(p, opt), (q, ref)], step)
        assert torch.equal(raw(p), raw(q)) and same_entry(opt.state[p], ref.state[q])
    assert float(opt.state[p]["step"]) == 3


def test_fp32_moments_beside_fp8_codes_are_quantized_at_the_next_step():
    p, opt = stepped(steps=2)
    q, ref = stepped(steps=2)
    opt.state[p].update(opt.fp32_moments(p))  # as DeepSpeed's universal-checkpoint loader leaves them
    step_both([(p, opt), (q, ref)], 2)
    assert "exp_avg" not in opt.state[p] and float(opt.state[p]["step"]) == 3
    assert torch.equal(raw(p), raw(q)) and same_entry(opt.state[p], ref.state[q])


def test_a_failed_step_leaves_no_plan_behind(monkeypatch):
    """A step that fails after its groups were planned is not remembered: moments set afterwards are the ones the
    next step uses, not the codes the failed step had quantized from the entry's fp32 moments for its plan."""
    from coat_kernels.optim.dre_reference import AdamWScalars

    p, opt = stepped(steps=2)
    q, ref = stepped(steps=2)
    old = opt.fp32_moments(p)
    opt.state[p].update({k: v * 3 for k, v in old.items()})
    with monkeypatch.context() as patch:
        patch.setattr(AdamWScalars, "make", classmethod(lambda *a: (_ for _ in ()).throw(RuntimeError("planted"))))
        p.grad = grad_for(p, 2)
        with pytest.raises(RuntimeError, match="planted"):
            opt.step()
    new = {k: v * 0.5 for k, v in old.items()}
    opt.set_fp32_moments(p, new["exp_avg"], new["exp_avg_sq"])
    ref.set_fp32_moments(q, new["exp_avg"], new["exp_avg_sq"])
    step_both([(p, opt), (q, ref)], 2)
    assert torch.equal(raw(p), raw(q)) and same_entry(opt.state[p], ref.state[q])


# ---- the torch-format state dict is a copy -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_torch_format_state_dict_does_not_change_while_training_goes_on(dtype):
    p, opt = stepped(dtype, steps=2, master_remainders=True)
    kept = opt.torch_adamw_state_dict()
    copied = copy.deepcopy(kept)
    params_then = p.detach().clone()
    for step in (2, 3):
        p.grad = grad_for(p, step)
        opt.step()
    assert same_entry(kept["state"][0], copied["state"][0])
    # resuming from the kept dict continues exactly as resuming from its copy taken at export time
    runs = []
    for sd in (kept, copied):
        q = torch.nn.Parameter(params_then.clone())
        o = CoatFP8AdamW([q], lr=1e-2, weight_decay=0.1, master_remainders=True)
        o.load_state_dict(sd)
        q.grad = grad_for(q, 2)
        o.step()
        runs.append((q, o))
    (q1, o1), (q2, o2) = runs
    assert torch.equal(raw(q1), raw(q2)) and same_entry(o1.state[q1], o2.state[q2])


def test_a_torch_format_export_of_an_entry_not_yet_quantized_is_a_copy():
    """An entry loaded from torch.optim.AdamW's format holds fp32 moments until the next step quantizes them: the
    export hands out copies, not that entry."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(N))
    adamw = torch.optim.AdamW([p], lr=1e-2)
    p.grad = grad_for(p, 0)
    adamw.step()
    opt = CoatFP8AdamW([p], lr=1e-2)
    opt.load_state_dict(adamw.state_dict())
    kept = opt.torch_adamw_state_dict()
    copied = copy.deepcopy(kept)
    p.grad = grad_for(p, 1)
    opt.step()
    assert same_entry(kept["state"][0], copied["state"][0])


# ---- refusals ----------------------------------------------------------------------------------------------------
def test_a_bad_live_step_is_refused_before_any_group_is_stepped():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(N)), torch.nn.Parameter(torch.randn(300))
    opt = CoatFP8AdamW([{"params": [a]}, {"params": [b]}], lr=1e-2)
    for step in range(2):
        a.grad, b.grad = grad_for(a, step), grad_for(b, step)
        opt.step()
    before = {p: (p.detach().clone(), copy.deepcopy(opt.state[p])) for p in (a, b)}
    opt.state[b]["step"] = "2"  # float() reads it, `+= 1` would not
    a.grad, b.grad = grad_for(a, 2), grad_for(b, 2)
    with pytest.raises(StateError, match=r"param group 1\).*step must be a number"):
        opt.step()
    for p, (value, entry) in before.items():
        assert torch.equal(raw(p), raw(value))
        assert same_entry({k: v for k, v in opt.state[p].items() if k != "step"},
                          {k: v for k, v in entry.items() if k != "step"})
    assert float(opt.state[a]["step"]) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_set_fp32_master_refuses_non_finite_values(dtype, bad):
    p, opt = stepped(dtype, master_remainders=True)
    master = opt.fp32_master(p).clone()
    entry = copy.deepcopy(opt.state[p])
    value = master.clone()
    value[17] = bad
    with pytest.raises(ValueError, match=r"parameter 0 \(shape \(700,\).*1 NaN/Inf value.*element 17"):
        opt.set_fp32_master(p, value)
    assert torch.equal(raw(opt.fp32_master(p)), raw(master)) and same_entry(opt.state[p], entry)


def test_a_tensor_listed_twice_is_refused():
    a, b = torch.nn.Parameter(torch.randn(N)), torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=r"appears twice in param group 0 \(positions 0 and 2\)"):
        CoatFP8AdamW([a, b, a])
    with pytest.raises(ValueError, match=r"param group 1 lists a tensor of param group 0 .*position 0"):
        CoatFP8AdamW([{"params": [a]}, {"params": [b, a]}])
    opt = CoatFP8AdamW([a])
    for group in ({"params": [b, b]}, {"params": [a]}):
        with pytest.raises(ValueError, match="twice|lists a tensor"):
            opt.add_param_group(group)
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [b]})
    assert len(opt.param_groups) == 2
