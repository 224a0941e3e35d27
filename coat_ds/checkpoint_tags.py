"""Which tag of a DeepSpeed checkpoint directory a run can resume from after a kill during `save_checkpoint`.

DeepSpeed writes every rank's files with torch.save straight to their final names, and rank 0 writes `latest` (the
tag `load_checkpoint` takes by default) as soon as its own files are written, without waiting for the other ranks.
A run killed while saving can therefore leave `latest` naming a tag whose files are not all there or not whole
(a file cut short by the kill); `load_checkpoint` then fails. `tag_problems(save_dir, tag)` lists what such a tag
lacks, and `latest_complete_tag(save_dir)` names the tag to resume from:

    engine.load_checkpoint(save_dir, tag=latest_complete_tag(save_dir))

A tag is complete when its model-states files and (for ZeRO) every data-parallel rank's optimizer-states file are
present and whole zip archives (torch.save's format: a file cut short has no central directory). The ranks expected
are those the model-states file records (`dp_world_size`, `mp_world_size`).
"""
from __future__ import annotations

import os
import zipfile
from pathlib import Path

import torch

LATEST_FILE = "latest"


def _whole(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path):
            return True
    except (OSError, zipfile.BadZipFile):
        return False


def _expected_files(tag_dir: Path, states: dict) -> list[str]:
    dp, mp = int(states["dp_world_size"]), int(states["mp_world_size"])
    zero3 = any(tag_dir.glob("zero_pp_rank_*_model_states.pt"))
    names = [f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt" for d in range(dp) for m in range(mp)] if zero3 \
        else [f"mp_rank_{m:02d}_model_states.pt" for m in range(mp)]
    if states.get("param_shapes") is not None:  # ZeRO: one optimizer-states file per rank
        prefix = "bf16_" if any(tag_dir.glob("bf16_zero_pp_rank_*_optim_states.pt")) else ""
        names += [f"{prefix}zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt" for d in range(dp) for m in range(mp)]
    return names


def tag_problems(save_dir: str | os.PathLike, tag: str) -> list[str]:
    """What keeps `save_dir/tag` from loading: missing or cut-short files (an empty list: complete)."""
    tag_dir = Path(save_dir) / tag
    if not tag_dir.is_dir():
        return [f"{tag_dir} is not a directory"]
    first = sorted(tag_dir.glob("*model_states.pt"))
    if not first:
        return [f"{tag_dir} holds no model-states file"]
    if not _whole(first[0]):
        return [f"{first[0].name} is cut short"]
    states = torch.load(first[0], map_location="cpu", mmap=True, weights_only=False)
    problems = []
    for name in _expected_files(tag_dir, states):
        path = tag_dir / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif not _whole(path):
            problems.append(f"{name} is cut short")
    return problems


def latest_complete_tag(save_dir: str | os.PathLike) -> str | None:
    """The tag `latest` names if it is complete; else the complete tag whose files were written last; None if no
    tag is complete."""
    save_dir = Path(save_dir)
    latest = save_dir / LATEST_FILE
    if latest.is_file():
        named = latest.read_text().strip()
        if named and not tag_problems(save_dir, named):
            return named
    complete = [d for d in save_dir.iterdir() if d.is_dir() and any(d.glob("*model_states.pt"))
                and not tag_problems(save_dir, d.name)]
    if not complete:
        return None
    return max(complete, key=lambda d: max(f.stat().st_mtime for f in d.glob("*.pt"))).name
