"""`--optimizer muon --coat-optimizer`: Megatron-core's own Muon with its momentum in FP8 (coat_megatron.muon), CPU.

Needs NVIDIA's emerging_optimizers package, which Megatron's Muon is built on and which is on no package index
(megatron-core installs it from its git repository: v0.1.0 for megatron-core 0.16/0.17). Without it these tests skip;
to run them: `pip install --no-deps absl-py <Emerging-Optimizers checkout at v0.1.0>`.

The multi-process checks run once, in one spawned two-rank gloo job (tests/jobs/megatron_muon_job.py, about 110 s on
2 cores): Megatron's own `get_megatron_muon_optimizer` on a 3-layer GPT in Megatron's DDP, layer-wise (DP=2) and at
TP=2 with `--muon-tp-mode duplicated`. The oracles are Megatron's classes: its own Muon run, and the TensorParallelMuon
object Megatron built, replaying every step. The single-process tests step CoatTensorParallelMuon against a
TensorParallelMuon built in the test.
"""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("emerging_optimizers", reason="Megatron's Muon needs NVIDIA's emerging_optimizers package (not "
                                                   "on the package index): see this module's docstring")
from rank_helpers import run_job  # noqa: E402

MUON_UPDATE_TOL_ALL = 0.08  # relative L2 error of all parameters' 3-step updates together (measured 0.053-0.060)
# one matrix: the attention output projections, whose Newton-Schulz output moves most with a 1.6% momentum error
# (measured worst 0.140; the other matrices <= 0.082, Adam's parameters <= 0.045)
MUON_UPDATE_TOL_ONE = 0.2
RUNS = ("layer_wise", "tp2")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_job("megatron_muon_job.py", tmp_path_factory.mktemp("megatron_muon_job"), timeout=600)


# ---- against Megatron's own Muon (two ranks) ---------------------------------------------------------------------
@pytest.mark.parametrize("run", RUNS)
def test_fp32_state_steps_exactly_like_megatrons_muon(job, run):
    """The same steps (batches of matrices, the momentum handed to Megatron's step and taken back) with Megatron's
    own fp32 momentum: every parameter bit for bit after 3 steps, the layer-wise all-gather and TP=2's gathered
    Newton-Schulz included."""
    for rank in job:
        arms = rank[f"{run}_arms"]
        assert arms["fp32"]["inner"] == "CoatTensorParallelMuon"
        assert arms["fp32"]["losses"] == arms["losses"]
        assert arms["fp32"]["model_params_differing"] == [] and arms["fp32"]["main_params_differing"] == []


@pytest.mark.parametrize("run", RUNS)
def test_fp8_step_is_megatrons_step_on_the_dequantized_momentum(job, run):
    """Every step of the FP8 run replayed by Megatron's own TensorParallelMuon on copies of the matrices, from the
    decoded FP8 momentum with the same gradients: parameters bit for bit, and Megatron's new momentum quantizes to
    exactly the stored codes and metadata."""
    for rank in job:
        r = rank[f"{run}_fp8"]
        assert r["inners"] == ["CoatTensorParallelMuon", "MegatronCoatFP8AdamW"]
        assert r["lockstep_steps"] == 3 and r["lockstep_mismatches"] == []
        assert r["lockstep_matrices_stepped"] == 3 * r["muon_matrices"] > 0  # every matrix of the rank, every step
        assert r["skipped_matrices"] == 0


def test_layer_wise_ranks_step_whole_matrices_covering_the_model_once(job):
    for rank in job:
        r = rank["layer_wise_fp8"]
        assert r["muon_numel_all_ranks"] == r["model_matrix_numel"]
        assert 0 < r["muon_numel"] < r["model_matrix_numel"]


@pytest.mark.parametrize("run", RUNS)
def test_fp8_momentum_tracks_megatrons_muon(job, run):
    """FP8 momentum alone (Megatron's Adam) and the whole COAT optimizer (CoatFP8AdamW for the rest) against Megatron's
    run: the 3-step update of every parameter."""
    for rank in job:
        for result in (rank[f"{run}_arms"]["fp8"], rank[f"{run}_fp8"]):
            assert result["update_rel_err_all"] < MUON_UPDATE_TOL_ALL
            worst = max(result["update_rel_err"], key=result["update_rel_err"].get)
            assert result["update_rel_err"][worst] < MUON_UPDATE_TOL_ONE, (worst, result["update_rel_err"][worst])
        assert rank[f"{run}_fp8"]["momentum_rel_err"] < 0.03  # decoded FP8 momentum vs Megatron's fp32 one


