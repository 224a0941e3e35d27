"""Master remainders (OptimizerConfig.master_remainders): a bf16 parameter plus its int16 remainder is the fp32 master
bit for bit, for every fp32 value (all upper halves x the lower halves at the rounding edges); the bf16 half is the
master rounded to nearest with ties away from zero (torch's ties-to-even differs only on exact ties). The torch
reference, the C++ step (the AVX-512 implementation where the CPU has it, and the portable one) and the Triton kernel
(interpreter) step (bf16 parameter, remainder) bit-identically to each other and to the same step on the fp32 master,
over several steps with ragged segments and non-finite gradient groups; CoatFP8AdamW with master_remainders on bf16
parameters trains bit-identically to CoatFP8AdamW on fp32 masters whose bf16 copies are `round_to_bf16`; the
remainders travel through state_dict, torch AdamW's layout, pickle and deepcopy; bad remainder entries are refused."""
import copy
import pickle
import warnings

import pytest
import torch

from coat_kernels.optim import CoatFP8AdamW, OptimizerConfig, StateError, cpu_step
from coat_kernels.optim import dre_reference as ref
from coat_kernels.optim import dre_triton as tri
from coat_kernels.optim import master_remainders as mr
from coat_kernels.optim.grouping import build_layout

warnings.filterwarnings("ignore", category=RuntimeWarning)

N = 6000
SEGMENTS = [(0, 301, 0), (301, 5, 7), (310, 3000, 1_000_003), (3400, 2600, 64)]


