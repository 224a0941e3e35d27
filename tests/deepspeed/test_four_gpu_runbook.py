"""What benchmarks/four_gpu_runbook.md relies on, checked on CPU without training: launch/train_ds.py's 13B, OLMo-2
and Gemma 3 shapes (parameter counts from the published shapes' formulas, their transformers classes, every decoder
layer convertible by its coat_hf family), benchmarks/hf_deepspeed_compare.py's largest-micro-batch search and time
bounds (against a simulated GPU memory), and the runbook's commands themselves (each parses, fits the device's
limits of one command)."""
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from runbook_calls import PROLOGUE, bash_blocks
from script_modules import load_script

REPO = Path(__file__).resolve().parents[2]
RUNBOOK = REPO / "benchmarks" / "four_gpu_runbook.md"


@pytest.fixture(scope="module")
def train_ds():
    return load_script(REPO / "launch" / "train_ds.py", "train_ds_for_runbook")


@pytest.fixture(scope="module")
def compare():
    return load_script(REPO / "benchmarks" / "hf_deepspeed_compare.py", "hf_deepspeed_compare_for_runbook")


def llama_params(vocab, h, ffn, layers):
    """Untied embeddings and LM head; per layer q, k, v, o (MHA), gate, up, down and two norms; the final norm."""
    return 2 * vocab * h + layers * (4 * h * h + 3 * h * ffn + 2 * h) + h


def olmo2_params(vocab, h, ffn, layers):
    """As Llama's, with four norms per layer: q_norm and k_norm over the whole widths (MHA: h each) and the two
    post norms."""
    return 2 * vocab * h + layers * (4 * h * h + 3 * h * ffn + 4 * h) + h


def gemma3_params(vocab, h, ffn, layers, heads, kv_heads, head_dim):
    """Tied embeddings; per layer q and o of heads x head_dim, k and v of kv_heads x head_dim, the GeGLU MLP, four
    norms of h (input, post-attention, pre- and post-feedforward) and the per-head q and k norms."""
    per_layer = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim + 3 * h * ffn + 4 * h + 2 * head_dim
    return vocab * h + layers * per_layer + h


@pytest.mark.parametrize("name, cls, params", [
    ("llama2-13b", "LlamaForCausalLM", llama_params(32000, 5120, 13824, 40)),
    ("olmo2-1b", "Olmo2ForCausalLM", olmo2_params(100352, 2048, 8192, 16)),
    ("gemma3-1b", "Gemma3ForCausalLM", gemma3_params(32000, 1152, 6912, 26, 4, 1, 256)),
])
def test_model_shapes_are_the_published_ones_and_convertible(train_ds, name, cls, params):
    """Built on the meta device (no memory): the class, the parameter count of the shape, and no decoder layer that
    COAT's FP8 blocks refuse (so the "coat" ds_config section converts all of them)."""
    from coat_hf.families import FAMILIES

    model = train_ds.build_model(name, 2048, torch.device("meta"), seed=0)
    assert type(model).__name__ == cls
    assert sum(p.numel() for p in model.parameters()) == params
    layer_class, family = FAMILIES[model.config.model_type]
    assert {type(layer).__name__ for layer in model.model.layers} == {layer_class}
    assert [family.unsupported(layer) for layer in model.model.layers] == [None] * len(model.model.layers)
    if name == "gemma3-1b":  # five sliding-window layers (window 512) to one full-attention layer
        types = model.config.layer_types
        assert [i for i, t in enumerate(types) if t == "full_attention"] == [5, 11, 17, 23]
        assert model.config.sliding_window == 512 and model.config.head_dim == 256
        assert model.config.num_key_value_heads == 1 and model.config.tie_word_embeddings