@pytest.mark.parametrize("run", RUNS)
def test_momentum_state_is_fp8_at_about_1_1_bytes_per_element(job, run):
    for rank in job:
        r = rank[f"{run}_fp8"]
        assert r["codes"] == ["torch.float8_e4m3fn"]
        assert r["entry_keys"] == ["exp_avg_meta", "exp_avg_q", "group_size", "segments", "step"]
        # per matrix of n elements: n E4M3 codes, 12 bytes of metadata per group of 128, a segment row (3 int64) and
        # an fp32 step (Megatron's Muon: 4 bytes per element)
        numels = r["muon_matrix_numels"]
        assert sum(numels) == r["muon_numel"]
        assert r["muon_state_bytes"] == sum(n + 12 * -(-n // 128) + 3 * 8 + 4 for n in numels)


def test_checkpoints_round_trip_and_interchange_with_megatrons_muon(job):
    for rank in job:
        c = rank["checkpoints"]
        # dist_checkpointing through the layer-wise optimizer's sharded state dict: FP8 state back bit for bit
        assert c["coat_to_coat"] == {"params_exact": True, "momentum_exact": True, "momentum_rel_err": 0.0,
                                     "fp8_exact": True, "adam_exact": True}
        # torch's state dict holds Megatron's Muon layout and loads back bit for bit
        assert c["torch_format"] == {"keys": ["momentum_buffer"], "layout_matches": True, "fp8_exact": True}
        # Megatron's own Muon reads the fp32 momentum COAT exports; COAT quantizes Megatron's on load
        assert c["coat_to_megatron"]["params_exact"] and c["coat_to_megatron"]["momentum_exact"]
        assert c["megatron_to_coat"]["params_exact"] and c["megatron_to_coat"]["fp8"]
        assert c["megatron_to_coat"]["momentum_rel_err"] < 0.03
        resumed = c["resumed_vs_uninterrupted"]
        assert resumed["losses"][0] == resumed["losses"][1]
        assert resumed["params_differing"] == [] and resumed["fp8_exact"]


# ---- one process: the optimizer itself -------------------------------------------------------------------------
SHAPES = ((64, 32), (32, 96), (128, 64))
OPTIONS = dict(lr=0.02, weight_decay=0.1, num_ns_steps=5)


def megatron_muon(params):
    from coat_megatron.muon import TensorParallelMuon

    return TensorParallelMuon([{"params": params}], **OPTIONS)


def matrices(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def set_grads(params, seed, nan_in=None):
    g = torch.Generator().manual_seed(100 + seed)
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=g)
        if i == nan_in:
            p.grad[0, 0] = float("nan")


def fp8_entries(opt, params):
    return [(opt.state[p]["exp_avg_q"].view(torch.uint8).clone(), opt.state[p]["exp_avg_meta"].clone())
            for p in params]


def test_fp32_state_equals_megatrons_muon_in_one_process():
    from coat_megatron.muon import CoatTensorParallelMuon

    ref, mine = matrices(), matrices()
    ref_opt = megatron_muon(ref)
    opt = CoatTensorParallelMuon.adopt(megatron_muon(mine), state_dtype="fp32")
    for step in range(4):
        set_grads(ref, step)
        set_grads(mine, step)
        ref_opt.step()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(mine, ref))
    assert all(torch.equal(opt.state[a]["momentum_buffer"], ref_opt.state[b]["momentum_buffer"])
               for a, b in zip(mine, ref))
    assert opt.state_dict()["state"].keys() == ref_opt.state_dict()["state"].keys()


def test_batches_of_matrices_give_the_same_bits_and_hooks_run_once_per_step(monkeypatch):
    """Momenta are (de)quantized per batch of at most MAX_BATCH_NUMEL elements; any split gives the same bits, and
    the optimizer's step hooks run once per step, not once per batch."""
    from coat_kernels.optim import moment_batch
    from coat_megatron.muon import CoatTensorParallelMuon

    one, many = matrices(), matrices()
    opt_one = CoatTensorParallelMuon.adopt(megatron_muon(one))
    opt_many = CoatTensorParallelMuon.adopt(megatron_muon(many))
    calls = []
    opt_many.register_step_post_hook(lambda *args: calls.append(1))
    for step in range(3):
        set_grads(one, step)
        set_grads(many, step)
        opt_one.step()
        monkeypatch.setattr(moment_batch, "MAX_BATCH_NUMEL", 5000)  # every matrix a batch of its own
        opt_many.step()
        monkeypatch.undo()
    assert len(calls) == 3
    assert len(opt_many._moment_batches) == 3 and len(opt_one._moment_batches) == 1
    assert all(torch.equal(a, b) for a, b in zip(one, many))
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
               for x, y in zip(fp8_entries(opt_one, one), fp8_entries(opt_many, many)))


