"""Run coat_megatron.pretrain_gpt as if TransformerEngine were not installed (for the comparison's "without TE"
arms on a machine that has it): imports of transformer_engine fail, so megatron-core takes its no-TE paths.

    python -m launch.without_te [pretrain_gpt arguments]
"""
from __future__ import annotations

import importlib.abc
import runpy
import sys


class _HideTransformerEngine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "transformer_engine" or name.startswith("transformer_engine."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by launch.without_te)", name=name)
        return None


def main():
    sys.meta_path.insert(0, _HideTransformerEngine())
    sys.argv[0] = "coat_megatron.pretrain_gpt"
    runpy.run_module("coat_megatron.pretrain_gpt", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