def bits(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(
        {2: torch.int16, 4: torch.int32}[t.element_size()])


def fp32_of_bits(b: torch.Tensor) -> torch.Tensor:
    return torch.where(b >= 2 ** 31, b - 2 ** 32, b).to(torch.int32).view(torch.float32)


# ---- the split ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("low", [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
def test_split_then_join_gives_every_fp32_value_back(low):
    master = fp32_of_bits((torch.arange(2 ** 16, dtype=torch.int64) << 16) | low)
    param, remainder = mr.split(master)
    assert param.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    back = mr.join(param, remainder)
    nan = torch.isnan(master)
    assert torch.equal(bits(back)[~nan], bits(master)[~nan])  # infinities and signed zeros included
    assert torch.isnan(back[nan]).all() and not torch.isfinite(param[nan].float()).any()
    # nearest bf16, ties away from zero: torch's ties-to-even differs on exact ties with an even upper half only
    differs = bits(param) != bits(master.to(torch.bfloat16))
    if low == 0x8000:
        upper = torch.arange(2 ** 16)
        assert torch.equal(differs & ~nan, (upper % 2 == 0) & ~nan)
        assert (param.float().abs() > master.abs())[differs & ~nan].all()  # away from zero
    else:
        assert not (differs & ~nan).any()
    assert torch.equal(bits(mr.round_to_bf16(master)), bits(param))


def test_split_keeps_shapes_and_joins_random_values():
    g = torch.Generator().manual_seed(0)
    master = torch.randn(37, 11, generator=g) * torch.exp(torch.randn(37, 11, generator=g) * 20)
    param, remainder = mr.split(master)
    assert param.shape == remainder.shape == master.shape
    assert torch.equal(bits(mr.join(param, remainder)), bits(master))


# ---- the three step implementations -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def portable_library():
    return cpu_step.load(cpu_step.build(extra_flags=("-DCOAT_PORTABLE",)))


def step_inputs(layout, m_cfg, v_cfg):
    g = torch.Generator().manual_seed(3)
    master = torch.randn(N, generator=g) * 0.02
    master[:64] = fp32_of_bits((bits(master[:64]).to(torch.int64) & ~0xFFFF) | 0x8000)  # exact ties
    master[64:70] = torch.tensor([0.0, -0.0, 3.3e38, -3.3e38, 1e-40, -1e-40])
    m = torch.randn(N, generator=g) * 1e-3
    v = m * m * torch.rand(N, generator=g) * 10
    (mq, mm), (vq, vm) = ref.quantize(m, layout, m_cfg), ref.quantize(v, layout, v_cfg)
    return master, mq, mm, vq, vm


def gradient(step, grad_dtype):
    g = torch.Generator().manual_seed(100 + step)
    grad = torch.randn(N, generator=g) * 1e-3
    if step == 2:
        grad[123], grad[4000] = float("nan"), float("inf")
    return grad.to(grad_dtype)


# The Triton kernel's step (about a minute under the interpreter): tests/gpu/test_master_remainders_gpu.py, the same
# comparison with both gradient dtypes and a NaN-skipped group; test_optimizer_with_remainders_trains_like_fp32_masters
# below still runs it interpreted here.
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("implementation", ["cpu_default", "cpu_portable"])
def test_step_implementations_equal_the_fp32_master_step(implementation, grad_dtype, portable_library, monkeypatch):
    if implementation == "cpu_portable":
        monkeypatch.setattr(cpu_step, "library", lambda: portable_library)
    layout = build_layout(SEGMENTS, N, 128)
    m_cfg, v_cfg = ref.DREConfig("e4m3"), ref.DREConfig("e4m3", keep_nonzero=True)
    master, mq, mm, vq, vm = step_inputs(layout, m_cfg, v_cfg)
    param, remainder = mr.split(master)
    fp32 = [t.clone() for t in (master, mq, mm, vq, vm)]  # the oracle: the reference step on the fp32 master
    ours = [t.clone() for t in (param, mq, mm, vq, vm, remainder)]
    for step in (1, 2, 3):
        h = ref.AdamWScalars.make(1e-2, 0.9, 0.95, 1e-8, 0.1, step)
        grad = gradient(step, grad_dtype)
        skipped_fp32 = ref.fused_adamw_step(fp32[0], grad, *fp32[1:], layout, h, m_cfg, v_cfg)
        p, q, qm, w, wm, r = ours
        skipped = int(cpu_step.fused_adamw_step(p, grad, q, qm, w, wm, layout, h, m_cfg, v_cfg, remainder=r))
        assert skipped == int(skipped_fp32) == (2 if step == 2 else 0)
        assert torch.equal(bits(mr.join(p, r)), bits(fp32[0])), f"step {step}: master"
        assert torch.equal(bits(p), bits(mr.round_to_bf16(fp32[0]))), f"step {step}: bf16 parameter"
        for x, y, what in zip(ours[1:5], fp32[1:], ("exp_avg codes", "exp_avg meta", "exp_avg_sq codes",
                                                    "exp_avg_sq meta")):
            assert torch.equal(bits(x), bits(y)), f"step {step}: {what}"


def test_reference_step_with_remainders_equals_the_fp32_master_step():
    layout = build_layout(SEGMENTS, N, 128)
    m_cfg, v_cfg = ref.DREConfig("e5m2", expand=False), ref.DREConfig("e4m3", keep_nonzero=True)
    master, mq, mm, vq, vm = step_inputs(layout, m_cfg, v_cfg)
    param, remainder = mr.split(master)
    fp32 = [t.clone() for t in (master, mq, mm, vq, vm)]
    ours = [t.clone() for t in (param, mq, mm, vq, vm)]
    for step in (1, 2):
        h = ref.AdamWScalars.make(1e-2, 0.9, 0.95, 1e-8, 0.1, step)
        grad = gradient(step, torch.float32)
        ref.fused_adamw_step(fp32[0], grad, *fp32[1:], layout, h, m_cfg, v_cfg)
        ref.fused_adamw_step(ours[0], grad, *ours[1:], layout, h, m_cfg, v_cfg, remainder=remainder)
        assert torch.equal(bits(mr.join(ours[0], remainder)), bits(fp32[0]))
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(ours[1:], fp32[1:]))


# ---- the optimizer -----------------------------------------------------------------------------------------------
SHAPES = [(300, 24), (300,), (7, 300), (129,)]


def initial(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for s in SHAPES]


