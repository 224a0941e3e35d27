"""launch/train_ds.py --profile-step on CPU (one gloo rank under torchrun): the profiled step's chrome trace and its
host ops by self CPU time are written, and the step is left out of the timing medians; benchmarks/trace_summary.py
--host reads that trace."""
import gzip
import json
import re
import sys

import train_ds_runs as runs

sys.path.insert(0, str(runs.REPO / "benchmarks"))
import trace_summary  # noqa: E402


def test_profile_step_writes_the_trace_and_the_host_ops(tmp_path):
    flags = ["--ds-config", str(runs.CONFIGS / "ds_zero2_coat_full.json"), "--model", "tiny-fp8", "--seq-len", "32",
             "--global-batch", "2", "--profile-step", "2", "--profile-out", str(tmp_path / "prof")]
    setup = runs.Training(flags=flags, env=runs.environment(cpu=True), steps=3, timeout_s=300)
    losses = setup.run(1, tmp_path / "curve.csv")
    assert sorted(losses) == [1, 2, 3]
    with gzip.open(tmp_path / "prof" / "rank0_step2.json.gz", "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert "aten::mm" in names or "aten::addmm" in names or "aten::matmul" in names
    table = (tmp_path / "prof" / "rank0_step2_host_ops.txt").read_text()
    assert table.startswith("step 2: forward + backward issued in ") and "Self CPU" in table
    assert not (tmp_path / "prof" / "rank0_step1.json.gz").exists()
    summary = trace_summary.host_summary(str(tmp_path / "prof" / "rank0_step2.json.gz"), top=3,
                                         functions=r"^_[A-Z]\w*$")
    spans = {name: float(ms) for name, ms in re.findall(r"^  (forward|backward|after backward): ([0-9.]+) ms",
                                                       summary, re.M)}
    assert set(spans) == {"forward", "backward", "after backward"} and min(spans.values()) > 0, summary
    assert "autograd Function calls" in summary, summary  # the COAT blocks' Functions (torch references on a CPU)
