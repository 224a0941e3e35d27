"""What coat_ds adds to every DeepSpeedEngine, whichever way it is built (`deepspeed.initialize`, accelerate, the HF
Trainer): a check of the ds_config's optimizer type before DeepSpeed's own, so that a near miss of
"CoatFP8AdamW" (a wrong case, a typo) fails with the right name instead of DeepSpeed's "is not a supported
DeepSpeed Optimizer".

`install(engine_cls)` wraps `DeepSpeedEngine.__init__` once (idempotent); subclasses (pipeline, hybrid engines)
run it through `super().__init__`.
"""
from __future__ import annotations

import difflib
import functools

import torch

OPTIMIZER_NAME = "CoatFP8AdamW"


def check_optimizer_type(name) -> None:
    """Raise ValueError when `name` looks like a misspelling of CoatFP8AdamW and names nothing DeepSpeed can build."""
    if not isinstance(name, str) or name == OPTIMIZER_NAME or hasattr(torch.optim, name):
        return
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    if name.lower() in DEEPSPEED_OPTIMIZERS:
        return
    folded = name.lower().replace("_", "").replace("-", "")
    close = difflib.SequenceMatcher(None, folded, OPTIMIZER_NAME.lower()).ratio() >= 0.8
    if folded == OPTIMIZER_NAME.lower() or close:
        raise ValueError(f'ds_config "optimizer": {{"type": "{name}"}} is not an optimizer DeepSpeed knows; '
                         f'did you mean "{OPTIMIZER_NAME}" (coat-fp8\'s FP8 AdamW; the name is case-sensitive)?')


def install(engine_cls) -> None:
    original = engine_cls.__init__
    if getattr(original, "coat_fp8_wrapped", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        config_class = kwargs.get("config_class")
        if config_class is not None:
            check_optimizer_type(getattr(config_class, "optimizer_name", None))
        original(self, *args, **kwargs)

    __init__.coat_fp8_wrapped = True
    engine_cls.__init__ = __init__
