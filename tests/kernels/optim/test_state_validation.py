"""Every CoatFP8AdamW state either loads right or fails clearly: malformed entries (shapes, dtypes, segments, NaN
codes, negative second-moment codes, damaged metadata, bad steps, foreign keys, amsgrad) are refused at load with
an error naming the parameter, the key and the problem, leaving the optimizer as it was; the C++ step refuses state
tensors that do not fit its layout before it touches memory (in a subprocess: a crash would kill it); a step that
raises changes nothing; param groups keep their options through torch-format state dicts; 1-element groups export
exactly; DeepSpeed refuses another rank's shard."""
import copy
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
import torch.multiprocessing as mp

from coat_ds import CoatFP8AdamW
from coat_kernels.optim import StateError
from coat_kernels.optim import dre_reference as ref
from coat_kernels.optim.exact_export import export, quantized_equal
from coat_kernels.optim.grouping import build_layout

warnings.filterwarnings("ignore", category=RuntimeWarning)

STATE_KEYS = ("exp_avg_q", "exp_avg_meta", "exp_avg_sq_q", "exp_avg_sq_meta")


def make_model(seed=0):
    torch.manual_seed(seed)
    # parameter 0: weight (300, 24), 7200 elements in 57 groups of 128; 1: bias (300,); 2: (7, 300); 3: (7,)
    return torch.nn.Sequential(torch.nn.Linear(24, 300), torch.nn.Linear(300, 7))


def set_grads(params, step):
    g = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * torch.exp(torch.randn(p.shape, generator=g) * 2) * 1e-3


def trained(steps=2, model=None, **options):
    model = model or make_model()
    opt = CoatFP8AdamW(model.parameters(), lr=1e-3, **options)
    for step in range(steps):
        set_grads(list(model.parameters()), step)
        opt.step()
    return model, opt


def raw(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32) if t.dtype == torch.float32 else t


