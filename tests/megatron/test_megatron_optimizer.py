"""`--coat-optimizer`: CoatFP8AdamW inside Megatron's DistributedOptimizer / Float16OptimizerWithFloat16Params (CPU).

The multi-process checks run once, in one spawned two-rank gloo job (tests/jobs/megatron_optimizer_job.py; its CPU shims
are documented there): real `get_megatron_optimizer` + `use_coat_optimizer` on a 3-layer GPT wrapped in Megatron's
DDP, DP=2. Also passes against megatron-core 0.19.2's core (PYTHONPATH=<unpacked 0.19.2 wheel>).
"""
import argparse
import os
import sys
from types import SimpleNamespace

import pytest
from rank_helpers import run_job
import torch


UPDATE_TOL = 0.05  # relative L2 error of a parameter's 3-step update against torch AdamW



@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_job("megatron_optimizer_job.py", tmp_path_factory.mktemp("megatron_optimizer_job"), timeout=300)


RUNS = ("mixed", "bf16", "bf16_e5m2", "float16")


@pytest.mark.parametrize("run", RUNS)
def test_inner_optimizer_is_swapped_and_steps_bit_exactly(job, run):
    """Megatron drives the swapped optimizer (clipping, scheduler groups, grad copies) and every step equals a
    plain CoatFP8AdamW stepped on copies of the same fp32 (shard) params with the same gradients."""
    for rank in job:
        r = rank[run]
        assert r["inner"] == "MegatronCoatFP8AdamW" and r["torch_inner"] == "AdamW"
        assert r["wrapper"] == ("Float16OptimizerWithFloat16Params" if run == "float16" else "DistributedOptimizer")
        assert r["lockstep_steps"] == 3 and r["lockstep_mismatches"] == []


@pytest.mark.parametrize("run", ["mixed", "bf16"])
def test_state_is_fp8_per_shard_on_the_parameter_grid(job, run):
    for rank in job:
        r = rank[run]
        assert r["stepped_numel_all_ranks"] == r["model_numel"]  # the two shards cover the model once
        for shard in r["shards"]:
            assert shard["codes"] == ["torch.float8_e4m3fn", "torch.float8_e4m3fn"]
            assert shard["codes_numel"] == shard["numel"] and shard["step"] == 3.0
            assert shard["segments"] == [[0, shard["numel"], shard["start"]]]  # groups on the parameter's grid
        assert r["state_bytes"] / r["local_numel"] < 2.3  # codes + per-group metadata (fp32 AdamW: 8)
    split = [s for rank in job for s in rank[run]["shards"] if s["numel"] != s["param_numel"]]
    assert len(split) == 2  # linear_fc1 of one layer is cut between the ranks
    if run == "bf16":
        assert {s["start"] % 128 for s in split} == {0, 64}  # one shard starts inside a quantization group
    if run == "mixed":  # fp32 norms: their shards are views of the model params, which the swap must accept
        assert any(s["model_dtype"] == "torch.float32" for s in rank[run]["shards"])


def test_tracks_megatron_torch_adamw(job):
    for rank in job:
        for run in ("bf16_e5m2", "float16", "bf16", "mixed"):
            errors = rank[run]["update_rel_err"]
            worst = max(errors, key=errors.get)
            assert errors[worst] < UPDATE_TOL, (run, worst, errors[worst])


def test_default_formats_track_torch_adamw_on_sparse_embedding_rows(job):
    """Embedding rows of rare tokens put a second-moment range beyond E4M3's (k = 1) into one group: its small
    values must not round to 0 (DREConfig.keep_nonzero), or m / (sqrt(0) + eps) explodes (34-45x before)."""
    for rank in job:
        for name, err in rank["bf16"]["update_rel_err"].items():
            assert err < UPDATE_TOL, (name, err)


@pytest.mark.parametrize("sharding", ["dp_reshardable", "fully_reshardable", "torch", "te_step_convention"])
def test_checkpoint_round_trip(job, sharding):
    """Save through Megatron (dist_checkpointing sharding types of megatron.training, and the distributed
    optimizer's own --ckpt-format torch file), load into a fresh COAT run: fp32 moments on disk quantize back to
    the saved codes and metadata, so params and moments come back bit for bit."""
    for rank in job:
        r = rank["checkpoints"][sharding]
        assert r["param"] == 0.0 and r["fp8"], r
        assert r["exact"], r
        assert r["steps"] == r["expected_steps"] == [3.0], r


