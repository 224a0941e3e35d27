"""A script of the repository (launch/train_ds.py, benchmarks/*.py) imported as a module by its path, so that tests
call its parser and functions without running it."""
from __future__ import annotations

import importlib.util
from pathlib import Path


def load_script(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