def train(params, optimizer, steps, start=0):
    """`steps` steps with the same bf16-valued gradients for every run."""
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(10 + step)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(torch.bfloat16).to(p.dtype)
        optimizer.step()
    return params


@pytest.mark.parametrize("backend", ["torch", "auto", "triton"])
def test_optimizer_with_remainders_trains_like_fp32_masters(backend):
    """bf16 params (and one fp32 param in the same group, which keeps no remainder) against fp32 masters."""
    start = initial()
    fp32 = [p.float() for p in start]
    reference = CoatFP8AdamW(fp32, lr=1e-2, weight_decay=0.1, backend="torch")
    params = [p.clone() for p in start[:3]] + [start[3].float()]
    optimizer = CoatFP8AdamW(params, lr=1e-2, weight_decay=0.1, backend=backend, master_remainders=True)
    train(fp32, reference, 3)
    train(params, optimizer, 3)
    for p, q in zip(params, fp32):
        assert torch.equal(bits(optimizer.fp32_master(p)), bits(q))
        expected = mr.round_to_bf16(q) if p.dtype == torch.bfloat16 else q
        assert torch.equal(bits(p), bits(expected))
        for key in ("exp_avg_q", "exp_avg_sq_q", "exp_avg_meta", "exp_avg_sq_meta", "step"):
            assert torch.equal(bits(optimizer.state[p][key]), bits(reference.state[q][key])), key
    assert [("master_remainder" in optimizer.state[p]) for p in params] == [True, True, True, False]
    assert optimizer.state[params[0]]["master_remainder"].dtype == torch.int16
    assert optimizer.state_bytes() - reference.state_bytes() == 2 * sum(p.numel() for p in params[:3])


def test_state_report_counts_the_remainders():
    from coat_kernels.optim import state_report

    params = [torch.zeros(128 * 64, dtype=torch.bfloat16)]
    optimizer = CoatFP8AdamW(params, master_remainders=True)
    optimizer.initialize_state()
    with_remainders = state_report([optimizer])
    optimizer_plain = CoatFP8AdamW([params[0].clone().float()])
    optimizer_plain.initialize_state()
    plain = state_report([optimizer_plain])
    assert abs(with_remainders["bytes_per_element"] - plain["bytes_per_element"] - 2.0) < 1e-9
    assert 4.1 < with_remainders["bytes_per_element"] < 4.2


class QuantizedState(torch.Tensor):
    """A tensor subclass that stores 1-byte codes under an fp32 nominal dtype, as TransformerEngine's Float8Tensor."""

    @staticmethod
    def __new__(cls, codes, scale_inv):
        t = torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32)
        t._data, t._scale_inv = codes, scale_inv
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} on a stand-in quantized state")


def test_state_report_counts_quantized_states_by_what_they_store():
    """TE FusedAdam's FP8 moments (Float8Tensor, nominal fp32) and int16 master remainders, as Megatron's
    precision-aware optimizer keeps them."""
    from coat_kernels.optim import state_report

    p = torch.zeros(1000)
    adam = torch.optim.Adam([p])
    adam.state[p] = {"exp_avg": QuantizedState(torch.zeros(1000, dtype=torch.uint8), torch.ones(1)),
                     "exp_avg_sq": QuantizedState(torch.zeros(1000, dtype=torch.uint8), torch.ones(1)),
                     "master_param": torch.zeros(1000, dtype=torch.int16)}
    report = state_report([adam])
    assert report["state_bytes"] == 1000 + 4 + 1000 + 4 + 2000 and report["stepped_numel"] == 1000


def test_nan_gradient_groups_keep_parameter_and_remainder():
    p = mr.round_to_bf16(torch.randn(512) * 0.1)
    optimizer = CoatFP8AdamW([p], lr=1e-2, master_remainders=True)
    p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    before = p.clone(), optimizer.state[p]["master_remainder"].clone()
    p.grad = torch.full_like(p, 1e-3)
    p.grad[130] = float("nan")
    optimizer.step()
    assert optimizer.skipped_groups == 1
    assert torch.equal(bits(p[128:256]), bits(before[0][128:256]))
    assert torch.equal(optimizer.state[p]["master_remainder"][128:256], before[1][128:256])
    assert not torch.equal(bits(p[:128]), bits(before[0][:128]))


