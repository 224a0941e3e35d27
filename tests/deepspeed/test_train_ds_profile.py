"""launch/train_ds.py --profile-step on CPU (one gloo rank under torchrun): the profiled step's chrome trace and its
host ops by self CPU time are written, and the step is left out of the timing medians."""
import gzip
import json

import train_ds_runs as runs


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
