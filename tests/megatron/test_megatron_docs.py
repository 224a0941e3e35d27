"""docs/megatron.md's own-training-loop script runs as written: the code block after the marker comment is run in a
fresh interpreter (gloo, one process, CPU unless CUDA is there) and must train: ten steps, the loss falling."""
import os
import re
import subprocess
import sys
from pathlib import Path

from rank_helpers import free_port

DOC = Path(__file__).resolve().parents[2] / "docs" / "megatron.md"
MARKER = "<!-- tests/megatron/test_megatron_docs.py runs the next code block as written -->"


def documented_script() -> str:
    text = DOC.read_text()
    assert text.count(MARKER) == 1, f"{DOC.name} must hold the marker once: {MARKER}"
    block = re.match(r"\s*```python\n(.*?)\n```", text.split(MARKER, 1)[1], re.S)
    assert block, "the marker must be followed by a ```python block"
    return block.group(1)


def run_documented_script(tmp_path):
    """Run the doc's script as written: (the finished process, its per-step losses)."""
    script = tmp_path / "own_loop.py"
    script.write_text(documented_script())
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"})
    return proc, [float(v) for v in re.findall(r"^step \d+: loss ([0-9.]+)$", proc.stdout, re.M)]


def test_own_training_loop_from_the_docs_trains(tmp_path):
    proc, losses = run_documented_script(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(losses) == 10, proc.stdout[-3000:]
    assert losses[-1] < 0.6 * losses[0], losses
