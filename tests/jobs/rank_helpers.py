"""Two-rank CPU jobs for the Megatron tests: a job script spawns its ranks (`spawn_ranks`), each rank writes
rank{r}.json (or rank{r}.error with its traceback); the test runs the script once per module (`run_job`)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

JOBS = Path(__file__).resolve().parent  # this folder: the job scripts the tests start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(script: str, out: Path, timeout: int, world: int = 2) -> list[dict]:
    """Run tests/<script> OUT PORT; every rank's JSON, or an assertion error with the first traceback."""
    proc = subprocess.run([sys.executable, str(JOBS / script), str(out), str(free_port())],
                          capture_output=True, text=True, timeout=timeout)
    errors = [p.read_text() for p in out.glob("rank*.error")]
    assert proc.returncode == 0 and not errors, (errors[0] if errors else proc.stderr[-4000:])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def end_rank_process() -> None:
    """Leave together, tear the process groups down, and end this rank's process without interpreter finalization.

    Gloo's C++ threads can still own objects holding Python references (async work, tensors) when the interpreter
    shuts down; destroying them then aborts the process now and then ('terminate called without an active
    exception', SIGABRT), which fails a test whose work all passed. Every rank has written its results by now.
    Skipping finalization skips multiprocessing's exit handler too, so the worker processes this rank started
    (checkpoint writers) are stopped here; left alive they would hold the job's output pipes open."""
    import multiprocessing

    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=30)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def init_gloo_rank(rank: int, world: int, port: int) -> None:
    """This process as rank `rank` of a gloo group on localhost (warnings off, one CPU thread, Python stacks
    printed on a fatal signal)."""
    import faulthandler
    import warnings

    import torch
    import torch.distributed as dist

    faulthandler.enable()
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _entry(rank, worker, world, out_dir, port):
    try:
        worker(rank, world, out_dir, port)
    except Exception:
        with open(os.path.join(out_dir, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        raise
    end_rank_process()


def spawn_ranks(worker, world: int = 2) -> None:
    """From a job script's __main__ (argv: OUT_DIR PORT): worker(rank, world, out_dir, port) in `world` processes."""
    import torch.multiprocessing as mp

    out_dir, port = sys.argv[1], int(sys.argv[2])
    mp.start_processes(_entry, args=(worker, world, out_dir, port), nprocs=world, start_method="spawn")
