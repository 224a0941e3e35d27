"""What the runbooks' device calls share (benchmarks/*_runbook.md): the line each call begins with (the wheels'
install on the GPU machine, then the project's), and the calls themselves, the ```bash blocks of a runbook's text."""
from __future__ import annotations

import re

PROLOGUE = ("export TORCH_CUDA_ARCH_LIST=9.0; python3 -m pip install -q --no-index --no-deps --no-compile "
            "--no-cache-dir --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site; python -m pip "
            "install -q --no-deps --no-build-isolation --no-index .")


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)
