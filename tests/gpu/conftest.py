"""GPU checks (marker `gpu`): skipped on machines without CUDA. Run on the GPU machine with
`python -m pytest -q -m gpu tests/gpu`."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