def test_checkpoints_are_interchangeable_with_torch_adamw(job):
    for rank in job:
        coat_to_torch = rank["checkpoints"]["coat_to_torch"]
        assert coat_to_torch["exact"], coat_to_torch  # fp32 moments on disk: a torch-AdamW run reads them as saved
        torch_to_coat = rank["checkpoints"]["torch_to_coat"]
        assert torch_to_coat["param"] == 0.0 and torch_to_coat["fp8"], torch_to_coat
        assert torch_to_coat["exp_avg"] < 0.05 and torch_to_coat["exp_avg_sq"] < 0.05, torch_to_coat
        assert torch_to_coat["steps"] == torch_to_coat["expected_steps"] == [3.0]
        f16 = rank["float16"]
        assert f16["checkpoint_torch_layout"] and f16["coat_to_torch"]["exact"]
        assert f16["round_trip"]["exact"] and f16["round_trip"]["fp8"], f16["round_trip"]


def test_resumed_run_continues_like_the_uninterrupted_one(job):
    for rank in job:
        r = rank["checkpoints"]["resumed_vs_uninterrupted"]
        assert r["losses"][0] == r["losses"][1]
        assert r["exact"] and r["state"]["exact"], r  # two steps after the load, bit for bit


def test_precision_aware_optimizer_trains_like_fp32_masters(job):
    """`--use-precision-aware-optimizer`: Megatron keeps no fp32 main params; COAT steps the bf16 shards with master
    remainders, reading Megatron's decoupled gradients. With fp32 main grads it is bit-identical, for every step,
    to the default run (fp32 main params) whose bf16 copies round ties away from zero, as remainders do."""
    for rank in job:
        r = rank["precision_aware_fp32_grads"]
        assert r["decoupled"] and r["remainders"]
        assert r["losses"][0] == r["losses"][1]
        assert r["masters_equal"] and r["params_equal"] and r["moments_equal"]


def test_bf16_main_grads_with_remainders(job):
    """`--use-precision-aware-optimizer --main-grads-dtype bf16`: bf16 shards and bf16 gradients reach the optimizer,
    every step equals a plain CoatFP8AdamW with master remainders on copies of the shards, and the optimizer state
    is 2 bytes of remainder + FP8 moments per shard element."""
    for rank in job:
        r = rank["precision_aware_bf16_grads"]
        assert r["grad_dtypes"] == ["torch.bfloat16"] and r["param_dtypes"] == ["torch.bfloat16"]
        assert r["lockstep_steps"] == 3 and r["lockstep_mismatches"] == []
        assert r["remainder_bytes"] == 2 * r["local_numel"]
        assert 4.1 < r["state_bytes_per_element"] < 4.3


@pytest.mark.parametrize("sharding", ["dp_reshardable", "fully_reshardable", "torch"])
def test_precision_aware_checkpoints_are_exact(job, sharding):
    """The fp32 master goes to disk as Megatron's `param`: bf16 shards and remainders come back bit for bit."""
    for rank in job:
        r = rank["precision_aware_bf16_grads"]["checkpoints"][sharding]
        assert r["exact"] and r["masters_exact"] and r["fp8"], r
        assert r["steps"] == r["expected_steps"] == [3.0]


def test_precision_aware_checkpoints_interchange_with_fp32_masters_and_resume_exactly(job):
    for rank in job:
        checkpoints = rank["precision_aware_bf16_grads"]["checkpoints"]
        for direction in ("to_fp32_masters", "from_fp32_masters"):
            assert checkpoints[direction]["masters_exact"] and checkpoints[direction]["exact"], direction
        resumed = checkpoints["resumed_vs_uninterrupted"]
        assert resumed["losses"][0] == resumed["losses"][1]
        assert resumed["params_exact"] and resumed["masters_exact"] and resumed["state"]["exact"]


# ---- in-process ---------------------------------------------------------------------------------------------------
def test_load_state_dict_gives_each_param_its_own_step():
    """Megatron hands every state entry one shared `step` tensor on load; in-place increments must not add up."""
    from coat_megatron.optimizer import MegatronCoatFP8AdamW

    params = [torch.zeros(200, requires_grad=False) for _ in range(3)]
    opt = MegatronCoatFP8AdamW([{"params": params, "lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8,
                                 "weight_decay": 0.0}], param_offsets={params[1]: 64})
    assert opt.state[params[1]]["segments"].tolist() == [[0, 200, 64]]
    sd = opt.state_dict()
    shared = torch.tensor(5.0)
    for entry in sd["state"].values():
        entry["step"] = shared
    sd["param_groups"][0].pop("step")
    opt.load_state_dict(sd)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert [float(opt.state[p]["step"]) for p in params] == [6.0, 6.0, 6.0]