def checkpointed(optimizer_factory, transfer):
    """Train 2 steps, move the optimizer's state into a fresh one with `transfer`, train 2 more, against 4 steps
    uninterrupted: (params, optimizer) of both."""
    params = initial()
    optimizer = optimizer_factory(params)
    train(params, optimizer, 4)
    resumed_params = initial()
    first = optimizer_factory(resumed_params)
    train(resumed_params, first, 2)
    copies = [p.detach().clone() for p in resumed_params]
    fresh = optimizer_factory(copies)
    transfer(first, fresh)
    train(copies, fresh, 2, start=2)
    return (params, optimizer), (copies, fresh)


@pytest.mark.parametrize("transfer", ["state_dict", "torch_adamw_state_dict", "pickle", "deepcopy"])
def test_remainders_survive_checkpoints(transfer):
    def factory(params):
        return CoatFP8AdamW(params, lr=1e-2, weight_decay=0.1, master_remainders=True)

    def move(old, new):
        if transfer == "state_dict":
            new.load_state_dict(old.state_dict())
        elif transfer == "torch_adamw_state_dict":
            sd = old.torch_adamw_state_dict()
            assert sd["state"][0]["master_remainder"].dtype == torch.int16
            assert sd["state"][0]["exp_avg"].dtype == torch.float32
            new.load_state_dict(sd)
        else:
            clone = pickle.loads(pickle.dumps(old)) if transfer == "pickle" else copy.deepcopy(old)
            new.load_state_dict(clone.state_dict())

    (params, optimizer), (copies, fresh) = checkpointed(factory, move)
    for p, q in zip(params, copies):
        assert torch.equal(bits(p), bits(q))
        assert torch.equal(optimizer.state[p]["master_remainder"], fresh.state[q]["master_remainder"])


def test_torch_adamw_cannot_carry_remainders():
    """torch.optim.AdamW casts every state tensor to its bf16 parameter's dtype: such remainders are refused with the
    way out (without them the masters start at the parameters)."""
    params = initial()
    optimizer = CoatFP8AdamW(params, lr=1e-2, master_remainders=True)
    train(params, optimizer, 1)
    adamw = torch.optim.AdamW([p.detach().clone() for p in params])
    adamw.load_state_dict(optimizer.torch_adamw_state_dict())
    sd = adamw.state_dict()
    fresh = CoatFP8AdamW([p.detach().clone() for p in params], master_remainders=True)
    with pytest.raises(StateError, match="casts every state tensor to the parameter's dtype"):
        fresh.load_state_dict(sd)
    for entry in sd["state"].values():
        del entry["master_remainder"]
    fresh.load_state_dict(sd)


def test_set_fp32_master_then_train_like_that_fp32_master():
    g = torch.Generator().manual_seed(5)
    masters = [torch.randn(s, generator=g) * 0.05 for s in SHAPES]
    params = [mr.round_to_bf16(m) for m in masters]
    optimizer = CoatFP8AdamW(params, lr=1e-2, weight_decay=0.1, master_remainders=True)
    for p, m in zip(params, masters):
        p.zero_()
        optimizer.set_fp32_master(p, m)
        assert torch.equal(bits(optimizer.fp32_master(p)), bits(m)) and optimizer.fp32_master(p).shape == p.shape
    fp32 = [m.clone() for m in masters]
    reference = CoatFP8AdamW(fp32, lr=1e-2, weight_decay=0.1)
    train(params, optimizer, 2)
    train(fp32, reference, 2)
    assert all(torch.equal(bits(optimizer.fp32_master(p)), bits(q)) for p, q in zip(params, fp32))
    plain = torch.zeros(4)
    optimizer_fp32 = CoatFP8AdamW([plain], master_remainders=True)
    optimizer_fp32.set_fp32_master(plain, torch.arange(4.0))
    assert torch.equal(plain, torch.arange(4.0)) and optimizer_fp32.fp32_master(plain) is not plain
    with pytest.raises(ValueError, match="5 elements for a tensor of 4"):
        optimizer_fp32.set_fp32_master(plain, torch.zeros(5))


