"""benchmarks/te_one_gpu_runbook.md's and te_four_gpu_runbook.md's calls, checked on CPU without a GPU: each fits one
device command (2,000 characters) and, where it runs something long, leaves 90 s of the 600 s to the rest (its
`timeout`s add up to at most 510 s); the parts calls bring over every part of the split wheel, one per call under the
64 MiB carry limit; the build is TE.md's; the compare calls together run every arm of the comparison, each a command
launch/megatron_compare.sh accepts (its DRY_RUN on the runbook's GPUs) with RESUME, each ending with an archive of its
folder under $OUT."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from runbook_calls import PROLOGUE, bash_blocks

ROOT = Path(__file__).resolve().parents[2]
ONE_GPU = ROOT / "benchmarks" / "te_one_gpu_runbook.md"
FOUR_GPUS = ROOT / "benchmarks" / "te_four_gpu_runbook.md"
PARTS = [f"{n:02d}" for n in range(6)]  # the 276 MB wheel in parts of 47 MB, under the 64 MiB carry limit
# per runbook: the arms its compare calls run together, and the GPUs they need
ARMS = {ONE_GPU: ({"te_fp8_blockwise_tp1", "te_memstack_tp1", "coat_tp1", "coat_pa_tp1", "te_bf16_tp1"}, 1),
        FOUR_GPUS: ({"coat_tp2_dp2", "te_fp8_blockwise_tp2_dp2", "te_memstack_tp2_dp2", "te_bf16_tp2_dp2",
                     "coat_dp4", "te_fp8_blockwise_dp4", "te_memstack_dp4", "coat_tp1"}, 4)}
RUNBOOKS = pytest.mark.parametrize("runbook", [ONE_GPU, FOUR_GPUS], ids=["one_gpu", "four_gpus"])


def sections(runbook=ONE_GPU):
    """(heading, carry lists named in the text, bash blocks) per `## ` section."""
    out = []
    for part in runbook.read_text().split("\n## ")[1:]:
        heading = part.splitlines()[0]
        carries = re.findall(r"[Cc]arry `(\[[^`]*\])`", part)
        out.append((heading, carries, bash_blocks(part)))
    return out


@RUNBOOKS
def test_every_call_fits_one_command_and_its_time_limit(runbook):
    for _, _, blocks in sections(runbook):
        for block in blocks:
            assert len(block) <= 2000, block[:200]
            seconds = [int(s) for s in re.findall(r"timeout -k \d+ (\d+)", block)]
            assert sum(seconds) <= 510, block[:200]


@RUNBOOKS
def test_the_parts_calls_bring_every_part_one_per_call(runbook):
    parts_section = next(s for s in sections(runbook) if s[0].startswith("Calls 1-6"))
    _, carries, blocks = parts_section
    assert carries == ['[".te/tecu13.part00", ".te/src"]', '[".te/tecu13.partNN"]']
    assert "for NN = " + ", ".join(PARTS[1:]) + ", one per call" in runbook.read_text().replace("\n", " ")
    assert blocks[0].startswith("mkdir -p /tmp/te && cp .te/tecu13.part00 /tmp/te/ && cp -r .te/src /tmp/te/")
    assert "cp .te/tecu13.part0* /tmp/te/" in blocks[1]


@RUNBOOKS
def test_the_build_is_te_mds_and_the_compare_calls_cover_every_arm(tmp_path, runbook):
    arms, gpus = ARMS[runbook]
    compare_calls = [s for s in sections(runbook) if s[0].startswith("Call ")]
    assert [c for _, c, _ in compare_calls] == [['[".whl"]']] * len(compare_calls) and len(compare_calls) >= 3
    build = compare_calls[0][2][0]
    for step in ("cat tecu13.part0* > transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl",
                 "--target /tmp/tesite transformer_engine_cu13-*.whl src/transformer_engine-2.20.2-py3-none-any.whl",
                 "tar xzf src/te_torch_src.tgz -C build", "NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=90",
                 "cp /tmp/tesite2/transformer_engine/wheel_lib/*.so /tmp/tesite/transformer_engine/wheel_lib/",
                 "cp -r /tmp/tesite2/transformer_engine_torch-*.dist-info /tmp/tesite/"):
        assert step in build, step
    covered = set()
    for _, _, (block,) in compare_calls:
        assert block.startswith(PROLOGUE + "\n")
        assert "/tmp/tesite" in block and "import transformer_engine.pytorch" in block
        line = next(ln for ln in block.splitlines() if "launch/megatron_compare.sh" in ln)
        out, iters = shlex.split(line.split("megatron_compare.sh", 1)[1].split(";")[0])
        assert out.startswith("/tmp/") and re.search(rf"tar czf \$OUT/\S+\.tgz -C /tmp {out[5:]}$", line)
        settings = dict(w.split("=", 1) for w in shlex.split(line.split("timeout")[0]))
        assert settings["RESUME"] == "1" and settings.get("NGPUS", "1") == str(gpus)
        assert settings["MICROS"] == "4" or re.fullmatch(r"4( \d+)? max", settings["MICROS"])
        covered |= set(settings["ARMS"].split())
        env = {**os.environ, **settings, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               "DRY_RUN": "1", "NGPUS": str(gpus)}
        proc = subprocess.run(["bash", "launch/megatron_compare.sh", str(tmp_path / "out"), iters], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        for arm in settings["ARMS"].split():
            ranks = 1 if arm.endswith("_tp1") else gpus
            assert re.search(rf"== {arm}_mb4: CUDA_VISIBLE_DEVICES=[0-9,]+ torchrun --nproc_per_node {ranks} ",
                             proc.stdout), proc.stdout
            assert ("max" in settings["MICROS"]) == (f"== {arm}_mbmax: the largest micro-batch" in proc.stdout)
    assert covered == arms
