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


def test_trace_summary_reports_collectives_and_their_overlap(tmp_path):
    """Per collective: minimum, median, maximum duration; the part of the collectives no compute kernel overlaps."""
    def kernel(name, ts, dur):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [kernel("ncclDevKernel_AllGather_RING_LL(args)", 0.0, 100.0),
              kernel("ncclDevKernel_AllGather_RING_LL(args)", 200.0, 300.0),
              kernel("ncclDevKernel_AllGather_RING_LL(args)", 600.0, 200.0),
              kernel("nvjet_sm90_gemm", 250.0, 100.0)]  # overlaps 100 us of the second gather
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = trace_summary.summary(str(path), steps=1, top=2)
    assert "collectives: 0.60 ms per step, 0.50 ms of it with no compute kernel" in out, out
    assert re.search(r"ncclDevKernel_AllGather_RING_LL +3\.0 per step, us min +100\.0 median +200\.0 max +300\.0",
                     out), out
    assert "GPU busy 0.6 ms, idle 0.2 ms" in out, out