def test_a_non_finite_gradient_keeps_the_fp8_momentum():
    """The parameter gets what Megatron's step gives it (NaN, as in Megatron's Muon); the momentum, which FP8 cannot
    hold as NaN, keeps its last value and the matrix is counted. The other matrices step as usual."""
    from coat_megatron.muon import CoatTensorParallelMuon

    ref, mine = matrices(), matrices()
    ref_opt = megatron_muon(ref)
    opt = CoatTensorParallelMuon.adopt(megatron_muon(mine))
    set_grads(mine, 0)
    opt.step()
    before = fp8_entries(opt, mine)
    set_grads(mine, 1, nan_in=1)
    opt.step()
    after = fp8_entries(opt, mine)
    assert opt.skipped_matrices == 1
    assert torch.equal(after[1][0], before[1][0]) and torch.equal(after[1][1], before[1][1])
    assert not torch.equal(after[0][0], before[0][0]) and not torch.equal(after[2][0], before[2][0])
    assert torch.isnan(mine[1]).all() and torch.isfinite(mine[0]).all()  # Newton-Schulz spreads the NaN
    set_grads(ref, 0)
    ref_opt.step()
    set_grads(ref, 1, nan_in=1)
    ref_opt.step()
    assert torch.isnan(ref[1]).all() and torch.isnan(ref_opt.state[ref[1]]["momentum_buffer"]).any()


def test_load_refuses_bad_entries_and_leaves_the_optimizer_as_it_was():
    from coat_kernels.optim import StateError
    from coat_megatron.muon import CoatTensorParallelMuon

    params = matrices()
    opt = CoatTensorParallelMuon.adopt(megatron_muon(params))
    set_grads(params, 0)
    opt.step()
    good = opt.state_dict()
    before = fp8_entries(opt, params)
    bad_entries = [
        ({"momentum_buffer": torch.zeros(5)}, "finite tensor of the matrix's 2048 elements"),
        ({"momentum_buffer": torch.full(SHAPES[0], float("nan"))}, "holding NaN/Inf"),
        ({"exp_avg_q": torch.zeros(2048, dtype=torch.uint8)}, "holds \\['exp_avg_q'\\]"),
    ]
    for entry, message in bad_entries:
        bad = {**good, "state": {**good["state"], 0: entry}}
        with pytest.raises(StateError, match=message):
            opt.load_state_dict(bad)
        after = fp8_entries(opt, params)
        assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(after, before))
    with pytest.raises(StateError, match="names no matrix"):
        opt.load_state_dict({**good, "state": {**good["state"], 7: {"momentum_buffer": torch.zeros(4)}}})
    # a state without entries (Megatron's Muon before its first step) loads as zero momenta
    opt.load_state_dict({**good, "state": {}})
    assert all(not opt.fp32_momentum(p).any() for p in params)


def test_megatrons_momenta_are_carried_over_when_adopted():
    from coat_megatron.muon import CoatTensorParallelMuon

    params = matrices()
    megatron = megatron_muon(params)
    set_grads(params, 0)
    megatron.step()
    momenta = [megatron.state[p]["momentum_buffer"].clone() for p in params]
    opt = CoatTensorParallelMuon.adopt(megatron)
    for p, m in zip(params, momenta):
        assert ((opt.fp32_momentum(p) - m).norm() / m.norm()).item() < 0.03


def test_refused_settings():
    from coat_kernels.optim import OptimizerConfig
    from coat_megatron.muon import CoatTensorParallelMuon, TensorParallelMuon
    from coat_megatron.optimizer import use_coat_optimizer

    with pytest.raises(TypeError, match="takes Megatron's TensorParallelMuon, got SGD"):
        CoatTensorParallelMuon.adopt(torch.optim.SGD(matrices(), lr=0.1))
    with pytest.raises(ValueError, match="master_remainders"):
        CoatTensorParallelMuon.adopt(megatron_muon(matrices()), OptimizerConfig(master_remainders=True))
    with pytest.raises(ValueError, match="state_dtype"):
        CoatTensorParallelMuon.adopt(megatron_muon(matrices()), state_dtype="bf16")

    class MuonWithMoreState(TensorParallelMuon):  # e.g. 0.19's TensorParallelAdaptiveMuon
        pass

    from megatron.core.optimizer import FP32Optimizer

    wrapper = FP32Optimizer.__new__(FP32Optimizer)
    wrapper.optimizer = MuonWithMoreState([{"params": matrices()}], **OPTIONS)
    wrapper.config = SimpleNamespace(optimizer="muon", use_precision_aware_optimizer=False)
    with pytest.raises(ValueError, match="MuonWithMoreState.*plain Muon, TensorParallelMuon"):
        use_coat_optimizer(SimpleNamespace(chained_optimizers=[wrapper]))
    wrapper.optimizer = megatron_muon(matrices())
    wrapper.config.use_precision_aware_optimizer = True
    with pytest.raises(ValueError, match="--use-precision-aware-optimizer with --optimizer muon"):
        use_coat_optimizer(SimpleNamespace(chained_optimizers=[wrapper]))


def test_nested_chains_are_walked():
    """megatron-core 0.19 chains a LayerWiseDistributedOptimizer (a chain itself) with distributed optimizers."""
    from coat_megatron.optimizer import megatron_wrappers

    a, b, c = (SimpleNamespace(optimizer=i) for i in range(3))
    nested = SimpleNamespace(chained_optimizers=[SimpleNamespace(chained_optimizers=[a, b]), c])
    assert megatron_wrappers(nested) == [a, b, c]
    assert megatron_wrappers(a) == [a]
