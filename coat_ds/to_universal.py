"""Convert a DeepSpeed checkpoint holding COAT optimizer states into a Universal Checkpoint (to change the DP size).

DeepSpeed's `ds_to_universal` reads fp32 elementwise `exp_avg` / `exp_avg_sq` from every optimizer shard. This
tool copies the checkpoint tag folder, replaces each compact state entry (FP8 codes + per-group metadata + segments)
of CoatFP8AdamW or CoatFP8Lion by its dequantized fp32 moments, runs DeepSpeed's converter on the copy and deletes
it. DeepSpeed's converter needs both moments: an entry of one momentum (CoatFP8Lion's `exp_avg`) gets a stand-in
`exp_avg_sq` of -1 everywhere (a second moment is never negative), and the `exp_avg_sq.pt` files the converter writes
from stand-ins alone (every value negative) are removed from the result, so a load gives the optimizer its momentum
alone. CoatFP8Muon's checkpoints are refused with the reason: on ZeRO-1/2 its momentum (coat_ds.muon_zero) covers the
whole matrices of a partition, which a universal checkpoint's per-fragment moments cannot hold (DeepSpeed's own Muon
momentum does not convert either); on ZeRO-0 there are no ZeRO shards to convert and its checkpoints load at any DP
size. Load the result with `"checkpoint": {"load_universal": true}`; the optimizer re-quantizes the moments at its next
step, with the groups of the new partition layout. Loaded at the same DP size, every group quantizes back to the codes
and metadata it was saved with (coat_kernels.optim.exact_export): the run continues bit for bit. At a new DP size, only
groups re-cut by a new partition edge get new metadata. Master weights kept as bf16 partitions with CoatFP8AdamW's
remainders (`"master_remainders": true`, coat_ds.master_partitions) are joined into the exact fp32 masters the universal
checkpoint holds.

    python -m coat_ds.to_universal --input_folder ckpt/global_step100 --output_folder ckpt/global_step100_universal

Other arguments are DeepSpeed's (`--num_extract_workers`, `--inject_missing_state`, ...). Checkpoints without
COAT states go through unchanged.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch

from coat_kernels.optim import is_coat_state, to_fp32, validate_entry
from coat_kernels.optim.master_remainders import join
from coat_kernels.optim.state import MOMENTS, MOMENTUM, REMAINDER_KEY, config_of

from .muon_momentum_entry import WHOLE_MATRICES

NO_SECOND_MOMENT = -1.0  # the stand-in exp_avg_sq of an entry of one momentum: no second moment is negative
# (master partitions, optimizer state dict) of a ZeRO-1/2 and of a ZeRO-3 optimizer shard
MASTER_AND_STATE_KEYS = (("single_partition_of_fp32_groups", "base_optimizer_state"),
                         ("fp32_flat_groups", "optimizer_state_dict"))


def join_master_remainders(obj, found: list | None = None):
    """In place, anywhere in a nested checkpoint object: each ZeRO master partition whose optimizer entry (same
    index, as DeepSpeed's converter pairs them) holds a master remainder becomes the fp32 master. Appends one item
    to `found` per partition joined."""
    found = [] if found is None else found
    if isinstance(obj, dict):
        for masters_key, state_key in MASTER_AND_STATE_KEYS:
            masters, state = obj.get(masters_key), obj.get(state_key)
            if isinstance(masters, list) and isinstance(state, dict) and isinstance(state.get("state"), dict):
                for index, master in enumerate(masters):
                    entry = state["state"].get(index)
                    if isinstance(entry, dict) and REMAINDER_KEY in entry and isinstance(master, torch.Tensor):
                        if master.dtype != torch.bfloat16:
                            raise ValueError(f"{masters_key}[{index}] is {master.dtype} but its optimizer entry holds "
                                             "master remainders, which complete bf16 masters only: the checkpoint "
                                             "is inconsistent")
                        remainder = entry[REMAINDER_KEY].reshape(-1)
                        masters[index] = join(master.reshape(-1), remainder[:master.numel()]).view(master.shape)
                        found.append(1)
        for value in obj.values():
            join_master_remainders(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            join_master_remainders(value, found)
    return found


def expand_states(obj, found: list | None = None, config=None, where: str = "a COAT optimizer state"):
    """Replace, anywhere in a nested checkpoint object, each COAT entry by {step, exp_avg, exp_avg_sq}: the fp32
    moments that the optimizer quantizes back to the same codes and metadata on the same partition layout. An entry
    of one momentum (no exp_avg_sq codes: CoatFP8Lion's) gets the stand-in exp_avg_sq (NO_SECOND_MOMENT), for
    DeepSpeed's converter.

    An optimizer state dict's entries use their param group's options. Every entry is checked first
    (coat_kernels.optim.validation.validate_entry: a damaged one raises StateError naming `where` and its parameter id).
    Appends to `found` per entry the moments it held (MOMENTS or MOMENTUM)."""
    found = [] if found is None else found
    if isinstance(obj, dict):
        if WHOLE_MATRICES in obj:
            raise ValueError(f"{where}: a CoatFP8Muon momentum over whole matrices (DeepSpeed's ZeRO-1/2 Muon path) "
                             "cannot become a universal checkpoint, whose moments are per parameter fragment "
                             "(DeepSpeed's own Muon momentum does not convert either); resume from this checkpoint "
                             "at the same data-parallel size instead")
        if is_coat_state(obj):
            config = config or config_of({})
            codes = obj["exp_avg_q"]
            moments = MOMENTS if "exp_avg_sq_q" in obj else MOMENTUM
            validate_entry(obj, codes.numel() if isinstance(codes, torch.Tensor) else 0, config, where,
                           moments=moments)
            found.append(moments)
            fp32 = to_fp32(obj, *config.moment_configs())
            fp32.setdefault("exp_avg_sq", torch.full_like(fp32["exp_avg"], NO_SECOND_MOMENT))
            return {"step": obj["step"], **fp32}
        if isinstance(obj.get("state"), dict) and isinstance(obj.get("param_groups"), list):
            group_of = {pid: group for group in obj["param_groups"] for pid in group.get("params", ())}
            state = {pid: expand_states(entry, found, config_of(group_of.get(pid, {})),
                                        f"{where}, parameter {pid}") for pid, entry in obj["state"].items()}
            return {**{k: expand_states(v, found, where=where) for k, v in obj.items() if k != "state"}, "state": state}
        return {k: expand_states(v, found, where=where) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(expand_states(v, found, where=where) for v in obj)
    return obj


def dequantized_copy(input_folder: str, work_dir: str) -> tuple[str, int, bool]:
    """A copy of the tag folder with fp32 moments in every optimizer shard; returns (copy, shards rewritten, whether
    any entry held one momentum)."""
    copy = os.path.join(work_dir, os.path.basename(os.path.normpath(input_folder)))
    shutil.copytree(input_folder, copy)
    rewritten, one_momentum = 0, False
    for name in sorted(os.listdir(copy)):
        if not name.endswith("optim_states.pt"):
            continue
        path = os.path.join(copy, name)
        shard = torch.load(path, map_location="cpu", weights_only=False)
        found = join_master_remainders(shard)
        converted = expand_states(shard, found, where=f"{name}: COAT optimizer state")
        one_momentum = one_momentum or MOMENTUM in found
        if found:
            torch.save(converted, path)
            rewritten += 1
    return copy, rewritten, one_momentum


def remove_stand_in_second_moments(output_folder: str) -> int:
    """Delete the universal checkpoint's exp_avg_sq.pt files made from stand-ins alone (see the module); returns how
    many."""
    removed = 0
    zero = os.path.join(output_folder, "zero")
    for param in sorted(os.listdir(zero)):
        path = os.path.join(zero, param, "exp_avg_sq.pt")
        if os.path.isfile(path):
            values = torch.load(path, map_location="cpu", weights_only=False)
            values = values["param"] if isinstance(values, dict) else values
            if values.numel() and bool((values < 0).all()):
                os.remove(path)
                removed += 1
    return removed


def convert(input_folder: str, output_folder: str, ds_args: list[str] = ()) -> None:
    from deepspeed.checkpoint import ds_to_universal

    parent = os.path.dirname(os.path.abspath(output_folder))
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent, prefix=".coat_dequantized_") as work:
        copy, rewritten, one_momentum = dequantized_copy(input_folder, work)
        print(f"coat_ds.to_universal: dequantized COAT optimizer states in {rewritten} optimizer shard(s)")
        argv = sys.argv
        try:
            sys.argv = ["ds_to_universal", "--input_folder", copy, "--output_folder", output_folder, *ds_args]
            args = ds_to_universal.parse_arguments()
        finally:
            sys.argv = argv
        ds_to_universal.main(args)
    if one_momentum:
        removed = remove_stand_in_second_moments(output_folder)
        print(f"coat_ds.to_universal: {removed} parameter(s) keep one momentum (exp_avg only)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input_folder", required=True, help="checkpoint tag folder (holds *_optim_states.pt)")
    parser.add_argument("--output_folder", required=True, help="universal checkpoint tag folder to create")
    args, ds_args = parser.parse_known_args(argv)
    convert(args.input_folder, args.output_folder, ds_args)


if __name__ == "__main__":
    main()
