"""What coat_ds adds to every DeepSpeedEngine, whichever way it is built (`deepspeed.initialize`, accelerate, the HF
Trainer), by wrapping `DeepSpeedEngine.__init__` once (coat_ds.patch_sites.ENGINE_INIT; subclasses such as the
pipeline and hybrid engines run it through `super().__init__`):

- before DeepSpeed's own check of the ds_config's optimizer type, a near miss of "CoatFP8AdamW" (a wrong case, a
  typo) fails with the right name instead of DeepSpeed's "is not a supported DeepSpeed Optimizer";
- the `"coat"` section (coat_ds.ds_config): with `"fp8_activations": true` the model is converted
  (coat_hf.convert_to_coat) before DeepSpeed wraps and partitions it, and put back as it was when DeepSpeed's own
  checks then refuse the config (coat_ds.model_snapshot); `"backend": "triton"` without CUDA is refused; a top-level
  key that looks like a misspelt "coat" ("COAT", "coat_fp8", ...) is an error, since DeepSpeed would ignore it;
  `"cuda_graphs": true` under ZeRO-3 (where the layers run eagerly) is named in a warning;
- after the engine is built: under ZeRO-1/2 each parameter is linked to its optimizer (DeepSpeed's
  `_create_optimizer_mapping`, which DeepSpeed itself runs only with CPU offload), for
  coat_ds.full_optimizer_state; the converted model's weight-cache clock ticks after every step of the engine's torch
  optimizer, and under ZeRO-3 the parameters the COAT forwards read from submodules (q/k/v, gate/up, ... and the
  LM head for the chunked loss) are registered with the module that reads them, so ZeRO-3 gathers them there; under
  ZeRO-1/2 the optimizer step borrows the memory of the model's CUDA-graph pool (coat_ds.graph_pool_step).
"""
from __future__ import annotations

import difflib
import logging

import torch

from coat_kernels.optim.base import CoatFP8Optimizer

from . import patch_sites
from .graph_pool_step import lend_graph_pool_to_steps
from .model_snapshot import ModelSnapshot
from .optimizer import OPTIMIZER_NAME

logger = logging.getLogger("coat_ds")


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


def check_backend_device(backend: str) -> None:
    """ValueError for "backend": "triton" on a machine without CUDA (and without Triton's interpreter), at
    deepspeed.initialize rather than at the first forward."""
    from coat_kernels import triton_fp8

    if backend == "triton" and not torch.cuda.is_available() and not triton_fp8.INTERPRET:
        raise ValueError('ds_config "coat": "backend": "triton" runs the Triton kernels, which need CUDA; this '
                         'machine has none. Use "backend": "auto" (on a CPU: the bit-exact torch path) or "torch"')


def convert_for_section(model, ds_config: dict | None, config_class) -> bool:
    """Convert `model` when the ds_config's "coat" section asks for FP8 activations; returns whether it did."""
    from .ds_config import parse_section

    section = parse_section(ds_config)
    if section is None or not section.fp8_activations:
        return False
    check_backend_device(section.activation.backend)
    from coat_hf import convert_to_coat

    stage = config_class.zero_optimization_stage if config_class is not None else 0
    accumulation = config_class.gradient_accumulation_steps if config_class is not None else 1
    if section.activation.cuda_graphs and stage == 3:
        logger.warning('ds_config "coat": "cuda_graphs": true has no effect under ZeRO-3: its parameters are gathered '
                       "by module hooks around each layer, which a graph replay would bypass, so the decoder layers "
                       "run eagerly (graphs apply under ZeRO-0/1/2)")
    convert_to_coat(model, section.activation_config(stage, accumulation or 1), chunked_loss=section.chunked_loss)
    return True


def finish_engine(engine) -> None:
    """Link the parameters of a ZeRO-1/2 COAT optimizer (CoatFP8AdamW, CoatFP8Lion) to it; tie a converted model's
    runtime to the engine's optimizer; ZeRO-3: register the parameters COAT reads."""
    from coat_hf import coat_runtime
    from coat_hf.causal_lm import CoatCausalLM
    from coat_hf.decoder import CoatDecoderLayer

    wrapper = getattr(engine, "optimizer", None)
    if isinstance(getattr(engine, "basic_optimizer", None), CoatFP8Optimizer) and \
            hasattr(wrapper, "_create_optimizer_mapping"):
        # DeepSpeed's own link from each parameter to its ZeRO-1/2 optimizer (made by DeepSpeed only with CPU
        # offload): coat_ds.full_optimizer_state finds the FP8 states through it
        wrapper._create_optimizer_mapping()
    runtime = coat_runtime(getattr(engine, "module", None))
    if runtime is None:
        return
    optimizer = getattr(engine, "basic_optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):
        runtime.attach_optimizer(optimizer)
    if isinstance(wrapper, patch_sites.resolve(patch_sites.ZERO_1_2)):
        lend_graph_pool_to_steps(wrapper, runtime.graph_pool)
    if engine.zero_optimization_stage() == 3:
        from deepspeed.runtime.zero import register_external_parameter

        for module in engine.module.modules():
            if isinstance(module, CoatDecoderLayer):
                for child in module.children():
                    for p in child.parameters():
                        register_external_parameter(module, p)
            elif isinstance(module, CoatCausalLM):
                register_external_parameter(module, module.lm_head.weight)


def install() -> None:
    """Idempotent: wrap DeepSpeedEngine.__init__ (coat_ds.patch_sites.ENGINE_INIT)."""
    patch_sites.wrap(patch_sites.ENGINE_INIT, _engine_init_with_coat)


def _engine_init_with_coat(original):
    def __init__(self, *args, **kwargs):
        config_class = kwargs.get("config_class")
        if config_class is not None:
            check_optimizer_type(getattr(config_class, "optimizer_name", None))
        model = kwargs.get("model", args[1] if len(args) > 1 else None)
        snapshot = ModelSnapshot(model) if isinstance(model, torch.nn.Module) else None
        converted = model is not None and convert_for_section(model, kwargs.get("config"), config_class)
        try:
            original(self, *args, **kwargs)
        except BaseException:
            if converted:  # DeepSpeed refused the config: the caller gets back the model it passed
                snapshot.restore()
            raise
        finish_engine(self)  # also for a model converted by the user before deepspeed.initialize

    return __init__