def test_an_entry_without_remainder_starts_its_master_at_the_parameter():
    """A checkpoint from a run without remainders (or torch AdamW's) loads; its masters are the bf16 params."""
    params = initial()
    plain = CoatFP8AdamW([p.clone() for p in params], lr=1e-2)
    train(plain.param_groups[0]["params"], plain, 1)
    optimizer = CoatFP8AdamW(params, lr=1e-2, master_remainders=True)
    optimizer.load_state_dict(plain.state_dict())
    optimizer.initialize_state()
    for p in params:
        assert torch.equal(optimizer.state[p]["master_remainder"], torch.zeros(p.numel(), dtype=torch.int16))
        assert torch.equal(optimizer.fp32_master(p), p.float())


def remainder_state_dict():
    p = initial()[1].clone()
    optimizer = CoatFP8AdamW([p], lr=1e-2, master_remainders=True)
    train([p], optimizer, 1)
    return optimizer.state_dict()


@pytest.mark.parametrize("damage, message", [
    (lambda e: e.update(master_remainder=e["master_remainder"].float()), "must be an int16 tensor of 300"),
    (lambda e: e.update(master_remainder=e["master_remainder"][:-1]), "must be an int16 tensor of 300"),
    (lambda e: e.update(master_remainder=[0] * 300), "must be an int16 tensor"),
])
def test_bad_remainders_are_refused_at_load(damage, message):
    sd = remainder_state_dict()
    damage(sd["state"][0])
    p = initial()[1].clone()
    optimizer = CoatFP8AdamW([p], master_remainders=True)
    with pytest.raises(StateError, match=message):
        optimizer.load_state_dict(sd)
    assert len(optimizer.state) == 0  # left as it was


def test_remainders_need_the_option_and_a_bf16_tensor():
    sd = remainder_state_dict()
    off = CoatFP8AdamW([initial()[1].clone()])
    with pytest.raises(StateError, match="master_remainders is off: turn it on"):
        off.load_state_dict(sd)
    fp32 = CoatFP8AdamW([initial()[1].float()], master_remainders=True)
    with pytest.raises(StateError, match="float32, its own master: only bf16 tensors keep remainders"):
        fp32.load_state_dict(sd)


def test_a_remainder_of_the_wrong_size_is_refused_before_a_step():
    p = initial()[1].clone()
    optimizer = CoatFP8AdamW([p], master_remainders=True)
    train([p], optimizer, 1)
    before = p.clone()
    optimizer.state[p]["master_remainder"] = torch.zeros(7, dtype=torch.int16)
    p.grad = torch.ones_like(p)
    with pytest.raises(StateError, match="master_remainder must be an int16 tensor of 300"):
        optimizer.step()
    assert torch.equal(bits(p), bits(before))


def test_master_remainders_option_is_a_strict_bool():
    assert OptimizerConfig(master_remainders=True).master_remainders
    with pytest.raises(TypeError, match="master_remainders must be a bool"):
        OptimizerConfig(master_remainders="true")
    with pytest.raises(TypeError, match="master_remainders must be a bool"):
        CoatFP8AdamW([torch.zeros(2)], master_remainders=1)


def test_gluon_remainder_kernel_compiles_for_hopper():
    """The CUDA entry point with remainders builds for sm_90 without a GPU (the GPU test runs it)."""
    from gluon_ptx import hopper_ptx

    if tri.gluon is None:
        pytest.skip("this Triton has no Gluon")
    ptx = hopper_ptx("bf16", full=True, remainder=True)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "st.global" in ptx
