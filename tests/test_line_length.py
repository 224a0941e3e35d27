"""The repository's line-length rule (120 characters, pyproject.toml's [tool.ruff]) holds for every Python file."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_no_line_longer_than_120_characters():
    if shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"],
                                                        capture_output=True).returncode != 0:
        pytest.fail("ruff is not installed: bash launch/setup.sh installs it (pyproject.toml's tests extra)")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
