"""`convert_to_coat(model, config)`: a Hugging Face decoder model onto COAT's FP8 activation blocks, in place.

Every decoder layer of a known family (coat_hf.families.FAMILIES) gains the COAT forward (coat_hf.decoder) by a class
change: it keeps its modules and parameters (names, shapes, dtypes: `state_dict()`, `save_pretrained` and existing
checkpoints are unchanged). A causal LM's training loss becomes the chunked LM head + cross-entropy
(coat_hf.causal_lm). The final norm, the LM head and the loss stay BF16.

All converted layers share one `CoatRuntime` (`coat_runtime(model)`); tie it to the optimizer with
`coat_runtime(model).attach_optimizer(optimizer)` so each weight is quantized once per optimizer step (the DeepSpeed
integration does it). Idempotent: converting again changes nothing but the config.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from coat_kernels.act import ActivationConfig, CoatRuntime

from .causal_lm import CoatCausalLM
from .decoder import CoatDecoderLayer, LayerState
from .families import FAMILIES

logger = logging.getLogger("coat_hf")


def coat_runtime(model) -> CoatRuntime | None:
    """The CoatRuntime of a converted model (None if it was not converted)."""
    return getattr(model, "coat_runtime", None)


def convert_to_coat(model: torch.nn.Module, config: ActivationConfig | Mapping | None = None, *,
                    runtime: CoatRuntime | None = None, chunked_loss: bool = True) -> torch.nn.Module:
    """Convert a Hugging Face decoder of a known family (coat_hf.families.FAMILIES: Llama, Mistral, Qwen2, Qwen3,
    OLMo-2, Gemma 3 text) in place (see the module docstring); returns it.

    config: an ActivationConfig, or a mapping of its option names (unknown names and wrong types are errors);
    runtime: the CoatRuntime to share (default: the model's own, made at the first conversion); chunked_loss: the
    chunked LM head + cross-entropy in training (causal LMs). A model none of whose decoder layers can be converted
    is an error that says why."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        raise RuntimeError(f"coat_hf.convert_to_coat needs transformers >= 5 (decoder layers returning a tensor); "
                           f"found {transformers.__version__}")
    config = _activation_config(config)
    if not isinstance(chunked_loss, bool):
        raise TypeError(f"chunked_loss must be True or False, got {chunked_loss!r}")
    if runtime is not None and not isinstance(runtime, CoatRuntime):
        raise TypeError(f"runtime must be a coat_kernels.act.CoatRuntime, got {type(runtime).__name__}")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"coat_hf.convert_to_coat supports Hugging Face decoders with model_type "
                         f"{', '.join(sorted(FAMILIES))} (their *ForCausalLM classes and base models, e.g. "
                         f"LlamaForCausalLM); got {type(model).__name__} (model_type {model_type!r})")
    layer_class, family = FAMILIES[model_type]
    runtime = coat_runtime(model) or runtime or CoatRuntime()
    converted, skipped = 0, []
    for name, module in model.named_modules():
        if type(module).__name__ not in (layer_class, "Coat" + layer_class):
            continue
        problem = family.unsupported(module)
        if problem:
            skipped.append(f"{name} ({problem})")
            continue
        if isinstance(module, CoatDecoderLayer):
            module.coat.config, module.coat.graphs = config, None
        else:
            module.__class__ = _coat_class(type(module), CoatDecoderLayer)
            module.coat = LayerState.new(family, config, runtime)
        converted += 1
    if converted == 0:
        raise ValueError(f"coat_hf.convert_to_coat: no decoder layer of {type(model).__name__} can run on FP8 "
                         f"activations: " + (", ".join(skipped) if skipped else f"it has no {layer_class}"))
    model.coat_runtime = runtime
    # the chunked loss computes plain logits: a model that soft-caps them (Gemma 2 / 3 configs may) keeps its own head
    head = (chunked_loss and hasattr(model, "lm_head") and hasattr(model, "model")
            and getattr(model.config, "final_logit_softcapping", None) is None)
    if head and not isinstance(model, CoatCausalLM):
        model.__class__ = _coat_class(type(model), CoatCausalLM)
    # a normal conversion is news (INFO); layers left unconverted are a warning
    (logger.warning if skipped else logger.info)(
        "coat-fp8: %d decoder layers of %s on FP8 activations (%s); embeddings, final norm and LM head stay in %s%s%s",
        converted, type(model).__name__, config, _embedding_dtype(model),
        " (chunked LM head + cross-entropy in training)" if head else "",
        "; not converted: " + ", ".join(skipped) if skipped else "")
    return model


def _embedding_dtype(model) -> str:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    return str(weight.dtype).removeprefix("torch.") if weight is not None else "the model's dtype"


def _activation_config(config) -> ActivationConfig:
    if config is None:
        return ActivationConfig()
    if isinstance(config, ActivationConfig):
        return config
    if isinstance(config, Mapping):
        return ActivationConfig.from_options(config)
    raise TypeError(f"config must be a coat_kernels.act.ActivationConfig or a mapping of its options, got "
                    f"{type(config).__name__}")


_CLASSES: dict = {}  # (HF class, COAT mix-in) -> their subclass (one per pair, so isinstance and pickling work)


def _coat_class(base, mixin):
    cls = _CLASSES.get((base, mixin))
    if cls is None:
        cls = _CLASSES[(base, mixin)] = type("Coat" + base.__name__, (mixin, base), {"__module__": __name__})
    return cls
