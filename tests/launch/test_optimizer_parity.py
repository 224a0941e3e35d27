"""launch/optimizer_parity.py on a tiny Llama: every arm of launch/optimizer_arms.py runs a few steps on the CPU (or
records why it cannot), and launch/optimizer_report.py builds its table from those runs' own JSON files."""
import importlib.util
import json
import sysconfig

import pytest
import torch

from launch import optimizer_parity, optimizer_report
from launch.optimizer_arms import ARMS

TINY = ["--size", "small", "--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--ffn", "128",
        "--vocab", "512", "--seq", "32", "--batch", "4", "--steps", "6", "--eval-every", "3", "--eval-batches", "2",
        "--threads", "1", "--no-progress", "--device", "cpu"]
MUST_RUN_ON_CPU = ("fp32", "bf16_moments", "coat", "coat_noexp")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every arm (fp32 with two seeds and the moment errors) on a corpus of the stdlib's email package, cached in a
    private directory."""
    root = tmp_path_factory.mktemp("optimizer_parity")
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
    out = root / "runs"
    common = TINY + ["--out", str(out), "--stdlib", sysconfig.get_paths()["stdlib"] + "/email"]
    threads = torch.get_num_threads()
    try:
        records = {(arm, 0): optimizer_parity.train(["--arm", arm] + common) for arm in ARMS if arm != "fp32"}
        records[("fp32", 0)] = optimizer_parity.train(["--arm", "fp32", "--moment-error-every", "3"] + common)
        records[("fp32", 1)] = optimizer_parity.train(["--arm", "fp32", "--seed", "1"] + common)
    finally:
        patch.undo()
        torch.set_num_threads(threads)
    return out, records


def test_every_arm_runs_or_says_why(runs):
    out, records = runs
    for arm in MUST_RUN_ON_CPU:
        record = json.loads((out / f"{arm}-seed0.json").read_text())
        assert record["finished"] and record["unavailable"] is None, arm
        assert [s for s, _ in record["val"]] == [3, 6] and len(record["train"]) == 6
        assert record["timed_steps"] == 0 and record["step_ms_median"] is None  # six steps: all inside the warm-up
    flash = records[("flashoptim", 0)]
    assert "CUDA" in flash["unavailable"] or "not installed" in flash["unavailable"]
    torchao_run = records[("torchao_fp8", 0)]
    if importlib.util.find_spec("torchao") is not None:  # it runs its own step, eagerly on the CPU
        assert torchao_run["finished"] and torchao_run["optimizer"] == "AdamWFp8Eager"
    else:
        assert "torchao is not installed" in torchao_run["unavailable"]


def test_the_runs_start_from_one_initialisation_and_differ_only_by_the_optimizer(runs):
    _, records = runs
    first_losses = {arm: records[(arm, 0)]["train"][0][1] for arm in MUST_RUN_ON_CPU}
    # the first loss is computed before any step: the same model and batch in every arm
    assert len(set(first_losses.values())) == 1, first_losses
    assert records[("fp32", 1)]["train"][0][1] != first_losses["fp32"]
    finals = {arm: records[(arm, 0)]["val"][-1][1] for arm in MUST_RUN_ON_CPU}
    assert len(set(finals.values())) == len(finals), finals  # every optimizer leaves its own trace


def test_bytes_per_parameter_come_from_the_tensors(runs):
    _, records = runs
    per_param = {arm: {k: v / records[(arm, 0)]["params"] for k, v in records[(arm, 0)]["bytes"].items()}
                 for arm in MUST_RUN_ON_CPU}
    # fp32 master weights and gradients: 4 + 4 bytes; moments: 8 (fp32), 4 (bf16), 2 FP8 codes + 3 fp32 metadata
    # per group of 128 (2.1875) and a step and segment table per tensor (COAT)
    for arm in MUST_RUN_ON_CPU:
        assert per_param[arm]["master"] == 4 and per_param[arm]["gradients"] == 4
    assert 8 < per_param["fp32"]["state"] < 8.001
    assert 4 < per_param["bf16_moments"]["state"] < 4.001
    for arm in ("coat", "coat_noexp"):
        assert 2.1875 < per_param[arm]["state"] < 2.22
    assert per_param["coat"]["total"] == pytest.approx(8 + per_param["coat"]["state"])


def test_report_table_is_built_from_the_runs(runs):
    out, records = runs
    text = optimizer_report.report(str(out))
    assert (out / "results.md").read_text().strip() == text.strip()
    assert (out / "curves.png").stat().st_size > 0 and (out / "moment_error.png").stat().st_size > 0
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    for arm in MUST_RUN_ON_CPU:
        row = next(line for line in text.splitlines() if line.startswith(f"| {ARMS[arm].label} | 0 |"))
        assert f"| {records[(arm, 0)]['val'][-1][1]:.4f} |" in row
    assert ARMS["flashoptim"].label in rows and "not run: " + records[("flashoptim", 0)]["unavailable"] in text
    reference, other = records[("fp32", 0)]["val"][-1][1], records[("fp32", 1)]["val"][-1][1]
    assert f"spread (max - min) {abs(other - reference) / reference * 100:.3f}%" in text
    coat_gap = (records[("coat", 0)]["val"][-1][1] - reference) / reference * 100
    assert f"| {coat_gap:+.3f}% |" in text
    assert "| step | coat | coat_noexp | torchao_fp8 | flashoptim | bf16 |" in text
    assert len(records[("fp32", 0)]["moment_error"]) == 2  # steps 3 and 6


def test_a_missing_arm_is_listed(tmp_path, runs):
    out, _ = runs
    (tmp_path / "fp32-seed0.json").write_text((out / "fp32-seed0.json").read_text())
    text = optimizer_report.report(str(tmp_path))
    assert f"| {ARMS['coat'].label} | - | {ARMS['coat'].moments} | no run in {tmp_path} |" in text