def snapshot(opt):
    """Bits of every state tensor and the param groups' values: what a refused load or step must leave alone."""
    state = {i: {k: raw(v).clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
             for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    params = [raw(p.detach()).clone() for g in opt.param_groups for p in g["params"]]
    return state, groups, params


def same(a, b):
    (sa, ga, pa), (sb, gb, pb) = a, b
    if ga != gb or len(pa) != len(pb) or not all(torch.equal(x, y) for x, y in zip(pa, pb)) or sa.keys() != sb.keys():
        return False
    for i in sa:
        if sa[i].keys() != sb[i].keys():
            return False
        for k in sa[i]:
            x, y = sa[i][k], sb[i][k]
            if torch.is_tensor(x) != torch.is_tensor(y):
                return False
            if not (torch.equal(x, y) if torch.is_tensor(x) else x == y):
                return False
    return True


# ---- malformed entries are refused at load -------------------------------------------------------------------
def _flip_one_percent(entry):
    g = torch.Generator().manual_seed(0)
    for key in ("exp_avg_q", "exp_avg_sq_q"):
        codes = entry[key].view(torch.uint8)
        index = torch.randperm(codes.numel(), generator=g)[:codes.numel() // 100]
        codes[index] = torch.randint(0, 256, (len(index),), dtype=torch.uint8, generator=g)


def _set_code(key, byte):
    def corrupt(entry):
        entry[key].view(torch.uint8)[777] = byte
    return corrupt


def _set_meta(row, value, key="exp_avg_sq_meta"):
    def corrupt(entry):
        entry[key][row, 5] = value
    return corrupt


def _assign(key, make):
    def corrupt(entry):
        entry[key] = make(entry)
    return corrupt


CORRUPTIONS = {
    # shapes and dtypes (the C++ step would read and write past these)
    "v meta with fewer groups": (_assign("exp_avg_sq_meta", lambda e: e["exp_avg_sq_meta"][:, :40].clone()),
                                 r"exp_avg_sq_meta is torch.float32 \(3, 40\).*need torch.float32 \(3, 57\)"),
    "v codes cut short": (_assign("exp_avg_sq_q", lambda e: e["exp_avg_sq_q"][:5000].clone()),
                          r"exp_avg_sq_q has shape \(5000,\), the tensor needs \(7200,\)"),
    "m meta one group short": (_assign("exp_avg_meta", lambda e: e["exp_avg_meta"][:, :-1].clone()),
                               r"exp_avg_meta is torch.float32 \(3, 56\)"),
    "m meta transposed": (_assign("exp_avg_meta", lambda e: e["exp_avg_meta"].t().contiguous()),
                          r"exp_avg_meta is torch.float32 \(57, 3\)"),
    "codes upcast to fp32": (_assign("exp_avg_q", lambda e: e["exp_avg_q"].float()),
                             r"exp_avg_q holds torch.float32.*converted"),
    "codes in the other format": (_assign("exp_avg_q", lambda e: e["exp_avg_q"].float().to(torch.float8_e5m2)),
                                  r"exp_avg_q holds torch.float8_e5m2, the param group's exp_avg_format is e4m3"),
    "metadata in bf16": (_assign("exp_avg_meta", lambda e: e["exp_avg_meta"].bfloat16()), r"exp_avg_meta is torch.bf"),
    "group size edited": (_assign("group_size", lambda e: 64), r"groups of 64, the param group's group_size is 128"),
    "group size a float": (_assign("group_size", lambda e: 128.0), r"group_size must be a positive int"),
    # segments
    "segments of another partition": (_assign("segments", lambda e: torch.tensor([[0, 7200, 128]])),
                                      r"segments \[\[0, 7200, 128\]\] differ from this tensor's \[\[0, 7200, 0\]\]"),
    "segments past the tensor": (_assign("segments", lambda e: torch.tensor([[0, 7300, 0]])),
                                 r"segments do not fit a tensor of 7200 elements"),
    "segments as floats": (_assign("segments", lambda e: e["segments"].double()), r"segments must be an int64"),
    # values
    "NaN code 0x7F": (_set_code("exp_avg_q", 0x7F), r"exp_avg_q holds 1 non-finite \(NaN\) codes.*element 777"),
    "NaN code 0xFF": (_set_code("exp_avg_q", 0xFF), r"exp_avg_q holds 1 non-finite"),
    "NaN second-moment code": (_set_code("exp_avg_sq_q", 0x7F), r"exp_avg_sq_q holds 1 negative or non-finite"),
    "negative second-moment code": (_set_code("exp_avg_sq_q", 0x85), r"exp_avg_sq_q holds 1 negative.*0x85"),
    "1% of code bytes flipped": (_flip_one_percent, r"_q holds \d+ .*codes are damaged"),
    "NaN metadata": (_set_meta(1, float("nan")), r"exp_avg_sq_meta gives 1 of 57 .* NaN/Inf metadata .*group 5"),
    "Inf metadata": (_set_meta(2, float("inf"), "exp_avg_meta"), r"exp_avg_meta gives 1 of 57 .* NaN/Inf metadata"),
    "k = 0": (_set_meta(0, 0.0), r"expansion exponent k outside \[1/16, 16\]"),
    "k above k_max": (_set_meta(0, 17.0), r"expansion exponent k outside"),
    "center far outside fp32": (_set_meta(1, 1e6), r"metadata decoding outside fp32's range"),
    "step NaN": (_assign("step", lambda e: torch.tensor(float("nan"))), r"step is nan"),
    "step negative": (_assign("step", lambda e: torch.tensor(-1.0)), r"step is -1.0"),
    "step a vector": (_assign("step", lambda e: torch.zeros(3)), r"step must be a number or a one-element tensor"),
    # keys
    "missing metadata": (lambda e: e.pop("exp_avg_sq_meta"), r"lacks \['exp_avg_sq_meta'\]"),
    "unknown key": (_assign("momentum_buffer", lambda e: torch.zeros(3)), r"unknown state key\(s\) \['momentum_buff"),
    "amsgrad state": (_assign("max_exp_avg_sq", lambda e: torch.zeros(7200)), r"max_exp_avg_sq.*amsgrad"),
    "one fp32 moment beside the codes": (_assign("exp_avg", lambda e: torch.zeros(7200)),
                                         r"holds \['exp_avg'\] but needs both"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_malformed_entry_is_refused_at_load_and_the_optimizer_is_unchanged(case):
    corrupt, match = CORRUPTIONS[case]
    _, source = trained(2)
    saved = copy.deepcopy(source.state_dict())
    corrupt(saved["state"][0])
    model, target = trained(1, make_model(1))
    before = snapshot(target)
    with pytest.raises(StateError, match=match) as info:
        target.load_state_dict(saved)
    assert "parameter 0 (shape (300, 24), param group 0)" in str(info.value)
    assert same(snapshot(target), before)
    target.load_state_dict(source.state_dict())  # the undamaged state still loads and steps
    set_grads(list(model.parameters()), 5)
    target.step()


TORCH_FORMAT_CORRUPTIONS = {
    "NaN fp32 moment": (lambda e: e["exp_avg"].view(-1).__setitem__(9, float("nan")),
                        r"exp_avg holds nan at element 9"),
    "Inf fp32 moment": (lambda e: e["exp_avg_sq"].view(-1).__setitem__(3, float("inf")), r"exp_avg_sq holds inf"),
    "negative fp32 second moment": (lambda e: e["exp_avg_sq"].view(-1).__setitem__(4, -0.5),
                                    r"exp_avg_sq holds -0.5 at element 4 \(second moments are finite and >= 0\)"),
    "fp32 moment of another size": (_assign("exp_avg", lambda e: torch.zeros(7000)),
                                    r"exp_avg has 7000 elements \(7000,\), the tensor 7200"),
    "fp32 moments without step": (lambda e: e.pop("step"), r"lacks \['step'\]"),
}


@pytest.mark.parametrize("case", list(TORCH_FORMAT_CORRUPTIONS))
def test_malformed_torch_format_entry_is_refused_at_load(case):
    corrupt, match = TORCH_FORMAT_CORRUPTIONS[case]
    _, source = trained(2)
    saved = copy.deepcopy(source.torch_adamw_state_dict())
    corrupt(saved["state"][0])
    _, target = trained(1, make_model(1))
    before = snapshot(target)
    with pytest.raises(StateError, match=match) as info:
        target.load_state_dict(saved)
    assert "parameter 0 (shape (300, 24), param group 0)" in str(info.value)
    assert same(snapshot(target), before)


def test_bad_param_groups_and_ids_are_refused_at_load():
    _, source = trained(1)
    _, target = trained(1, make_model(1))
    before = snapshot(target)
    for edit, match in ((lambda sd: sd["param_groups"][0].update(group_size="128"), "group_size must be an integer"),
                        (lambda sd: sd["param_groups"][0].update(exp_avg_format="e3m4"), "exp_avg_format must be"),
                        (lambda sd: sd["param_groups"][0].update(maximize=True), "maximize=True"),
                        (lambda sd: sd["state"].__setitem__(9, sd["state"][0]), "parameter id 9")):
        saved = copy.deepcopy(source.state_dict())
        edit(saved)
        with pytest.raises(StateError, match=match):
            target.load_state_dict(saved)
        assert same(snapshot(target), before)


def test_torch_adamw_with_amsgrad_is_refused():
    model = make_model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)
    set_grads(list(model.parameters()), 0)
    adamw.step()
    opt = CoatFP8AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(StateError, match=r"amsgrad=True, which CoatFP8AdamW does not support.*torch.optim.AdamW"):
        opt.load_state_dict(adamw.state_dict())
    assert not opt.state


def test_pickled_optimizer_with_damaged_codes_is_refused():
    _, opt = trained(1)
    p = opt.param_groups[0]["params"][1]
    opt.state[p]["exp_avg_sq_q"].view(torch.uint8)[7] = 0xFF
    blob = pickle.dumps(opt)
    with pytest.raises(StateError, match=r"parameter 1 \(shape \(300,\), param group 0\): exp_avg_sq_q holds 1"):
        pickle.loads(blob)


def test_set_fp32_moments_refuses_bad_values_and_keeps_the_state():
    model, opt = trained(1)
    p = list(model.parameters())[2]
    before = snapshot(opt)
    bad = torch.zeros(p.numel())
    bad[11] = float("nan")
    for m, v, match in ((bad, torch.zeros(p.numel()), "NaN/Inf values"), (torch.zeros(p.numel()), -bad.nan_to_num(1.0),
                                                                           "negative values")):
        with pytest.raises(StateError, match=rf"parameter 2 \(shape \(7, 300\), param group 0\).*{match}"):
            opt.set_fp32_moments(p, m, v)
        assert same(snapshot(opt), before)
    with pytest.raises(StateError, match="step is nan"):
        opt.set_fp32_moments(p, torch.zeros(p.numel()), torch.zeros(p.numel()), step=float("nan"))
    assert same(snapshot(opt), before)


def test_validation_scans_large_states_once_per_load_not_per_step(monkeypatch):
    """The value scans run at load; a step checks dtypes and shapes only."""
    from coat_kernels.optim import validation

    model, opt = trained(1)
    calls = []
    original = validation.scan_values
    monkeypatch.setattr(validation, "scan_values", lambda *a: calls.append(1) or original(*a))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert len(calls) == 4
    for step in range(3):
        set_grads(list(model.parameters()), step)
        opt.step()
    assert len(calls) == 4


# ---- the C++ step refuses state tensors that do not fit (a subprocess: a crash would kill it) -------------------
STEP_SCRIPT = r"""
import sys
import torch
from coat_kernels.optim import CoatFP8AdamW, StateError, cpu_step

assert cpu_step.library() is not None, "the C++ step must be built for this test"
case = sys.argv[1]
torch.manual_seed(0)
p = torch.nn.Parameter(torch.randn(3000) * 0.02)
opt = CoatFP8AdamW([p], lr=1e-2)
p.grad = torch.randn(3000) * 1e-3
opt.step()  # the plan is made and kept: the corruption below happens between steps
st = opt.state[p]
if case == "v meta with fewer groups":
    st["exp_avg_sq_meta"] = st["exp_avg_sq_meta"][:, :10].clone()
elif case == "v codes cut short":
    st["exp_avg_sq_q"] = st["exp_avg_sq_q"][:100].clone()
elif case == "m meta one group short":
    st["exp_avg_meta"] = st["exp_avg_meta"][:, :-1].clone()
elif case == "m meta transposed":
    st["exp_avg_meta"] = st["exp_avg_meta"].t().contiguous()
before = [p.detach().clone(), st["step"].clone()] + [st[k].view(torch.uint8) if st[k].element_size() == 1 else st[k]
                                                       for k in ("exp_avg_q", "exp_avg_sq_q")]
before = [t.clone() for t in before]
p.grad = torch.randn(3000) * 1e-3
try:
    opt.step()
except StateError as exc:
    print("refused:", exc)
after = [p.detach(), st["step"]] + [st[k].view(torch.uint8) if st[k].element_size() == 1 else st[k]
                                     for k in ("exp_avg_q", "exp_avg_sq_q")]
assert all(torch.equal(a, b) for a, b in zip(before, after)), "the refused step changed the state"
print("unchanged")
# the C++ step's own entry, called directly with the same tensors
from coat_kernels.optim import dre_reference as ref
from coat_kernels.optim.grouping import build_layout
layout = build_layout(None, 3000, 128)
m_cfg, v_cfg = ref.DREConfig("e4m3"), ref.DREConfig("e4m3", keep_nonzero=True)
h = ref.AdamWScalars.make(1e-3, 0.9, 0.95, 1e-8, 0.1, 3)
try:
    cpu_step.fused_adamw_step(p.detach(), p.grad, st["exp_avg_q"], st["exp_avg_meta"], st["exp_avg_sq_q"],
                              st["exp_avg_sq_meta"], layout, h, m_cfg, v_cfg)
except ValueError as exc:
    print("cpu step refused:", exc)
"""


@pytest.mark.parametrize("case", ["v meta with fewer groups", "v codes cut short", "m meta one group short",
                                  "m meta transposed"])
def test_cpu_step_refuses_state_tensors_that_do_not_fit(case):
    proc = subprocess.run([sys.executable, "-c", STEP_SCRIPT, case], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "refused: CoatFP8AdamW state of parameter 0 (shape (3000,), param group 0): exp_avg" in proc.stdout
    assert "unchanged" in proc.stdout and "cpu step refused: the CPU step: " in proc.stdout, proc.stdout


@pytest.mark.parametrize("case", ["v meta with fewer groups", "v codes cut short", "m meta one group short",
                                  "m meta transposed"])
def test_torch_backend_refuses_the_same_tensors_naming_the_state(case):
    p = torch.nn.Parameter(torch.randn(3000) * 0.02)
    opt = CoatFP8AdamW([p], lr=1e-2, backend="torch")
    p.grad = torch.randn(3000) * 1e-3
    opt.step()
    st = opt.state[p]
    key, make = {"v meta with fewer groups": ("exp_avg_sq_meta", lambda t: t[:, :10].clone()),
                 "v codes cut short": ("exp_avg_sq_q", lambda t: t[:100].clone()),
                 "m meta one group short": ("exp_avg_meta", lambda t: t[:, :-1].clone()),
                 "m meta transposed": ("exp_avg_meta", lambda t: t.t().contiguous())}[case]
    st[key] = make(st[key])
    before = snapshot(opt)
    with pytest.raises(StateError, match=rf"parameter 0 \(shape \(3000,\), param group 0\): {key}"):
        opt.step()
    assert same(snapshot(opt), before)


# ---- a step that raises changes nothing -----------------------------------------------------------------------
def test_nan_fp32_moments_fail_every_step_and_change_nothing():
    """fp32 moments written straight into the state (DeepSpeed's universal-checkpoint loader does) are checked when
    quantized: NaN raises at every step, and no step runs on zeroed moments."""
    model = make_model()
    params = list(model.parameters())
    opt = CoatFP8AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3)
    set_grads(params, 0)
    opt.step()
    moments = opt.fp32_moments(params[3])
    moments["exp_avg"][2] = float("nan")
    opt.state[params[3]].update(moments)  # group 1: its first group steps first, then this one fails
    before = snapshot(opt)
    for step in (1, 2):
        set_grads(params, step)
        with pytest.raises(StateError, match=r"parameter 3 \(shape \(7,\), param group 1\): cannot quantize a moment"):
            opt.step()
        assert same(snapshot(opt), before)


def test_failed_step_in_a_later_group_leaves_earlier_groups_alone():
    model = make_model()
    params = list(model.parameters())
    opt = CoatFP8AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3)
    set_grads(params, 0)
    opt.step()
    opt.param_groups[1]["betas"] = (0.9, 1.5)
    before = snapshot(opt)
    set_grads(params, 1)
    with pytest.raises(ValueError, match="hyper-parameters"):
        opt.step()
    assert same(snapshot(opt), before)
    opt.param_groups[1]["betas"] = (0.9, 0.999)
    opt.step()
    assert all(float(opt.state[p]["step"]) == 2 for p in params)


def test_large_groups_on_cpu_step_with_the_reference():
    """The C++ step takes groups of up to 1024 elements; larger ones are stepped by the torch reference (same
    bits) instead of failing at every step."""
    a, b = make_model(), make_model()
    fast = CoatFP8AdamW(a.parameters(), lr=1e-3, group_size=2048)
    slow = CoatFP8AdamW(b.parameters(), lr=1e-3, group_size=2048, backend="torch")
    for step in range(2):
        set_grads(list(a.parameters()), step)
        set_grads(list(b.parameters()), step)
        fast.step()
        slow.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(raw(p.detach()), raw(q.detach())) and float(fast.state[p]["step"]) == 2
        assert all(torch.equal(raw(fast.state[p][k]), raw(slow.state[q][k])) for k in STATE_KEYS)


def test_group_size_the_triton_backend_cannot_take_is_refused_when_set():
    with pytest.raises(ValueError, match="backend='triton' needs a power-of-two group_size"):
        CoatFP8AdamW([torch.nn.Parameter(torch.randn(8))], backend="triton", group_size=100)


# ---- options and exactness through torch-format state dicts ----------------------------------------------------
def test_torch_format_round_trip_keeps_every_groups_options():
    model = make_model()
    params = list(model.parameters())
    own = dict(group_size=64, exp_avg_format="e5m2", exp_avg_sq_format="e5m2", expand_exp_avg=False,
               expand_exp_avg_sq=False, k_max=8.0)
    opt = CoatFP8AdamW([{"params": params[:2], **own}, {"params": params[2:]}], lr=1e-3)
    for step in range(3):
        set_grads(params, step)
        opt.step()
    saved = opt.torch_adamw_state_dict()
    clone = copy.deepcopy(model)
    cparams = list(clone.parameters())
    back = CoatFP8AdamW([{"params": cparams[:2]}, {"params": cparams[2:]}], lr=1e-3)  # the default options
    back.load_state_dict(saved)
    back.initialize_state()
    for key, value in own.items():
        assert back.param_groups[0][key] == value and opt.param_groups[1][key] == back.param_groups[1][key], key
    for p, q in zip(params, clone.parameters()):
        a, b = opt.state[p], back.state[q]
        assert a["exp_avg_q"].dtype == b["exp_avg_q"].dtype and a["group_size"] == b["group_size"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert quantized_equal(a[key + "_q"], a[key + "_meta"], b[key + "_q"], b[key + "_meta"]), key
    for step in (3, 4):
        set_grads(params, step)
        set_grads(list(clone.parameters()), step)
        opt.step()
        back.step()
    assert all(torch.equal(p, q) for p, q in zip(params, clone.parameters()))


def test_one_element_groups_export_exactly():
    """A group of one element (a scalar parameter), or with one nonzero element: the same element carries the
    group's largest and smallest magnitudes."""
    g = torch.Generator().manual_seed(0)
    n = 300
    for cfg in (ref.DREConfig("e4m3"), ref.DREConfig("e5m2", keep_nonzero=True)):
        for layout, x in ((build_layout([(i, 1, 0) for i in range(n)], n, 128), torch.randn(n, generator=g)),
                          (build_layout(None, 128 * n, 128), torch.zeros(128 * n))):
            if x.numel() > n:
                x[::128] = torch.randn(n, generator=g)
            x = x * torch.exp(torch.randn(x.numel(), generator=g) * 4)
            codes, meta = ref.quantize(x, layout, cfg)
            values, failed = export(codes, meta, layout, cfg)
            assert failed == 0
            assert quantized_equal(codes, meta, *ref.quantize(values, layout, cfg))


def test_scalar_parameters_resume_bit_exactly_through_torch_format():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(())) for _ in range(12)] + [torch.nn.Parameter(torch.randn(300))]
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = CoatFP8AdamW(params, lr=1e-2)
    for step in range(5):
        set_grads(params, step)
        opt.step()
    back = CoatFP8AdamW(clones, lr=1e-2)
    for p, q in zip(params, clones):
        q.data.copy_(p.detach())
    back.load_state_dict(opt.torch_adamw_state_dict())
    for step in range(5, 10):
        set_grads(params, step)
        set_grads(clones, step)
        opt.step()
        back.step()
    assert all(torch.equal(p, q) for p, q in zip(params, clones))


# ---- DeepSpeed: another rank's shard ---------------------------------------------------------------------------
def test_deepspeed_refuses_another_ranks_shard_and_damaged_shards(tmp_path):
    import ds_state_validation_job as job

    ck = tmp_path / "ck"
    ck.mkdir()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    mp.spawn(job.worker, args=(2, str(tmp_path / "rdzv"), str(ck)), nprocs=2, join=True)
    assert sorted(p.name for p in ck.glob("refused_*")) == [f"refused_{case}_rank{r}" for case in
                                                            ("z2_damaged", "z2_swapped", "z3_swapped") for r in (0, 1)]


def test_universal_conversion_refuses_damaged_entries():
    """coat_ds.to_universal dequantizes every entry of a checkpoint shard: a damaged one stops the conversion."""
    from coat_ds.to_universal import expand_states

    _, opt = trained(1, group_size=64)
    shard = {"optimizer_state_dict": {"base_optimizer_state": copy.deepcopy(opt.state_dict())}}
    found = []
    converted = expand_states(shard, found, where="shard.pt")
    assert len(found) == 4 and set(converted["optimizer_state_dict"]["base_optimizer_state"]["state"][1]) == {
        "step", "exp_avg", "exp_avg_sq"}
    shard["optimizer_state_dict"]["base_optimizer_state"]["state"][1]["exp_avg_meta"][0, 2] = 0.0
    with pytest.raises(StateError, match=r"shard.pt, parameter 1: exp_avg_meta gives 1 of 5 .* k outside"):
        expand_states(shard, where="shard.pt")


def test_state_tensors_on_another_device_are_refused():
    p = torch.nn.Parameter(torch.randn(300))
    opt = CoatFP8AdamW([p], lr=1e-2)
    p.grad = torch.randn(300)
    opt.step()
    opt.state[p]["exp_avg_sq_meta"] = opt.state[p]["exp_avg_sq_meta"].to("meta")
    with pytest.raises(StateError, match=r"parameter 0 \(shape \(300,\), param group 0\): exp_avg_sq_meta is on meta"):
        opt.step()
    assert float(opt.state[p]["step"]) == 1
