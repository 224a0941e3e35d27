"""benchmarks/loss_outlier_runbook.md's call, checked on CPU without running it: it begins with the wheels' install,
fits one device command (2,000 characters), leaves one archive under $OUT and 90 s of the 600 s to the rest (its
`timeout`s add up to at most 510 s); its train_ds run parses with train_ds's own parser (probe steps within the run,
a config that exists, the compare run's settings) and its hf_deepspeed_compare run with the compare script's, with
arms that exist."""
import re
import shlex
from pathlib import Path

from runbook_calls import PROLOGUE, bash_blocks
from script_modules import load_script

REPO = Path(__file__).resolve().parents[2]


def test_the_call_fits_parses_and_names_what_exists():
    (call,) = bash_blocks((REPO / "benchmarks" / "loss_outlier_runbook.md").read_text())
    assert call.startswith(PROLOGUE + "\n") and len(call) <= 2000, len(call)
    assert len(re.findall(r"tar czf \$OUT/\S+\.tgz", call)) == 1
    assert 0 < sum(int(s) for s in re.findall(r"timeout -k \d+ (\d+)", call)) <= 510
    train_ds = load_script(REPO / "launch" / "train_ds.py", "train_ds_for_outlier_runbook")
    line = next(ln for ln in call.splitlines() if "launch/train_ds.py" in ln)
    args = train_ds.parse_args(shlex.split(line.split("launch/train_ds.py", 1)[1].split(">")[0]))
    assert (REPO / args.ds_config).is_file() and args.model in train_ds.MODELS
    assert args.probe_step == [17, 18, 19] and args.steps == 19
    # the sweep's coat run, whose step 18 was the outlier: the same data, batch, seed and padding
    assert (args.data, args.batching, args.global_batch, args.seed, args.pad_to_multiple_of) == (
        "corpus", "padded", 2, 1234, 16)
    compare = load_script(REPO / "benchmarks" / "hf_deepspeed_compare.py", "compare_for_outlier_runbook")
    line = next(ln for ln in call.splitlines() if "benchmarks/hf_deepspeed_compare.py" in ln)
    cargs = compare.parse_args(shlex.split(line.split("benchmarks/hf_deepspeed_compare.py", 1)[1].split(">")[0]))
    arms = [arm for arm, _ in compare.parse_arms(cargs.arms, cargs.micro_batch)]
    assert arms == ["bf16", "coat_optim", "coat", "torchao"] and all(a in compare.ARMS for a in arms)
    assert cargs.seed == args.seed and cargs.pad_to_multiple_of == args.pad_to_multiple_of
