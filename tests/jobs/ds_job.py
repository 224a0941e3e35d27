"""Multi-rank DeepSpeed jobs run by tests/deepspeed/test_deepspeed.py (each function is one rank's body; asserts
inside).

Kept out of the test module so that spawned workers import only this file, ds_helpers and what they need.
"""
from __future__ import annotations

import os

import pytest
import torch

import ds_helpers as H

STEPS = 4
EXACT_STEPS = 2  # with bit-identical gradients, states away from cut points are identical up to this step; after
# it the weights in cut groups differ (they were updated from differently grouped moments), and so do all gradients
GROUP = 128


# ---- reference: CoatFP8AdamW without DeepSpeed ---------------------------------------------------------------
def reference_run(dtype: str, steps: int, ranks: int = 1, zero_step_first: bool = False):
    """Single-process run on the same global batch. bf16: bf16 model, fp32 masters (what DeepSpeed keeps).

    Returns losses (mean of the per-rank micro-batch losses) and, after step EXACT_STEPS and after the last step,
    the fp32 weights and dequantized moments per param."""
    from coat_ds import CoatFP8AdamW

    model = H.make_model()
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = model.to(tdt)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = CoatFP8AdamW(masters, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    if zero_step_first:  # FP16_UnfusedOptimizer runs one zero-gradient step at construction
        for m in masters:
            m.grad = torch.zeros_like(m)
        opt.step()
        for p, m in zip(params, masters):
            p.data.copy_(m)
    losses, snapshots = [], {}
    for step in range(steps):
        for p in params:
            p.grad = None
        total = 0.0
        for r in range(ranks):
            loss = model(*H.batch(step, r, tdt)) / ranks
            loss.backward()
            total += loss.item()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
        opt.step()
        for p, m in zip(params, masters):
            p.data.copy_(m)
        losses.append(total)
        if step + 1 in (EXACT_STEPS, steps):
            snapshots[step + 1] = ([m.detach().clone() for m in masters], [opt.fp32_moments(m) for m in masters])
    return losses, snapshots


# ---- what the DeepSpeed run holds -----------------------------------------------------------------------------
def gathered_moments(engine, numels, stage):
    """Full per-parameter fp32 moments, assembled from every rank's flat state through the expected layout."""
    import deepspeed.comm as dist

    opt = engine.basic_optimizer
    (flat, state), = opt.state.items()
    deq = opt.fp32_moments(flat)
    local = torch.stack([deq["exp_avg"], deq["exp_avg_sq"]])
    world = dist.get_world_size()
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    full = [torch.full((2, n), float("nan")) for n in numels]
    for r in range(world):
        for idx, fs, n, po in H.indexed_segments(numels, stage, r, world):
            full[idx][:, po:po + n] = parts[r][:, fs:fs + n]
    return [{"exp_avg": f[0], "exp_avg_sq": f[1]} for f in full]


def cut_groups_mask(numel, stage, world, idx, numels):
    """Elements of param `idx` whose group (on the param's own grid) is split by a partition edge."""
    mask = torch.zeros(numel, dtype=torch.bool)
    for r in range(world):
        for i, _, n, po in H.indexed_segments(numels, stage, r, world):
            if i != idx:
                continue
            for edge in (po, po + n):
                if edge % GROUP and edge != numel:
                    g = edge // GROUP * GROUP
                    mask[g:g + GROUP] = True
    return mask


def check_segments_and_groups(engine, numels, stage, rank, world, label):
    from coat_kernels.optim.grouping import build_layout

    opt = engine.basic_optimizer
    (flat, state), = opt.state.items()
    segments = [tuple(s) for s in state["segments"].tolist()]
    expected = H.expected_segments(numels, stage, rank, world)
    assert segments == expected, f"{label}: segments {segments} != DeepSpeed layout {expected}"
    layout = build_layout(state["segments"], flat.numel(), GROUP)
    starts, lengths = layout.group_bounds()
    for s, n in zip(starts.tolist(), lengths.tolist()):
        owner = [seg for seg in segments if seg[0] <= s and s + n <= seg[0] + seg[1]]
        assert len(owner) == 1, f"{label}: group [{s}, {s + n}) straddles segments {segments}"
        fs, _, po = owner[0]
        assert (po + s - fs) % GROUP == 0 or s == fs, f"{label}: group at {s} is off its parameter's grid"
    return segments


# ---- job 1: ZeRO stages against the single-process reference ---------------------------------------------------
def stages_worker(rank, world, rendezvous, out_dir):
    H.start_rank(rank, world, rendezvous)
    import deepspeed
    import coat_ds
    from coat_ds.deepspeed_plugin import optimizer_state_report

    numels = [p.numel() for p in H.make_model().parameters()]
    refs = {}
    cases = [  # (stage, dtype, extra config, wrapper class, same data on every rank)
        (1, "fp32", {}, "DeepSpeedZeroOptimizer", True),
        (2, "fp32", {}, "DeepSpeedZeroOptimizer", True),
        (3, "fp32", {}, "DeepSpeedZeroOptimizer_Stage3", True),
        (1, "bf16", {}, "DeepSpeedZeroOptimizer", True),
        (2, "bf16", {}, "DeepSpeedZeroOptimizer", True),
        (3, "bf16", {}, "DeepSpeedZeroOptimizer_Stage3", True),
        (1, "bf16", {"data_types": {"grad_accum_dtype": "fp32"}}, "BF16_Optimizer", True),
        (0, "bf16", {}, "FP16_UnfusedOptimizer", True),
        (2, "fp32", {}, "DeepSpeedZeroOptimizer", False),
    ]
    report = []
    for stage, dtype, extra, wrapper, same_data in cases:
        label = f"stage {stage} {dtype} {wrapper}{'' if same_data else ' per-rank data'}"
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        engine, *_ = deepspeed.initialize(model=H.make_model(), config=H.ds_config(stage, dtype, **extra))
        assert type(engine.basic_optimizer) is coat_ds.CoatFP8AdamW, label
        assert type(engine.optimizer).__name__ == wrapper, (label, type(engine.optimizer).__name__)
        key = (dtype, same_data, stage == 0)
        if key not in refs:
            refs[key] = reference_run(dtype, STEPS, ranks=1 if same_data else world, zero_step_first=stage == 0)
        ref_losses, ref_snapshots = refs[key]
        losses = []
        for step in range(STEPS):
            loss = engine(*H.batch(step, 0 if same_data else rank, tdt))
            engine.backward(loss)
            engine.step()
            mean_loss = loss.detach().float().clone()
            deepspeed.comm.all_reduce(mean_loss)
            losses.append(mean_loss.item() / world)
            if step + 1 in ref_snapshots:
                exact = dtype == "fp32" and same_data and step + 1 == EXACT_STEPS
                compare_with_reference(engine, stage, dtype, numels, rank, world, ref_snapshots[step + 1], exact,
                                       f"{label} step {step + 1}")
        loss_tol = 2e-2 if dtype == "bf16" else 5e-3
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= loss_tol * abs(b), f"{label}: losses {losses} vs single-process {ref_losses}"
        if (stage, dtype, same_data) == (2, "fp32", True) and not extra:
            triton_on_same_layout(engine, rank)
        if stage and wrapper != "BF16_Optimizer" and same_data:
            check_full_optimizer_state(engine, numels, stage, label)
        rep = optimizer_state_report(engine)
        assert 2.0 <= rep["bytes_per_element"] <= 2.6, (label, rep)
        report.append((label, losses[-1], rep["state_bytes"], rep["stepped_numel"]))
        del engine
    if rank == 0:
        with open(os.path.join(out_dir, "stages.txt"), "w") as f:
            f.writelines(f"{r}\n" for r in report)
    H.end_rank_process()


def compare_with_reference(engine, stage, dtype, numels, rank, world, snapshot, exact, label):
    import deepspeed

    ref_weights, ref_moments = snapshot
    if stage == 0:
        opt = engine.basic_optimizer
        weights = [m.detach() for m in opt.param_groups[0]["params"]]
        moments = [opt.fp32_moments(m) for m in opt.param_groups[0]["params"]]
        assert all(s["segments"].tolist() == [[0, n, 0]] for s, n in zip(opt.state.values(), numels)), label
    else:
        segments = check_segments_and_groups(engine, numels, stage, rank, world, label)
        if stage in (1, 2) and rank == 1:
            assert any(po % GROUP for _, _, po in segments), f"{label}: no cut point inside a parameter"
        weights = [deepspeed.utils.safe_get_full_fp32_param(p).float() for p in engine.module.parameters()]
        moments = gathered_moments(engine, numels, stage)
    for idx, (w, rw, m, rm) in enumerate(zip(weights, ref_weights, moments, ref_moments)):
        # FP8 moments of groups re-cut at partition edges differ from the reference run's (k < 1 included): up to a
        # fifth of one lr-sized step
        assert torch.allclose(w.view(-1), rw.view(-1), atol=3e-3 if dtype == "bf16" else 2e-3, rtol=0), \
            f"{label}: param {idx} max |dw| {(w.view(-1) - rw.view(-1)).abs().max()}"
        if stage:
            cut = cut_groups_mask(numels[idx], stage, world, idx, numels)
        else:
            cut = torch.zeros(numels[idx], dtype=torch.bool)
        for key_m in ("exp_avg", "exp_avg_sq"):
            a, b = m[key_m].view(-1), rm[key_m].view(-1)
            assert torch.isfinite(a).all(), f"{label}: non-finite {key_m} in param {idx}"
            scale = b.abs().max().clamp_min(1e-30)
            assert ((a - b).abs() <= 0.15 * scale).all(), f"{label}: {key_m} of param {idx} off by " \
                f"{((a - b).abs() / scale).max():.3f} of its max"
            if exact:  # bit-identical gradients: groups away from cut points hold identical states
                diff = (a[~cut] != b[~cut]).nonzero().view(-1)
                assert diff.numel() == 0, f"{label}: {key_m} of param {idx} differs away from cuts at " \
                    f"{diff[:8].tolist()} of {int((~cut).sum())}: {a[~cut][diff[:4]].tolist()} vs " \
                    f"{b[~cut][diff[:4]].tolist()}"
            if exact and cut.any():
                assert not torch.equal(a[cut], b[cut]), f"{label}: cut groups identical (test not sensitive)"


def check_full_optimizer_state(engine, numels, stage, label):
    """DeepSpeed's per-parameter optimizer-state API answers in fp32 moments: get equals the moments assembled from
    the flat states; set writes a parameter's moment (re-quantized on its groups) and leaves every other moment bit
    for bit; setting back what get returned restores the state bit for bit; a wrong key fails on every rank."""
    import deepspeed

    params = list(engine.module.parameters())
    flat, state = flat_state(engine)
    before = clone_state(state)
    expected = gathered_moments(engine, numels, stage)
    got = [{k: deepspeed.utils.safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")} for p in params]
    for idx, (g, e) in enumerate(zip(got, expected)):
        for k in g:
            assert g[k].dtype == torch.float32 and g[k].shape == params[idx].shape, (label, idx, k)
            assert torch.equal(g[k].view(-1), e[k]), f"{label}: safe_get_full_optimizer_state({idx}, {k})"
    new = got[1]["exp_avg"] * -3.0 + 1e-4
    deepspeed.utils.safe_set_full_optimizer_state(params[1], new, "exp_avg")
    after = gathered_moments(engine, numels, stage)
    for idx in range(len(params)):
        for k in ("exp_avg", "exp_avg_sq"):
            if (idx, k) != (1, "exp_avg"):
                assert torch.equal(after[idx][k], expected[idx][k]), f"{label}: set changed {k} of param {idx}"
    err = (after[1]["exp_avg"] - new.view(-1)).abs().max() / new.abs().max()
    assert 0 < err < 2 ** -4, f"{label}: set exp_avg off by {err:.4f} of its max"
    deepspeed.utils.safe_set_full_optimizer_state(params[1], got[1]["exp_avg"], "exp_avg")
    assert not H.states_equal(before, flat_state(engine)[1]), f"{label}: set(get()) changed the state"
    with pytest.raises(ValueError, match="exp_avg_sq"):
        deepspeed.utils.safe_get_full_optimizer_state(params[0], "momentum_buffer")
    with pytest.raises(ValueError, match="elements"):
        deepspeed.utils.safe_set_full_optimizer_state(params[0], torch.zeros(3), "exp_avg")
    if stage == 3:
        local = deepspeed.utils.safe_get_local_optimizer_state(params[2], "exp_avg_sq")
        deepspeed.utils.safe_set_local_optimizer_state(params[2], local * 0.0, "exp_avg_sq")
        assert not deepspeed.utils.safe_get_local_optimizer_state(params[2], "exp_avg_sq").any(), label
        deepspeed.utils.safe_set_local_optimizer_state(params[2], local, "exp_avg_sq")
        assert not H.states_equal(before, flat_state(engine)[1]), f"{label}: local set(get()) changed the state"


def triton_on_same_layout(torch_engine, rank):
    """The GPU code path (the fused Triton kernel; here under TRITON_INTERPRET) on the same ZeRO-2 partitions gives
    the same flat weights and states as the PyTorch reference path."""
    import deepspeed

    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    config = H.ds_config(2, "fp32")
    config["optimizer"]["params"]["backend"] = "triton"
    engine, *_ = deepspeed.initialize(model=H.make_model(), config=config)
    assert engine.basic_optimizer.config.backend == "triton"
    train(engine, STEPS, 0, torch.float32)
    (flat, state), (ref_flat, ref_state) = flat_state(engine), flat_state(torch_engine)
    assert torch.equal(flat, ref_flat), f"rank {rank}: Triton path weights differ from the reference path"
    assert not H.states_equal(state, ref_state), f"rank {rank}: Triton path {H.states_equal(state, ref_state)} differ"


# ---- job 2: same-DP checkpoints, NaN/Inf gradients (2 ranks) --------------------------------------------------
def flat_state(engine):
    """(flat fp32 tensor, its CoatFP8AdamW state entry) of this rank (one param group)."""
    (flat, state), = engine.basic_optimizer.state.items()
    return flat, state


def clone_state(state):
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}


def full_snapshot(engine, numels, stage):
    """Collective: full fp32 weights and dequantized moments per param, for comparisons in other jobs."""
    import deepspeed

    weights = [deepspeed.utils.safe_get_full_fp32_param(p).float().clone() for p in engine.module.parameters()]
    return {"weights": weights, "moments": gathered_moments(engine, numels, stage)}


def train(engine, steps, rank, tdt, first=0):
    losses = []
    for step in range(first, first + steps):
        loss = engine(*H.batch(step, rank, tdt))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def checkpoint_worker(rank, world, rendezvous, ck_dir):
    H.start_rank(rank, world, rendezvous)
    import deepspeed
    import coat_ds  # noqa: F401
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    numels = [p.numel() for p in H.make_model().parameters()]
    for stage, dtype in ((2, "bf16"), (3, "fp32")):
        tag, tdt = f"z{stage}_{dtype}", torch.bfloat16 if dtype == "bf16" else torch.float32
        e1, *_ = deepspeed.initialize(model=H.make_model(0), config=H.ds_config(stage, dtype))
        train(e1, 3, rank, tdt)
        e1.save_checkpoint(ck_dir, tag=tag, client_state={UNIVERSAL_CHECKPOINT_INFO: {}})
        flat, state = flat_state(e1)
        saved_flat, saved_state = flat.detach().clone(), clone_state(state)
        snapshot = full_snapshot(e1, numels, stage)
        loss_next = train(e1, 1, rank, tdt, first=3)[0]
        flat, state = flat_state(e1)
        after_flat, after_state = flat.detach().clone(), clone_state(state)
        if rank == 0:
            torch.save({**snapshot, "next_loss_rank0": loss_next}, os.path.join(ck_dir, f"{tag}_expected.pt"))
        torch.save({"flat": after_flat, "state": after_state, "next_loss": loss_next},
                   os.path.join(ck_dir, f"{tag}_after_rank{rank}.pt"))

        e2, *_ = deepspeed.initialize(model=H.make_model(1), config=H.ds_config(stage, dtype))
        e2.load_checkpoint(ck_dir, tag=tag)
        flat, state = flat_state(e2)
        assert torch.equal(flat, saved_flat), f"{tag}: fp32 partition differs after load"
        assert state["exp_avg_q"].dtype == torch.float8_e4m3fn, state["exp_avg_q"].dtype
        assert not H.states_equal(state, saved_state), f"{tag}: {H.states_equal(state, saved_state)} differ after load"
        assert float(state["step"]) == 3.0
        assert train(e2, 1, rank, tdt, first=3)[0] == loss_next, f"{tag}: next loss differs after load"
        flat, state = flat_state(e2)
        assert torch.equal(flat, after_flat) and not H.states_equal(state, after_state), f"{tag}: next step differs"
        for p1, p2 in zip(e1.module.parameters(), e2.module.parameters()):
            assert stage == 3 or torch.equal(p1, p2), f"{tag}: module weights differ"
        del e1, e2

    nonfinite_gradients(rank, tdt=torch.bfloat16)
    H.end_rank_process()


def nonfinite_gradients(rank, tdt):
    """bf16 ZeRO-2. By default (bf16.check_grad_overflow=true) DeepSpeed sees the overflow and skips the whole step:
    the optimizer is not called. With check_grad_overflow=false and compute_grad_norm=false the NaN/Inf reaches
    CoatFP8AdamW: the groups holding them keep params and moments (nonfinite="skip_group"), the others step."""
    import deepspeed

    numels = [p.numel() for p in H.make_model().parameters()]
    bad = (5, 700)  # groups 0 and 5 of the first weight (960 elements, all in rank 0's partition)
    for ds_checks in (True, False):
        config = H.ds_config(2, "bf16", clip=1.0 if ds_checks else 0.0,
                             zero_optimization={"compute_grad_norm": ds_checks},
                             bf16={"check_grad_overflow": ds_checks})
        engine, *_ = deepspeed.initialize(model=H.make_model(0), config=config)
        train(engine, 2, rank, tdt)
        if rank == 0:
            def poison(grad):
                grad = grad.clone()
                grad.view(-1)[bad[0]], grad.view(-1)[bad[1]] = float("nan"), float("inf")
                return grad
            hook = next(engine.module.parameters()).register_hook(poison)
        flat, state = flat_state(engine)
        before_flat, before_state = flat.detach().clone(), clone_state(state)
        before = engine.basic_optimizer.fp32_moments(flat)
        train(engine, 1, rank, tdt, first=2)
        if rank == 0:
            hook.remove()
        flat, state = flat_state(engine)
        label = f"DeepSpeed overflow checks {ds_checks}, rank {rank}"
        if ds_checks:
            assert engine.skipped_steps == 1 and float(state["step"]) == 2.0, label
            assert torch.equal(flat, before_flat) and not H.states_equal(state, before_state), label
        else:
            after = engine.basic_optimizer.fp32_moments(flat)
            assert torch.isfinite(flat).all() and all(torch.isfinite(t).all() for t in after.values()), label
            frozen = torch.zeros(flat.numel(), dtype=torch.bool)
            if rank == 0:
                for i in bad:
                    frozen[i // GROUP * GROUP:(i // GROUP + 1) * GROUP] = True
            assert torch.equal(flat[frozen], before_flat[frozen]), f"{label}: params of NaN/Inf groups changed"
            for key in after:
                assert torch.equal(after[key][frozen], before[key][frozen]), f"{label}: {key} of NaN/Inf groups changed"
            segments = H.expected_segments(numels, 2, rank, 2)
            live = ~frozen
            live[segments[-1][0] + segments[-1][1]:] = False  # padding
            changed = (flat[live] != before_flat[live]).float().mean()
            assert changed > 0.9, f"{label}: only {changed:.3f} of the finite groups stepped"
            assert engine.basic_optimizer.skipped_groups == (2 if rank == 0 else 0), label
        train(engine, 1, rank, tdt, first=3)  # training goes on
        assert torch.isfinite(flat_state(engine)[0]).all(), label
        del engine


# ---- job 3: one rank: universal load 2 -> 1, save for 1 -> 2, bad configs, the callable route -----------------
def one_rank_worker(rank, world, rendezvous, ck_dir):
    H.start_rank(rank, world, rendezvous)
    import deepspeed
    import coat_ds
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    numels = [p.numel() for p in H.make_model().parameters()]
    load_universal_and_check(ck_dir, "z3_fp32_universal", "z3_fp32_expected.pt", numels, rank, world,
                             next_step=3, stage=3, dtype="fp32")
    engine = load_universal_and_check(ck_dir, "z2_bf16_universal", "z2_bf16_expected.pt", numels, rank, world,
                                      next_step=3)
    engine.save_checkpoint(ck_dir, tag="dp1", client_state={UNIVERSAL_CHECKPOINT_INFO: {}})
    snapshot = full_snapshot(engine, numels, 2)
    next_losses = [engine(*H.batch(4, r, torch.bfloat16)).item() for r in range(2)]
    torch.save({**snapshot, "next_losses": next_losses}, os.path.join(ck_dir, "dp1_expected.pt"))
    del engine

    bad_configs(ck_dir)
    client_callable = deepspeed.initialize(
        model=H.make_model(), config={k: v for k, v in H.ds_config(2, "fp32").items() if k != "optimizer"},
        optimizer=lambda params: coat_ds.CoatFP8AdamW(params, lr=1e-2))[0]
    train(client_callable, 2, rank, torch.float32)
    assert float(flat_state(client_callable)[1]["step"]) == 2.0
    H.end_rank_process()


def universal_same_dp_worker(rank, world, rendezvous, ck_dir):
    """The ZeRO-2 bf16 and ZeRO-3 fp32 checkpoints through coat_ds.to_universal, loaded at the same DP size: the
    step after the load gives the partition and the FP8 state bit for bit as the uninterrupted run's."""
    H.start_rank(rank, world, rendezvous)
    import coat_ds  # noqa: F401

    numels = [p.numel() for p in H.make_model().parameters()]
    for stage, dtype in ((2, "bf16"), (3, "fp32")):
        tag = f"z{stage}_{dtype}"
        expected = torch.load(os.path.join(ck_dir, f"{tag}_after_rank{rank}.pt"), weights_only=False)
        engine = load_universal_and_check(ck_dir, f"{tag}_universal", f"{tag}_expected.pt", numels, rank, world,
                                          next_step=3, stage=stage, dtype=dtype, next_loss=expected["next_loss"])
        flat, state = flat_state(engine)
        assert torch.equal(flat, expected["flat"]), f"{tag}: partition differs after the resumed step"
        assert not H.states_equal(state, expected["state"]), (tag, H.states_equal(state, expected["state"]))
        del engine
    H.end_rank_process()


def load_universal_and_check(ck_dir, tag, expected_file, numels, rank, world, next_step, stage=2, dtype="bf16",
                             next_loss=None):
    """Load a universal checkpoint into an engine of `world` ranks and check it against the saved run: fp32
    weights and (fp32) moments exact, the next loss exact; then one step re-quantizes the moments."""
    import deepspeed

    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    expected = torch.load(os.path.join(ck_dir, expected_file), weights_only=False)
    engine, *_ = deepspeed.initialize(model=H.make_model(7),
                                      config=H.ds_config(stage, dtype, checkpoint={"load_universal": True}))
    engine.load_checkpoint(ck_dir, tag=tag)
    for idx, p in enumerate(engine.module.parameters()):
        assert torch.equal(deepspeed.utils.safe_get_full_fp32_param(p).float(), expected["weights"][idx]), idx
    flat, state = flat_state(engine)
    assert state["exp_avg"].dtype == torch.float32 and float(state["step"]) == next_step, sorted(state)
    for idx, fs, n, po in H.indexed_segments(numels, stage, rank, world):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key][fs:fs + n], expected["moments"][idx][key][po:po + n]), (key, idx)
    loss = engine(*H.batch(next_step, rank, tdt))
    want = next_loss if next_loss is not None else (
        expected["next_loss_rank0"] if "next_loss_rank0" in expected else expected["next_losses"][rank])
    assert loss.item() == want, (loss.item(), want)
    engine.backward(loss)
    engine.step()
    flat, state = flat_state(engine)
    assert "exp_avg" not in state and state["exp_avg_q"].dtype == torch.float8_e4m3fn, sorted(state)
    assert state["segments"].tolist() == [list(s) for s in H.expected_segments(numels, stage, rank, world)]
    assert float(state["step"]) == next_step + 1 and torch.isfinite(flat).all()
    return engine


def bad_configs(tmp_dir):
    import deepspeed

    def fails(config, *needles):
        try:
            deepspeed.initialize(model=H.make_model(), config=config)
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            text = f"{type(exc).__name__}: {exc}"
            assert all(n in text for n in needles), text
            return
        raise AssertionError(f"no error for {config}")

    unknown = H.ds_config(2, "fp32")
    unknown["optimizer"]["params"]["max_grad_nrom"] = 1.0
    fails(unknown, "ValueError", "max_grad_nrom", "valid options", "exp_avg_format")
    bad_value = H.ds_config(2, "fp32")
    bad_value["optimizer"]["params"]["exp_avg_format"] = "e3m4"
    fails(bad_value, "e3m4")
    fails(H.ds_config(2, "bf16", zero_optimization={"elastic_checkpoint": True}), "ValueError", "elastic_checkpoint")
    for stage in (2, 3):
        fails(H.ds_config(stage, "bf16", zero_optimization={"offload_optimizer": {"device": "nvme",
                                                                                  "nvme_path": tmp_dir}}),
              "ValueError", "nvme")
    lower_case = H.ds_config(2, "fp32")
    lower_case["optimizer"]["type"] = "coatfp8adamw"
    fails(lower_case, "ValueError", "did you mean \"CoatFP8AdamW\"")
