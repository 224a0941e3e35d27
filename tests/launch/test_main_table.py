"""launch.main_table: BENCHMARKS.md's main-job table is what the committed results files give (a hand edit or a new
results file without a rerun of the table fails here), and a row says what the results hold."""
import json

from launch import main_table as T


def test_benchmarks_md_table_is_generated_from_the_results_files():
    assert T.main(["--check"]) == 0, "run python -m launch.main_table"


def results(device="cpu", peak=None):
    arm = dict(val=[[200, 6.0]], tokens_per_s=5000.0, seconds=37.2, peak_gib=peak)
    coat = dict(val=[[200, 6.03]], tokens_per_s=2500.0, seconds=83.0, peak_gib=peak)
    machine = ({"device": "cpu", "cpu": "AVX2", "threads": 1, "threads_reason": "1.0 of 2 usable cores idle",
                "load_average_at_end": [1.5, 1.25, 1.0], "seconds": 131.4} if device == "cpu"
               else {"device": device, "seconds": 45.0})
    return dict(args=dict(steps=200, batch=8, seq=128), parameters=1_830_000, machine=machine,
                results=[dict(name="BF16", **arm), dict(name="COAT", **coat)])


def test_a_cpu_row_gives_losses_gap_speed_and_the_load(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(results()))
    header, rule, row = T.table([path]).splitlines()
    assert header == T.HEADER[0] and rule == T.HEADER[1]
    assert row == ("| CPU (AVX2), 1 thread(s) (1.0 of 2 usable cores idle at start; load average 1.50, 1.25, 1.00 "
                   "at the end) | `python -m launch.main` (1.8M parameters, 200 steps of 8 x 128 tokens) | val 6.0000, "
                   "5,000 tok/s, 37 s | val 6.0300 (+0.50%), 2,500 tok/s (0.50x), 83 s | 2 min 11 s |")


def test_a_gpu_row_gives_the_peak_memory(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(results("NVIDIA H200", peak=9.93)))
    row = T.table([path]).splitlines()[2]
    assert row.startswith("| NVIDIA H200 | ") and "5,000 tok/s, 9.93 GiB peak, 37 s" in row and row.endswith("| 45 s |")


def test_the_table_replaces_only_what_lies_between_the_markers():
    text = f"before\n{T.MARKERS[0]}\nold table\n{T.MARKERS[1]}\nafter\n"
    assert T.with_table(text, "new") == f"before\n{T.MARKERS[0]}\nnew\n{T.MARKERS[1]}\nafter\n"
