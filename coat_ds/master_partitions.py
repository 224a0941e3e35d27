"""CoatFP8AdamW with master remainders under DeepSpeed ZeRO: the bf16 parameter partition is the fp32 master's upper
half, the optimizer state holds the lower half.

With `"bf16": {"enabled": true, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true}` DeepSpeed
keeps bf16 master partitions and hands the optimizer bf16 gradient partitions; with `"master_remainders": true` in
the optimizer's params CoatFP8AdamW keeps the low 16 bits of every fp32 master value beside them, so the master is
exact (coat_kernels.optim.master_remainders) and no fp32 copy of the weights exists anywhere.

- DeepSpeed clones each bf16 partition (ZeRO-1/2: of a param group; ZeRO-3: of a sub-group) as its master (ZeRO-3
  means to alias them when the dtypes agree, but compares a torch.device with a device name, which is never equal).
  `own_master_partitions` puts the bf16 partition itself in the clone's place (the step writes the model's weights
  in place, DeepSpeed's copy back becomes a copy onto itself) and drops the clone: 2 bytes per partition element.
  Rigid checkpoints keep their format (the master partitions are saved as copies, not as views of the flat
  buffers).
- Universal checkpoints: DeepSpeed loads their fp32 weights and moments into tensors of the master's dtype, which in
  bf16 would round them. `exact_universal_load` lets DeepSpeed load into fp32 stand-ins instead, then hands
  CoatFP8AdamW the fp32 moments and the exact masters (bf16 partition + remainder). `coat_ds.to_universal` writes
  the joined fp32 masters into the universal checkpoint.

The DeepSpeed internals used here are entries of coat_ds.patch_sites (MASTER_STATE_DICT, UNIVERSAL_LOAD_1_2,
UNIVERSAL_LOAD_3, and the ZeRO-1/2 and ZeRO-3 master partitions among its INTERNALS).
"""
from __future__ import annotations

import functools

import torch

from . import patch_sites

SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
FP32_FLAT_GROUPS = "fp32_flat_groups"


def own_master_partitions(zero_optimizer, stage: int) -> None:
    """Step the model's bf16 partitions in place of DeepSpeed's bf16 master clones (see the module)."""
    if stage == 3:
        masters = zero_optimizer.fp32_partitioned_groups_flat
        for j, (master, own) in enumerate(zip(masters, zero_optimizer.fp16_partitioned_groups_flat)):
            if master is own or own is None:
                continue
            _check_same_layout(master, own, f"sub-group {j}")
            own.ds_id = master.ds_id
            masters[j] = own
        _save_master_copies(zero_optimizer, FP32_FLAT_GROUPS)
        return
    from deepspeed import comm as dist

    groups = zero_optimizer.optimizer.param_groups
    for i, group in enumerate(groups):
        partition_id = dist.get_rank(group=zero_optimizer.real_dp_process_group[i])
        own = zero_optimizer.parallel_partitioned_bit16_groups[i][partition_id]
        master = zero_optimizer.single_partition_of_fp32_groups[i]
        if master is own:
            continue
        _check_same_layout(master, own, f"param group {i}")
        zero_optimizer.single_partition_of_fp32_groups[i] = own
        group["params"] = [own]
    zero_optimizer._link_all_hp_params()
    _save_master_copies(zero_optimizer, SINGLE_PARTITION_OF_FP32_GROUPS)


def _check_same_layout(master, own, where):
    if master.dtype != own.dtype or master.shape != own.shape:
        raise RuntimeError(f"CoatFP8AdamW master remainders: DeepSpeed's master partition of {where} is {master.dtype} "
                           f"{tuple(master.shape)}, its bf16 partition {own.dtype} {tuple(own.shape)}; expected bf16 "
                           "masters of the partition's size")


def _save_master_copies(zero_optimizer, key) -> None:
    """The ZeRO optimizer's state_dict with its master partitions (state_dict()[key]) as copies: views of the bf16
    buffers would save those whole."""

    def copying_masters(original_state_dict):
        def state_dict():
            sd = original_state_dict()
            sd[key] = [t.clone() for t in sd[key]]
            return sd

        return state_dict

    patch_sites.wrap_instance(patch_sites.MASTER_STATE_DICT, zero_optimizer, copying_masters)


def exact_universal_load(zero_optimizer, stage: int) -> None:
    """Make this ZeRO optimizer's universal-checkpoint load exact for bf16 masters with remainders (see the module)."""
    if stage == 3:
        patch_sites.wrap_instance(patch_sites.UNIVERSAL_LOAD_3, zero_optimizer,
                                  lambda original: functools.partial(_load_stage3, zero_optimizer, original))
    else:
        patch_sites.wrap_instance(patch_sites.UNIVERSAL_LOAD_1_2, zero_optimizer,
                                  lambda original: functools.partial(_load_stage_1_2, zero_optimizer, original))


def _load_stage3(zero_optimizer, original, checkpoint_dir):
    masters = list(zero_optimizer.fp32_partitioned_groups_flat)
    stand_ins = [_fp32_stand_in(m) for m in masters]
    zero_optimizer.fp32_partitioned_groups_flat[:] = stand_ins
    try:
        original(checkpoint_dir)
    finally:
        zero_optimizer.fp32_partitioned_groups_flat[:] = masters
    zero_optimizer._set_fp32_optimizer_param_groups()
    try:
        _hand_over(zero_optimizer.optimizer, masters, stand_ins)
    finally:
        zero_optimizer._clear_fp32_optimizer_param_groups()


def _load_stage_1_2(zero_optimizer, original, lp_groups_name, checkpoint_dir):
    masters = list(zero_optimizer.single_partition_of_fp32_groups)
    stand_ins = [_fp32_stand_in(m) for m in masters]
    _set_masters(zero_optimizer, stand_ins)
    try:
        original(lp_groups_name, checkpoint_dir)
    finally:
        _set_masters(zero_optimizer, masters)
    _hand_over(zero_optimizer.optimizer, masters, stand_ins)


def _fp32_stand_in(master: torch.Tensor) -> torch.Tensor:
    stand_in = torch.zeros(master.shape, dtype=torch.float32, device=master.device)
    if hasattr(master, "ds_id"):
        stand_in.ds_id = master.ds_id
    return stand_in


def _set_masters(zero_optimizer, masters) -> None:
    """ZeRO-1/2: these tensors as the master partitions (param groups and fragment links follow)."""
    for i, (group, master) in enumerate(zip(zero_optimizer.optimizer.param_groups, masters)):
        zero_optimizer.single_partition_of_fp32_groups[i] = master
        group["params"] = [master]
    zero_optimizer._link_all_hp_params()


def _hand_over(optimizer, masters, stand_ins) -> None:
    """The state DeepSpeed loaded for each fp32 stand-in (fp32 moments, step) goes to its master, and the stand-in's
    fp32 weights become the master exactly (bf16 partition + remainder)."""
    for master, stand_in in zip(masters, stand_ins):
        loaded = optimizer.state.pop(stand_in, {})
        optimizer.state[master].update(loaded)
        optimizer.state[master].pop("master_remainder", None)  # the loaded master replaces it
        optimizer.set_fp32_master(master, stand_in)