def run(mb, held=30.0, per_sequence=1.5, fixed=2.0, step_extra=20.0):
    """A first run's summary as train_ds.py writes it on a GPU: last-step phase peaks in GiB."""
    base = dict(phase_base=held, forward_peak=held + fixed + per_sequence * mb * 0.7,
                backward_peak=held + fixed + per_sequence * mb, step_phase_peak=held + step_extra)
    return dict(arm="coat", micro_batch=mb, tokens_per_s=1.0, last_step_phase_peaks_gib=base)


def test_prediction_is_the_largest_batch_whose_forward_and_backward_fit(compare):
    first = run(8)
    per_sequence = (2.0 + 1.5 * 8) / 8  # the fixed buffers counted per sequence: the prediction errs small
    assert compare.predict_largest(first, 76.0) == int((76.0 - 30.0) / per_sequence) == 26
    assert compare.predict_largest(run(8, step_extra=50.0), 76.0) is None  # the step alone does not fit
    assert compare.predict_largest(dict(micro_batch=8, last_step_phase_peaks_gib={}), 76.0) is None  # CPU run


class SimulatedGpu:
    """run_arm's stand-in: a run at micro-batch mb runs out of memory above `largest`; records the runs."""

    def __init__(self, largest):
        self.largest, self.runs = largest, []

    def __call__(self, arm, args, mb, steps, tag, port, clock):
        self.runs.append((arm, mb, tag))
        if mb > self.largest:
            return dict(arm=arm, micro_batch=mb, error="out of memory", oom=True)
        return dict(run(mb), arm=arm, tag=tag, curve=[], peak_memory_gib=[1.0], median_step_ms=1.0, final_loss=1.0)


def search_args(compare, tmp_path, *extra):
    return compare.parse_args(["--arms", "coat_ckpt:16,bf16:4", "--max-batch", "--out", str(tmp_path), *extra])


def test_search_runs_every_first_run_then_the_predictions_within_its_bounds(compare, tmp_path, monkeypatch):
    gpu = SimulatedGpu(largest=25)
    monkeypatch.setattr(compare, "run_arm", gpu)
    monkeypatch.setattr(compare, "total_gib", lambda: 80.0)  # budget 0.96 x 80 = 76.8 GiB
    monkeypatch.setattr(compare, "exit_on_sigterm", lambda: None)  # main's SIGTERM handler: not in pytest
    compare.main(["--arms", "coat_ckpt:16,bf16:4", "--max-batch", "--max-batch-tries", "2", "--out", str(tmp_path),
                  "--curve-arms", "none"])
    # predictions: (76.8 - 30) / ((2 + 1.5 x 16) / 16) = 28.8 and (76.8 - 30) / ((2 + 1.5 x 4) / 4) = 23.4; the first
    # runs of both arms, then each arm's search: 28 is out of memory, 10% smaller (25) fits
    assert gpu.runs == [("coat_ckpt", 16, "fixed"), ("bf16", 4, "fixed"), ("coat_ckpt", 28, "max"),
                        ("coat_ckpt", 25, "max"), ("bf16", 23, "max")]
    md = (tmp_path / "results.md").read_text()
    assert "Largest micro-batch that ran, per arm: coat_ckpt 25, bf16 23" in md
    assert "predicted from the first run, per arm: coat_ckpt 28, bf16 23" in md


def test_search_is_bounded_by_tries_cap_gain_and_out_of_memory(compare, tmp_path, monkeypatch):
    monkeypatch.setattr(compare, "total_gib", lambda: 80.0)
    gpu = SimulatedGpu(largest=10)
    monkeypatch.setattr(compare, "run_arm", gpu)
    args = search_args(compare, tmp_path, "--max-batch-tries", "1")
    clock = compare.Clock(None, 900, 60)
    assert [r["micro_batch"] for r in compare.largest_batch("coat", run(8), args, 0, clock)] == [26]  # one try
    gpu.runs.clear()
    args = search_args(compare, tmp_path, "--max-micro-batch", "12")
    assert [r["micro_batch"] for r in compare.largest_batch("coat", run(8), args, 0, clock)] == [12, 10]
    gpu.runs.clear()
    args = search_args(compare, tmp_path, "--max-batch-min-gain", "1.5", "--max-micro-batch", "11")
    first = run(8)
    assert compare.largest_batch("coat", first, args, 0, clock) == [] and first["largest"]  # 11 < 1.5 x 8
    # never at or above a micro-batch known to run out of memory
    assert [r["micro_batch"] for r in compare.largest_batch("coat", run(8), args, 0, clock, too_big=10)] == []
    args = search_args(compare, tmp_path)
    assert [r["micro_batch"] for r in compare.largest_batch("coat", run(4), args, 0, clock, too_big=10)] == [9]


