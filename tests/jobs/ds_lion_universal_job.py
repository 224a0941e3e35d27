"""CoatFP8Lion's ZeRO-2 state through DeepSpeed's per-parameter state functions and universal checkpoints (CPU, gloo).

`save_convert_load` (2 ranks, in ds_lion_muon_job's worker): train, check `safe_get_full_optimizer_state` /
`safe_set_full_optimizer_state` on the momentum (and a clear error for "exp_avg_sq"), save, record the full fp32 weights
and momenta and the run's next steps; rank 0 converts the checkpoint (coat_ds.to_universal); both load it
(`load_worker`'s checks). `load_worker` (2 ranks or 1): load the universal checkpoint: weights and momenta exact, no
second moment; at 2 ranks the next steps give the uninterrupted run's losses and partition bit for bit; at 1 rank the
next loss is the saved run's and a step re-quantizes the momentum on the new layout."""
import os

import torch

import ds_helpers as H
import ds_job

LION = {"type": "CoatFP8Lion", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1}}
STEPS, NEXT = 3, 2


def config(**extra):
    return H.ds_config(2, "fp32", optimizer=LION, **extra)


def save_convert_load(rank, world, ck_dir):
    save(rank, ck_dir)
    if rank == 0:
        from coat_ds.to_universal import convert

        convert(os.path.join(ck_dir, "lion_z2"), os.path.join(ck_dir, "lion_z2_universal"),
                ["--num_extract_workers", "1", "--num_merge_workers", "1"])
    torch.distributed.barrier()
    load(rank, world, ck_dir)


def load_worker(rank, world, rendezvous, ck_dir):
    H.start_rank(rank, world, rendezvous)
    load(rank, world, ck_dir)
    H.end_rank_process()


def save(rank, ck_dir):
    import deepspeed
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_optimizer_state

    import coat_ds  # noqa: F401

    engine, *_ = deepspeed.initialize(model=H.make_model(), config=config())
    ds_job.train(engine, STEPS, rank, torch.float32)
    flat, state = ds_job.flat_state(engine)
    before = ds_job.clone_state(state)
    momenta = []
    for p in engine.module.parameters():
        full = safe_get_full_optimizer_state(p, "exp_avg")
        mapping = p._hp_mapping
        if mapping is not None:  # this rank's fragment: its own partition's fp32 momentum
            hp, lp = mapping.get_hp_fragment_address(), mapping.lp_fragment_address
            own = engine.basic_optimizer.fp32_moments(flat)["exp_avg"].narrow(0, hp.start, hp.numel)
            assert torch.equal(full.reshape(-1).narrow(0, lp.start, lp.numel), own)
        safe_set_full_optimizer_state(p, full, "exp_avg")
        momenta.append(full.reshape(-1).clone())
        H.assert_refused(lambda: safe_get_full_optimizer_state(p, "exp_avg_sq"), "'exp_avg'",
                         what="exp_avg_sq of a Lion state")
    assert not H.states_equal(state, before), H.states_equal(state, before)  # set(get) changed nothing
    assert "exp_avg_sq_q" not in state
    engine.save_checkpoint(ck_dir, tag="lion_z2", client_state={UNIVERSAL_CHECKPOINT_INFO: {}})
    weights = [safe_get_full_fp32_param(p).float().clone() for p in engine.module.parameters()]
    next_loss_rank0 = engine(*H.batch(STEPS, 0, torch.float32)).item()
    losses = ds_job.train(engine, NEXT, rank, torch.float32, first=STEPS)
    flat, _ = ds_job.flat_state(engine)
    torch.save({"weights": weights, "momenta": momenta, "next_loss_rank0": next_loss_rank0, "losses": losses,
                "flat": flat.detach().clone()}, os.path.join(ck_dir, f"lion_expected_rank{rank}.pt"))


def load(rank, world, ck_dir):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    import coat_ds  # noqa: F401

    expected = torch.load(os.path.join(ck_dir, f"lion_expected_rank{rank}.pt"), weights_only=False)
    engine, *_ = deepspeed.initialize(model=H.make_model(7), config=config(checkpoint={"load_universal": True}))
    engine.load_checkpoint(ck_dir, tag="lion_z2_universal")
    numels = [p.numel() for p in engine.module.parameters()]
    for idx, p in enumerate(engine.module.parameters()):
        assert torch.equal(safe_get_full_fp32_param(p).float(), expected["weights"][idx]), idx
    flat, state = ds_job.flat_state(engine)
    assert "exp_avg_sq" not in state and float(state["step"]) == STEPS, sorted(state)
    for idx, fs, n, po in H.indexed_segments(numels, 2, rank, world):
        assert torch.equal(state["exp_avg"][fs:fs + n], expected["momenta"][idx][po:po + n]), idx
    if world == 2:  # the same DP size: the run goes on bit for bit
        assert ds_job.train(engine, NEXT, rank, torch.float32, first=STEPS) == expected["losses"]
        flat, state = ds_job.flat_state(engine)
        assert torch.equal(flat, expected["flat"])
    else:
        loss = engine(*H.batch(STEPS, 0, torch.float32))
        assert loss.item() == expected["next_loss_rank0"], (loss.item(), expected["next_loss_rank0"])
        engine.backward(loss)
        engine.step()
        flat, state = ds_job.flat_state(engine)
        assert state["segments"].tolist() == [list(s) for s in H.expected_segments(numels, 2, rank, world)]
    assert "exp_avg" not in state and "exp_avg_sq_q" not in state and float(state["step"]) == STEPS + 1 + (
        NEXT - 1 if world == 2 else 0), sorted(state)
    assert torch.isfinite(flat).all()