def test_torch_format_state_dict_round_trips_through_torch_adamw():
    from coat_megatron.optimizer import MegatronCoatFP8AdamW

    torch.manual_seed(0)
    p = torch.randn(4, 96)
    p.grad = torch.randn(4, 96)
    group = {"params": [p], "lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt = MegatronCoatFP8AdamW([group], torch_format_state_dict=True, exp_avg_sq_format="e5m2")
    opt.step()
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg"].shape == p.shape and sd["state"][0]["exp_avg"].dtype == torch.float32
    reference = torch.optim.AdamW([p.clone()], lr=1e-3)
    reference.load_state_dict(sd)  # torch AdamW's own layout
    back = MegatronCoatFP8AdamW([{**group, "params": [p]}], torch_format_state_dict=True)
    back.load_state_dict(reference.state_dict())
    assert back.param_groups[0]["exp_avg_sq_format"] == "e4m3"  # this run's options, not the saved group's
    moments = back.fp32_moments(p)
    saved = sd["state"][0]["exp_avg"].view(-1)
    assert (moments["exp_avg"] - saved).norm() < 0.03 * saved.norm()
    assert float(back.state[p]["step"]) == 1.0


@pytest.mark.parametrize("config, message", [
    (dict(optimizer="sgd"), "--optimizer sgd"),
    (dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.uint8), "--exp-avg-dtype fp8"),
    (dict(use_precision_aware_optimizer=True, exp_avg_sq_dtype=torch.bfloat16), "--exp-avg-sq-dtype bf16"),
    (dict(use_precision_aware_optimizer=True, main_params_dtype=torch.float16), "--main-params-dtype fp16"),
    (dict(optimizer_cpu_offload=True), "--optimizer-cpu-offload"),
    (dict(decoupled_weight_decay=False), "L2 weight decay"),
])
def test_unsupported_megatron_settings_are_rejected(config, message):
    from coat_megatron.optimizer import use_coat_optimizer

    inner = torch.optim.AdamW([torch.zeros(4, requires_grad=True)])
    wrapper = SimpleNamespace(optimizer=inner, config=SimpleNamespace(**{"optimizer": "adam", **config}))
    with pytest.raises(ValueError, match=message):
        use_coat_optimizer(SimpleNamespace(chained_optimizers=[wrapper]))


# ---- the flags -----------------------------------------------------------------------------------------------------
def test_coat_optimizer_flags():
    from coat_megatron.arguments import add_coat_args, coat_optimizer_options

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--transformer-impl", default="transformer_engine", choices=("local", "transformer_engine"))
    add_coat_args(parser)
    args = parser.parse_args([])
    assert not args.coat_optimizer
    assert coat_optimizer_options(args) == dict(exp_avg_format="e4m3", exp_avg_sq_format="e4m3", expand_exp_avg=True,
                                                expand_exp_avg_sq=True, group_size=128, expand_min=16, k_max=16.0)
    args = parser.parse_args(["--coat-optimizer", "--coat-exp-avg-sq-format", "e5m2", "--coat-group-size", "256",
                              "--coat-no-expand-exp-avg", "--coat-k-max", "8"])
    assert args.coat_optimizer
    assert coat_optimizer_options(args) == dict(exp_avg_format="e4m3", exp_avg_sq_format="e5m2", expand_exp_avg=False,
                                                expand_exp_avg_sq=True, group_size=256, expand_min=16, k_max=8.0)
    from coat_kernels.optim.config import GROUP_OPTION_NAMES
    from coat_megatron.arguments import OPTIMIZER_FLAGS

    assert set(OPTIMIZER_FLAGS) == set(GROUP_OPTION_NAMES)  # every per-group COAT option has its flag


def test_megatron_training_parses_coat_optimizer(monkeypatch):
    try:
        from megatron.training import arguments, training
    except ImportError as exc:
        pytest.skip(f"megatron.training is not importable here (it ships from megatron-core 0.17 on): {exc}")
    from coat_megatron import enable_coat

    monkeypatch.setattr(arguments, "add_megatron_arguments", arguments.add_megatron_arguments)  # restored after
    monkeypatch.setattr(training, "get_megatron_optimizer", training.get_megatron_optimizer)
    handle = enable_coat()
    assert enable_coat() is handle  # idempotent
    assert training.get_megatron_optimizer.handle is handle
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt", "--use-distributed-optimizer", "--coat-optimizer",
                                      "--coat-exp-avg-sq-format", "e5m2"])
    args = arguments.parse_args(ignore_unknown_args=True)
    assert args.coat_optimizer and args.use_distributed_optimizer and args.coat_exp_avg_sq_format == "e5m2"


def test_a_shard_listed_in_two_param_groups_is_refused():
    """The distributed optimizer's fp32 shards are views; the duplicate check sees the views themselves, not the
    detached tensors handed to torch's leaf check."""
    from coat_megatron.optimizer import MegatronCoatFP8AdamW

    flat = torch.zeros(400, requires_grad=True)
    a, b = flat[:200], flat[200:]  # non-leaf views
    opts = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    with pytest.raises(ValueError, match="more than one parameter group"):
        MegatronCoatFP8AdamW([{"params": [a], **opts}, {"params": [b, a], **opts}])
