"""CoatFP8AdamW with master remainders under DeepSpeed ZeRO-1/2/3 (bf16 master weights and gradients), on CPU.

Run by tests/deepspeed/test_deepspeed_remainders.py through torch.multiprocessing.spawn. Phases:
- remainders_worker (2 ranks): for each stage, the remainder run (`"bf16_master_weights_and_grads": true`,
  `"master_remainders": true`) against the fp32-master run (DeepSpeed's default bf16 mode) whose bf16 copies are
  rounded ties away from zero (as remainders round; DeepSpeed's own copy rounds ties to even): losses, bf16 weights,
  masters and FP8 states bit for bit; the remainder run steps the model's bf16 partitions (no master clone under
  ZeRO-1/2); under gradient clipping (ZeRO-2/3) the same equality once the reference's clipped gradients are
  rounded to bf16, as DeepSpeed clips a bf16 gradient partition in place; rigid checkpoints resume bit for bit; a
  universal checkpoint is saved for the next phases.
- universal_worker (2 ranks, then 1): coat_ds.to_universal's output loaded into remainder runs: masters and moments
  exact at load, the next loss exact at the same DP size, and into an fp32-master run: its masters are the same.
Configurations without bf16 masters are refused at deepspeed.initialize. Each rank appends one line per checked
phase to OUT/remainders_rank{r}.txt.
"""
from __future__ import annotations

import os

import torch

import ds_helpers as H

STEPS = 3
BF16_MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def remainder_config(stage, **extra):
    cfg = H.ds_config(stage, "bf16", bf16=BF16_MASTERS, **extra)
    cfg["optimizer"]["params"]["master_remainders"] = True
    return cfg


def train(engine, steps, rank, first=0):
    losses = []
    for step in range(first, first + steps):
        loss = engine(*H.batch(step, rank, torch.bfloat16))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def masters_and_states(engine, stage):
    """[(fp32 master of this rank's flat tensor, its CoatFP8AdamW entry)], in group / sub-group order."""
    wrapper, coat = engine.optimizer, engine.basic_optimizer
    flats = wrapper.fp32_partitioned_groups_flat if stage == 3 else wrapper.single_partition_of_fp32_groups
    return [(coat.fp32_master(flat).detach().clone(), {k: v.clone() if torch.is_tensor(v) else v
                                                       for k, v in coat.state[flat].items()}) for flat in flats]


def copy_masters_ties_away(engine, stage):
    """Make the fp32-master run's bf16 weights the masters rounded as remainders round (after each step)."""
    from coat_kernels.optim.master_remainders import round_to_bf16
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import all_gather_dp_groups

    wrapper = engine.optimizer
    original = wrapper.step

    def step(*args, **kwargs):
        result = original(*args, **kwargs)
        with torch.no_grad():
            if stage == 3:
                for master, bf16 in zip(wrapper.fp32_partitioned_groups_flat, wrapper.fp16_partitioned_groups_flat):
                    bf16.copy_(round_to_bf16(master))
            else:
                for i, master in enumerate(wrapper.single_partition_of_fp32_groups):
                    partition_id = dist.get_rank(group=wrapper.real_dp_process_group[i])
                    wrapper.parallel_partitioned_bit16_groups[i][partition_id].copy_(round_to_bf16(master))
                all_gather_dp_groups(groups_flat=wrapper.bit16_groups_flat,
                                     partitioned_param_groups=wrapper.parallel_partitioned_bit16_groups,
                                     dp_process_group=wrapper.real_dp_process_group,
                                     start_alignment_factor=wrapper.nccl_start_alignment_factor,
                                     allgather_bucket_size=wrapper.allgather_bucket_size)
        return result

    wrapper.step = step


def round_clipped_grads_to_bf16(engine, stage):
    """Make the fp32-master run's clipped gradients what the bf16-gradient run steps with: DeepSpeed scales the
    gradient partition in place, in the partition's dtype (fp32 there, bf16 under bf16_master_weights_and_grads)."""
    wrapper = engine.optimizer
    original = wrapper.unscale_and_clip_grads

    def unscale_and_clip_grads(grads, total_norm):
        original(grads, total_norm)
        flats = [wrapper.fp32_partitioned_groups_flat[grads].grad] if stage == 3 else grads
        for grad in flats:
            grad.copy_(grad.to(torch.bfloat16))

    wrapper.unscale_and_clip_grads = unscale_and_clip_grads


