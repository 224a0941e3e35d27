"""benchmarks/graphs_memory_runbook.md's calls, checked on CPU without running them: each begins with the wheels'
install, fits one device command (2,000 characters), leaves one archive under $OUT and 90 s of the 600 s to the rest
(its `timeout`s add up to at most 510 s); every train_ds run (through ds_phase_memory, for each value of its loop) and
every hf_deepspeed_compare run parses with its script's own parser, with configs, arms and GPU test files that
exist."""
import re
import shlex
from pathlib import Path

import pytest
from runbook_calls import PROLOGUE, bash_blocks
from script_modules import load_script

REPO = Path(__file__).resolve().parents[2]
RUNBOOK = REPO / "benchmarks" / "graphs_memory_runbook.md"


@pytest.fixture(scope="module")
def scripts():
    return (load_script(REPO / "launch" / "train_ds.py", "train_ds_for_graphs_runbook"),
            load_script(REPO / "benchmarks" / "hf_deepspeed_compare.py", "compare_for_graphs_runbook"))


def blocks():
    return bash_blocks(RUNBOOK.read_text())


def test_each_call_fits_one_device_command():
    calls = blocks()
    assert len(calls) == 2
    for block in calls:
        assert block.startswith(PROLOGUE + "\n") and len(block) <= 2000, (len(block), block[:200])
        assert len(re.findall(r"tar czf \$OUT/\S+\.tgz", block)) == 1
        loop = re.search(r"for \w+ in ([^;]+);", block)
        runs = len(loop.group(1).split()) if loop else 1
        serial = 0
        for line in block.splitlines():
            for seconds in re.findall(r"timeout -k \d+ (\d+)", line):
                serial += int(seconds) * (runs if "torchrun" in line and loop else 1)
        assert 0 < serial <= 510, block


def test_every_run_parses_and_names_what_exists(scripts):
    train_ds, compare = scripts
    call1, call2 = blocks()
    tests = re.findall(r"tests/gpu/\S+\.py", call1)
    assert tests and all((REPO / t).is_file() for t in tests)
    line = next(ln for ln in call1.splitlines() if "benchmarks/ds_phase_memory.py" in ln)
    loop = re.search(r"for arm in ([^;]+);", line).group(1).split()
    run = line.split("benchmarks/ds_phase_memory.py", 1)[1].split(">")[0]
    for arm in loop:  # the loop body's settings of C and Z, applied per arm
        config = "configs/ds_zero2_coat_full.json" if arm == "eager" else "configs/ds_zero2_coat_graphs.json"
        zero = "--zero contiguous_gradients=false" if arm == "graphs_in_grad" else ""
        argv = shlex.split(run.replace("$C", config).replace("$Z", zero).replace("$arm", arm))
        args = train_ds.parse_args(argv)
        assert (REPO / args.ds_config).is_file() and args.model in train_ds.MODELS
        assert args.zero == ([("contiguous_gradients", False)] if arm == "graphs_in_grad" else [])
    assert '[ $arm = eager ] && C=configs/ds_zero2_coat_full.json' in line
    assert '[ $arm = graphs_in_grad ] && Z="--zero contiguous_gradients=false"' in line
    line = next(ln for ln in call2.splitlines() if "benchmarks/hf_deepspeed_compare.py" in ln)
    words = shlex.split(line.split("benchmarks/hf_deepspeed_compare.py", 1)[1].split(">")[0])
    args = compare.parse_args(words)
    arms = [arm for arm, _ in compare.parse_arms(args.arms, args.micro_batch)]
    assert "coat_graphs_in_grad" in arms and "bf16" in arms