def test_no_search_run_starts_that_would_outlast_the_budget(compare, tmp_path, monkeypatch):
    """A first run of 5 steps at micro-batch 8 took 100 s with a median step of 4 s: 80 s of start; 5 steps at the
    predicted 26 should take 80 + 5 x 4 x 26 / 8 = 145 s."""
    monkeypatch.setattr(compare, "total_gib", lambda: 80.0)
    gpu = SimulatedGpu(largest=30)
    monkeypatch.setattr(compare, "run_arm", gpu)
    args = search_args(compare, tmp_path, "--max-batch-steps", "5")
    first = dict(run(8), wall_s=100.0, median_step_ms=4000.0, curve=[(s, 1.0) for s in range(1, 6)])
    assert compare.expected_seconds(first, 26, 5) == pytest.approx(145.0)
    assert compare.largest_batch("coat", first, args, 0, compare.Clock(140.0, 900, 10)) == []
    assert first["largest_not_run_for_time"] == 26 and not gpu.runs
    assert [r["micro_batch"] for r in compare.largest_batch("coat", first, args, 0, compare.Clock(150.0, 900, 10))] \
        == [26]


def test_first_run_out_of_memory_is_halved_within_the_tries(compare, tmp_path, monkeypatch):
    gpu = SimulatedGpu(largest=5)
    monkeypatch.setattr(compare, "run_arm", gpu)
    args = search_args(compare, tmp_path, "--max-batch-tries", "2")
    runs, too_big = compare.first_run("coat", 32, args, 5, 0, compare.Clock(None, 900, 60))
    assert [r["micro_batch"] for r in runs] == [32, 16, 8] and too_big == 8 and runs[-1]["oom"]
    gpu.runs.clear()
    runs, too_big = compare.first_run("coat", 16, args, 5, 0, compare.Clock(None, 900, 60))
    assert [r["micro_batch"] for r in runs] == [16, 8, 4] and too_big == 8 and "error" not in runs[-1]


def test_arm_micro_batches_and_bad_arms(compare):
    assert compare.parse_arms("coat_ckpt:32,bf16", 8) == [("coat_ckpt", 32), ("bf16", 8)]
    with pytest.raises(SystemExit, match="unknown arm 'coat_fast'"):
        compare.parse_arms("coat_fast:4", 8)
    with pytest.raises(SystemExit, match="must be a positive integer"):
        compare.parse_arms("coat:0", 8)


def test_no_run_starts_once_the_time_budget_is_spent(compare, tmp_path):
    args = search_args(compare, tmp_path)
    clock = compare.Clock(budget_s=0.0, run_timeout_s=900, min_run_s=60)
    result = compare.run_arm("coat", args, 4, 5, "fixed", 29999, clock)  # returns before any process starts
    assert result["skipped"] and "time budget" in result["error"] and not list(tmp_path.iterdir())
    clock = compare.Clock(budget_s=100.0, run_timeout_s=900, min_run_s=60)
    assert 99 < clock.timeout() <= 100


def sleeper_with_a_child(tmp_path):
    """A script that starts a child, writes the child's pid and sleeps: torchrun and one rank."""
    pid_file, script = tmp_path / "child.pid", tmp_path / "parent.py"
    script.write_text("import subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
                      "time.sleep(60)\n")
    return script, pid_file