def clipped_runs(deepspeed, stage, rank, round_reference):
    """(remainder run, fp32-master run) after STEPS steps under "gradient_clipping" below every step's gradient norm,
    the reference's clipped gradients rounded to bf16 or not; and the norms."""
    engine, *_ = deepspeed.initialize(model=H.make_model(0), config=remainder_config(stage, gradient_clipping=0.05))
    reference, *_ = deepspeed.initialize(model=H.make_model(0), config=H.ds_config(stage, "bf16", clip=0.05))
    copy_masters_ties_away(reference, stage)
    if round_reference:
        round_clipped_grads_to_bf16(reference, stage)
    norms = []
    for step in range(STEPS):
        for run in (engine, reference):
            run.backward(run(*H.batch(step, rank, torch.bfloat16)))
            run.step()
        norms.append(engine.get_global_grad_norm())
    return engine, reference, norms


def module_bits(engine, stage):
    import deepspeed

    if stage == 3:
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone().view(torch.int16) for p in params]
    return [p.detach().clone().view(torch.int16) for p in engine.module.parameters()]


def same_states(a, b):
    """Masters and FP8 states bit for bit (remainders aside: the masters include them)."""
    def fp8_state(entry):
        return {k: v for k, v in entry.items() if k != "master_remainder"}

    return all(torch.equal(x[0].view(torch.int32), y[0].view(torch.int32)) and not H.states_equal(
        fp8_state(x[1]), fp8_state(y[1])) for x, y in zip(a, b))


def report(out_dir, rank, line):
    with open(os.path.join(out_dir, f"remainders_rank{rank}.txt"), "a") as f:
        f.write(line + "\n")


