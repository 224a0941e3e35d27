"""GPU checks (marker `gpu`): skipped on machines without CUDA. Run on the GPU machine with
`python -m pytest -q -m gpu tests/gpu`, also from a copy of tests/ beside an installed package (no pyproject.toml
there to put tests/jobs on the path: done here)."""
import sys
from pathlib import Path

import pytest
import torch

JOBS = str(Path(__file__).resolve().parents[1] / "jobs")
if JOBS not in sys.path:
    sys.path.insert(0, JOBS)


def pytest_configure(config):
    """The marker, also where pyproject.toml (which registers it) is not beside tests/."""
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (tests/gpu; skipped without one)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