def assert_ended(pid):
    with pytest.raises(ProcessLookupError):
        for _ in range(50):  # gone once reaped (by its parent or by init)
            os.kill(pid, 0)
            time.sleep(0.1)


def test_a_run_past_its_timeout_is_ended_with_its_children(compare, tmp_path):
    """torchrun's ranks are its children: the whole process group ends at the timeout."""
    script, pid_file = sleeper_with_a_child(tmp_path)
    start = time.monotonic()
    with open(tmp_path / "log", "w") as log:
        assert compare.run_process_group([sys.executable, str(script)], log, timeout=3) is None
    assert time.monotonic() - start < 30
    assert_ended(int(pid_file.read_text()))


def test_sigterm_to_the_compare_ends_the_run_in_flight(tmp_path):
    """What `timeout` does to a call running too long: SIGTERM to the compare process, whose run in flight (a
    process group of its own) must not outlive it."""
    script, pid_file = sleeper_with_a_child(tmp_path)
    driver = (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('c', "
              f"{str(REPO / 'benchmarks' / 'hf_deepspeed_compare.py')!r}); c = importlib.util.module_from_spec(spec); "
              f"spec.loader.exec_module(c); c.exit_on_sigterm(); "
              f"c.run_process_group([sys.executable, {str(script)!r}], open({str(tmp_path / 'log')!r}, 'w'), 60)")
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=REPO)
    for _ in range(300):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert_ended(int(pid_file.read_text()))


def runbook_blocks():
    return bash_blocks(RUNBOOK.read_text())


def test_runbook_commands_parse_and_fit_one_device_call(compare, train_ds):
    """Every call begins with the wheels' install, stays within the 2,000 characters of one command, leaves one
    archive under $OUT, and leaves 90 s of the 600 s to the install and the archive: its timeouts and time budgets
    (invocations started with `&` run at the same time) add up to at most 510 s. Each compare invocation, for each
    value its ARMS variable takes, parses and names a model of MODELS and arms that exist."""
    blocks = runbook_blocks()
    assert len(blocks) == 3
    invocations = 0
    for block in blocks:
        assert block.startswith(PROLOGUE + "\n") and len(block) <= 2000, block[:200]
        assert len(re.findall(r"tar czf \$OUT/\S+\.tgz", block)) == 1, block
        serial = [float(t) for t in re.findall(r"timeout -k \d+ (\d+)", block)]
        parallel = []
        for line in block.splitlines():
            budget = re.search(r"--time-budget (\S+)", line)
            if budget:
                (parallel if line.rstrip().endswith("&") else serial).append(float(budget.group(1)))
        assert serial or parallel
        assert sum(serial) + max(parallel, default=0) <= 510, block
        arms_values = re.findall(r"ARMS=([^;\s]+)", block) or [""]
        for line in block.splitlines():
            if "benchmarks/hf_deepspeed_compare.py" not in line:
                continue
            for arms in arms_values:
                words = shlex.split(line.replace("$ARMS", arms))
                argv = words[words.index("benchmarks/hf_deepspeed_compare.py") + 1:]
                argv = argv[:argv.index(">")] if ">" in argv else argv
                args = compare.parse_args(argv)
                assert args.model in train_ds.MODELS
                assert all(1 <= micro <= args.max_micro_batch for _, micro in
                           compare.parse_arms(args.arms, args.micro_batch))
                invocations += 1
    assert invocations == 2 + 2  # calls 1 and 3, for both GPU sizes


def test_runbook_checkpoint_selection_names_the_four_gpu_test():
    """`-k four` in call 2 selects the 4 -> 2 -> 4 test of the GPU file and not the 2-GPU flow."""
    block = runbook_blocks()[1]
    selection = re.search(r"pytest .*?(tests/gpu/\S+\.py) -k (\S+)", block)
    source = (REPO / selection.group(1)).read_text()
    tests = re.findall(r"^def (test_\w+)", source, re.M)
    assert [t for t in tests if selection.group(2) in t] == ["test_resume_four_two_four_on_gpus"]