def remainders_worker(rank, world, rendezvous, out_dir):
    H.start_rank(rank, world, rendezvous)
    import deepspeed
    import coat_ds  # noqa: F401
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    refuse_remainders_without_bf16_masters(deepspeed)
    report(out_dir, rank, "refused without bf16 masters")
    for stage in (1, 2, 3):
        engine, *_ = deepspeed.initialize(model=H.make_model(0), config=remainder_config(stage))
        reference, *_ = deepspeed.initialize(model=H.make_model(0), config=H.ds_config(stage, "bf16"))
        copy_masters_ties_away(reference, stage)
        losses = train(engine, STEPS, rank), train(reference, STEPS, rank)
        assert losses[0] == losses[1], (stage, losses)
        assert all(torch.equal(a, b) for a, b in zip(module_bits(engine, stage), module_bits(reference, stage)))
        mine, theirs = masters_and_states(engine, stage), masters_and_states(reference, stage)
        assert same_states(mine, theirs), f"stage {stage}: masters or FP8 states differ from the fp32-master run"
        wrapper, coat = engine.optimizer, engine.basic_optimizer
        if stage == 3:
            owned = all(m is b for m, b in zip(wrapper.fp32_partitioned_groups_flat,
                                               wrapper.fp16_partitioned_groups_flat))
            flats = wrapper.fp32_partitioned_groups_flat
        else:
            owned = all(m.dtype == torch.bfloat16 and m.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()
                        for m, f in zip(wrapper.single_partition_of_fp32_groups, wrapper.bit16_groups_flat))
            flats = wrapper.single_partition_of_fp32_groups
        assert owned, f"stage {stage}: the optimizer does not step the model's bf16 partitions"
        for flat in flats:
            remainder = coat.state[flat]["master_remainder"]
            assert remainder.dtype == torch.int16 and remainder.numel() == flat.numel() and flat.dtype == torch.bfloat16
        numel = sum(f.numel() for f in flats)
        report(out_dir, rank, f"stage {stage} equal state_bytes_per_element {coat.state_bytes() / numel:.3f}")
        if stage in (2, 3):
            engine_c, reference_c, norms = clipped_runs(deepspeed, stage, rank, round_reference=True)
            assert min(norms) > 0.05, norms  # every step clipped
            assert all(torch.equal(a, b) for a, b in zip(module_bits(engine_c, stage), module_bits(reference_c, stage)))
            assert same_states(masters_and_states(engine_c, stage), masters_and_states(reference_c, stage))
            del engine_c, reference_c
            report(out_dir, rank, f"stage {stage} clipped equal to bf16-rounded clipped gradients")
            tag = f"z{stage}_remainders"
            engine.save_checkpoint(out_dir, tag=tag, client_state={UNIVERSAL_CHECKPOINT_INFO: {}})
            saved = masters_and_states(engine, stage)
            expected = {"weights": [deepspeed.utils.safe_get_full_fp32_param(p).float().clone()
                                    for p in reference.module.parameters()]}
            if rank == 0:
                torch.save(expected, os.path.join(out_dir, f"{tag}_expected.pt"))
            next_loss = train(engine, 1, rank, first=STEPS)[0]
            after = masters_and_states(engine, stage)
            torch.save({"next_loss": next_loss, "after": after}, os.path.join(out_dir, f"{tag}_after_rank{rank}.pt"))
            fresh, *_ = deepspeed.initialize(model=H.make_model(1), config=remainder_config(stage))
            fresh.load_checkpoint(out_dir, tag=tag)
            loaded = masters_and_states(fresh, stage)
            assert same_states(loaded, saved) and all(torch.equal(x[1]["master_remainder"], y[1]["master_remainder"])
                                                      for x, y in zip(loaded, saved)), f"{tag}: load differs"
            assert train(fresh, 1, rank, first=STEPS)[0] == next_loss, f"{tag}: next loss differs after load"
            assert same_states(masters_and_states(fresh, stage), after), f"{tag}: next step differs after load"
            if stage == 2:
                optim_file = os.path.join(out_dir, tag, f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
                masters = torch.load(optim_file, weights_only=False)["optimizer_state_dict"][
                    "single_partition_of_fp32_groups"]
                assert all(m.untyped_storage().nbytes() == m.numel() * 2 for m in masters), "whole buffer saved"
            report(out_dir, rank, f"stage {stage} checkpoint exact")
            del fresh
        del engine, reference
    H.end_rank_process()


def refuse_remainders_without_bf16_masters(deepspeed):
    """DeepSpeed's default bf16 mode (fp32 masters) and ZeRO-0 leave remainders nothing to complete: refused."""
    for config in (H.ds_config(2, "bf16"), H.ds_config(0, "bf16")):
        config["optimizer"]["params"]["master_remainders"] = True
        H.assert_refused(lambda: deepspeed.initialize(model=H.make_model(), config=config),
                         "bf16_master_weights_and_grads", "ZeRO stage 1, 2 or 3",
                         what=f"master remainders without bf16 masters: {config}")


def local_masters_match(engine, stage, expected_weights, rank, world):
    """This rank's exact masters (bf16 partition + remainder) equal the expected full fp32 weights."""
    numels = [w.numel() for w in expected_weights]
    (master, _), = masters_and_states(engine, stage)
    for idx, flat_start, length, param_offset in H.indexed_segments(numels, stage, rank, world):
        want = expected_weights[idx].reshape(-1)[param_offset:param_offset + length]
        if not torch.equal(master[flat_start:flat_start + length].view(torch.int32), want.view(torch.int32)):
            return False
    return True


def universal_worker(rank, world, rendezvous, out_dir):
    H.start_rank(rank, world, rendezvous)
    import deepspeed
    import coat_ds  # noqa: F401

    for stage in (2, 3):
        tag = f"z{stage}_remainders"
        expected = torch.load(os.path.join(out_dir, f"{tag}_expected.pt"), weights_only=False)["weights"]
        engine, *_ = deepspeed.initialize(model=H.make_model(7),
                                          config=remainder_config(stage, checkpoint={"load_universal": True}))
        engine.load_checkpoint(out_dir, tag=f"{tag}_universal")
        assert local_masters_match(engine, stage, expected, rank, world), f"{tag}: masters differ after load"
        (_, state), = masters_and_states(engine, stage)
        assert state["exp_avg_q"].dtype == torch.float8_e4m3fn and "exp_avg" not in state, sorted(state)
        loss = train(engine, 1, rank, first=STEPS)[0]
        if world == 2:
            after = torch.load(os.path.join(out_dir, f"{tag}_after_rank{rank}.pt"), weights_only=False)
            assert loss == after["next_loss"], (loss, after["next_loss"])
            assert same_states(masters_and_states(engine, stage), after["after"]), f"{tag}: next step differs"
        fp32_masters, *_ = deepspeed.initialize(model=H.make_model(7),
                                                config=H.ds_config(stage, "bf16", checkpoint={"load_universal": True}))
        fp32_masters.load_checkpoint(out_dir, tag=f"{tag}_universal")
        assert local_masters_match(fp32_masters, stage, expected, rank, world), f"{tag}: fp32 masters differ"
        report(out_dir, rank, f"universal stage {stage} world {world} exact")
        del engine, fp32_masters
    H.end_rank_process()
