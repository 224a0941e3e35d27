"""benchmarks/one_gpu_runbook.md's calls, checked on CPU without running them: each begins with the wheels' install,
fits one command (2,000 characters), leaves one archive under $OUT and leaves 90 s of the 600 s to the install, the
corpus and the archive (its `timeout`s add up to at most 510 s, those started with `&` counted once per call); every
script invocation parses with its script's own parser and names arms, recipes and models that exist; the result files
the runbook copies are there."""
import re
import shlex
from pathlib import Path

from launch import ds_optimizer_recipes, optimizer_parity
from launch.model_shapes import MODELS
from runbook_calls import PROLOGUE, bash_blocks

REPO = Path(__file__).resolve().parents[2]
RUNBOOK = REPO / "benchmarks" / "one_gpu_runbook.md"


def blocks():
    return bash_blocks(RUNBOOK.read_text())


def script_words(line, marker):
    """The words after `marker` in `line` up to its redirection, with the loop variables' values substituted."""
    return shlex.split(line.split(marker, 1)[1].split(">")[0].split("&")[0])


def test_each_call_fits_one_device_command():
    calls = blocks()
    assert len(calls) == 4
    for block in calls:
        assert block.startswith(PROLOGUE + "\n") and len(block) <= 2000, block[:200]
        assert len(re.findall(r"tar czf \$OUT/\S+\.tgz", block)) == 1
        serial, parallel = [], []
        for line in block.splitlines():
            for seconds, rest in re.findall(r"timeout -k \d+ (\d+)([^;]*)", line):
                (parallel if re.search(r"(?<![>&])&(?![&>])", rest) else serial).append(int(seconds))
        assert serial or parallel
        assert sum(serial) + max(parallel, default=0) <= 510, block


def test_every_invocation_parses_and_names_what_exists():
    invocations = 0
    for block in blocks():
        loops = dict(re.findall(r"for (\w+) in ([^;]+);", block))
        for line in block.splitlines():
            for marker, check in (("-m launch.optimizer_parity", check_parity),
                                  ("-m launch.ds_optimizer_recipes run", check_recipe)):
                if marker not in line:
                    continue
                variable = next((v for v in loops if f"${v}" in line), None)
                for value in (loops[variable].split() if variable else [""]):
                    argv = [w.replace(f"${variable}", value) if variable else w for w in script_words(line, marker)]
                    check([w.replace("$R", "/tmp/r").replace("$gpu_port", "29650") for w in argv])
                    invocations += 1
    assert invocations == 4 + 3 + 2 + 3  # call 1's recipes, call 2's arms, call 3's seeds, call 4's Muon arms


def check_parity(argv):
    args = optimizer_parity.parse_args(argv)
    assert args.size in ("1b", "parity") and args.arm in optimizer_parity.ARMS


def check_recipe(argv):
    recipe, rest = argv[0], argv[1:]
    assert recipe in ds_optimizer_recipes.RECIPES
    model = rest[rest.index("--model") + 1]
    assert model in MODELS


def test_the_runs_it_builds_on_are_in_the_repository():
    """Calls 2 and 3 copy the 1.0B runs already measured beside their own: fp32 seed 0, bf16 moments, COAT (the
    folder keeps the later calls' runs too)."""
    runs = REPO / "benchmarks" / "optimizer_runs" / "opt1b_h200"
    assert {p.name for p in runs.glob("*-seed*.json")} >= {"fp32-seed0.json", "bf16_moments-seed0.json",
                                                          "coat-seed0.json"}
    assert "cp benchmarks/optimizer_runs/opt1b_h200/*.json" in blocks()[1]
