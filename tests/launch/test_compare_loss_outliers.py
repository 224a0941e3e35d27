"""benchmarks/hf_deepspeed_compare.py lists single-step loss outliers: the steps where an arm's loss exceeds that
of the bf16 run at the same micro-batch (the same batches) by more than the threshold, held against bf16_ckpt for a
*_ckpt arm; runs without a BF16 partner, failed runs and BF16 itself list nothing."""
from pathlib import Path

from script_modules import load_script

REPO = Path(__file__).resolve().parents[2]


def run(arm, micro, losses):
    return {"arm": arm, "micro_batch": micro, "curve": [(i + 1, loss) for i, loss in enumerate(losses)]}


def test_steps_above_bf16_by_more_than_the_threshold_are_listed():
    compare = load_script(REPO / "benchmarks" / "hf_deepspeed_compare.py", "compare_for_outliers")
    rows = [run("bf16", 2, [10.8, 9.0, 7.7, 7.4]),
            run("coat", 2, [10.8, 9.1, 10.97, 7.3]),            # step 3: 10.97 - 7.7 = 3.27
            run("coat", 8, [10.8, 12.0]),                       # no bf16 run at micro-batch 8
            run("bf16_ckpt", 4, [10.0, 8.0]),
            run("coat_ckpt", 4, [10.0, 8.6]),                   # 0.6 above bf16_ckpt, not held against bf16
            {"arm": "coat_graphs", "micro_batch": 2, "error": "out of memory"}]
    found = compare.loss_outliers(rows, threshold=0.5)
    assert set(found) == {("coat", 2), ("coat_ckpt", 4)}
    [(step, gap)] = found[("coat", 2)]
    assert step == 3 and abs(gap - (10.97 - 7.7)) < 1e-12
    [(step, gap)] = found[("coat_ckpt", 4)]
    assert step == 2 and abs(gap - 0.6) < 1e-12
    assert compare.loss_outliers(rows, threshold=4.0) == {}
