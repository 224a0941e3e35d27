"""Shared pieces of the DeepSpeed CPU tests: rank environment, the shm-op stub, a small model, data, layouts.

Every multi-rank job runs in fresh processes (torch.multiprocessing.spawn or torchrun) with a faulthandler
timeout, so a hang fails the test instead of blocking CI.
"""
from __future__ import annotations

import faulthandler
import importlib
import os
import sys

import torch
from rank_helpers import JOBS, end_rank_process, free_port  # noqa: F401 - re-exported for the DeepSpeed jobs

HIDDEN = (24, 40, 40, 8)  # MLP widths: 2968 parameters in 6 tensors, several groups of 128, cut points inside
BATCH = 4


def start_rank(rank: int, world: int, rendezvous_file: str, timeout_s: int = 300) -> None:
    """Environment for one rank, the shm-op stub and init_distributed (gloo, file rendezvous: no port to race for
    with other jobs on the machine)."""
    faulthandler.enable()
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getppid() % 1000), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    init_deepspeed_distributed(init_method=f"file://{rendezvous_file}", rank=rank, world_size=world)


def init_deepspeed_distributed(init_method=None, rank=-1, world_size=-1) -> None:
    import deepspeed

    # DeepSpeed JIT-builds a C++ shared-memory allreduce at init (about 11 minutes on CI); plain gloo is enough.
    # `deepspeed.comm.torch` as an attribute is the torch module (deepspeed.comm re-exports it): go via sys.modules.
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", init_method=init_method, rank=rank, world_size=world_size)


class MLP(torch.nn.Module):
    def __init__(self, widths=HIDDEN):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.nn.functional.gelu(x)
        return torch.nn.functional.mse_loss(x.float(), y.float())


def make_model(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def batch(step: int, rank: int = 0, dtype=torch.float32, size: int = BATCH):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, HIDDEN[0], generator=g)
    y = torch.randn(size, HIDDEN[-1], generator=g)
    return x.to(dtype), y.to(dtype)


def ds_config(stage: int, dtype: str, *, lr: float = 1e-2, clip: float = 0.0, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": clip, "steps_per_print": 10 ** 9,
           "zero_optimization": {"stage": stage},
           "optimizer": {"type": "CoatFP8AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.1}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    return cfg


def expected_segments(numels: list[int], stage: int, rank: int, world: int) -> list[tuple[int, int, int]]:
    """The fragment table DeepSpeed 0.19.8's layout implies, computed from the parameter sizes alone."""
    return [seg[1:] for seg in indexed_segments(numels, stage, rank, world)]


def indexed_segments(numels: list[int], stage: int, rank: int, world: int) -> list[tuple[int, int, int, int]]:
    """(param index, flat_start, length, param_offset) of this rank's flat tensor.

    ZeRO-1/2: the params concatenated and padded to a multiple of 2*world, cut into `world` equal partitions.
    ZeRO-3: every param cut into `world` shards of ceil(numel/world), concatenated per rank.
    """
    segments = []
    if stage in (1, 2):
        total = sum(numels)
        part = -(-total // (2 * world)) * 2 * world // world
        lo, hi, start = rank * part, (rank + 1) * part, 0
        for idx, n in enumerate(numels):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                segments.append((idx, a - lo, b - a, a - start))
            start += n
        return segments
    flat = 0
    for idx, n in enumerate(numels):
        shard = -(-n // world)
        valid = max(0, min(shard, n - rank * shard))
        if valid:
            segments.append((idx, flat, valid, rank * shard))
        flat += shard
    return segments


def fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    """A byte view for exact comparisons (torch.equal is not implemented for float8 on CPU)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def states_equal(a: dict, b: dict) -> list[str]:
    """Keys whose tensors differ (bitwise) between two state entries."""
    bad = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if torch.is_tensor(x) and torch.is_tensor(y):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(fp8_bytes(x.cpu()), fp8_bytes(y.cpu())):
                bad.append(key)
        elif x != y:
            bad.append(key)
    return bad


def assert_refused(call, *words: str, error: type[Exception] = ValueError, what: str = "the call") -> str:
    """call() must raise `error` with every one of `words` in its message; returns the message."""
    try:
        call()
    except error as exc:
        message = str(exc)
        assert all(word in message for word in words), message
        return message
    raise AssertionError(f"{what} was not refused")
