"""One rank of the DeepSpeed state-validation job (tests/kernels/optim/test_state_validation.py): ZeRO-2 (bf16) and
ZeRO-3 (fp32) checkpoints whose optimizer shards were swapped between the two ranks, or (ZeRO-2) whose metadata lost
a group, must fail at load_checkpoint with CoatFP8AdamW's StateError on every rank. Each rank writes
refused_<case>_rank<r> into the checkpoint folder."""
from __future__ import annotations

import os
import shutil

import torch

import ds_helpers as H



def optim_file(folder, rank):
    """This rank's optimizer shard (named with a bf16_ prefix under bf16)."""
    (name,) = [n for n in os.listdir(folder) if n.endswith(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")]
    return os.path.join(folder, name)


def train(engine, steps, rank, tdt):
    for step in range(steps):
        loss = engine(*H.batch(step, rank, tdt))
        engine.backward(loss)
        engine.step()


def swapped_copy(ck_dir, tag):
    """tag_swapped: the checkpoint with the two ranks' optimizer shards exchanged."""
    src, dst = os.path.join(ck_dir, tag), os.path.join(ck_dir, f"{tag}_swapped")
    shutil.copytree(src, dst)
    for rank, other in ((0, 1), (1, 0)):
        shutil.copy(optim_file(src, other), optim_file(dst, rank))


def damaged_copy(ck_dir, tag):
    """tag_damaged: every rank's exp_avg_meta one quantization group short."""
    src, dst = os.path.join(ck_dir, tag), os.path.join(ck_dir, f"{tag}_damaged")
    shutil.copytree(src, dst)
    for rank in (0, 1):
        path = optim_file(dst, rank)
        shard = torch.load(path, map_location="cpu", weights_only=False)
        (entry,) = shard["optimizer_state_dict"]["base_optimizer_state"]["state"].values()
        entry["exp_avg_meta"] = entry["exp_avg_meta"][:, :-1].clone()
        torch.save(shard, path)


def worker(rank, world, rendezvous, ck_dir):
    H.start_rank(rank, world, rendezvous)
    import deepspeed
    import deepspeed.comm as dist

    import coat_ds  # noqa: F401
    from coat_kernels.optim import StateError

    for stage, dtype, variants in ((2, "bf16", (("swapped", "segments"), ("damaged", "exp_avg_meta is"))),
                                   (3, "fp32", (("swapped", "segments"),))):
        tag, tdt = f"z{stage}", torch.bfloat16 if dtype == "bf16" else torch.float32
        engine, *_ = deepspeed.initialize(model=H.make_model(0), config=H.ds_config(stage, dtype))
        train(engine, 2, rank, tdt)
        engine.save_checkpoint(ck_dir, tag=tag)
        del engine
        dist.barrier()
        if rank == 0:
            swapped_copy(ck_dir, tag)
            if stage == 2:
                damaged_copy(ck_dir, tag)
        dist.barrier()
        for variant, needle in variants:
            engine, *_ = deepspeed.initialize(model=H.make_model(1), config=H.ds_config(stage, dtype))
            try:
                engine.load_checkpoint(ck_dir, tag=f"{tag}_{variant}")
            except StateError as exc:
                message = str(exc)
            else:
                raise AssertionError(f"rank {rank}: {tag}_{variant} loaded")
            assert needle in message and "CoatFP8AdamW state of parameter 0" in message, message
            if variant == "swapped":
                assert "another partition" in message, message
            open(os.path.join(ck_dir, f"refused_{tag}_{variant}_rank{rank}"), "w").write(message)
            del engine
            dist.barrier()
    H.end_rank_process()
