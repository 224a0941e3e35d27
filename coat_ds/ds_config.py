"""The `"coat"` section of a ds_config: COAT's FP8 activations switched on by configuration alone.

    "coat": {"fp8_activations": true}
    "coat": {"fp8_activations": true, "cache_weights": "auto", "fprop_fast_accum": false, "chunked_loss": true,
             "backend": "auto", "cuda_graphs": false, "cuda_graph_pad_multiple": 128, "cuda_graph_shapes": 32}

fp8_activations: convert the model (a Hugging Face Llama-family decoder, coat_hf) before DeepSpeed wraps it.
cache_weights: keep both FP8 copies of each weight between optimizer steps ("auto": when gradient accumulation has
more than one micro-batch per step and ZeRO is below stage 3, where the copies would undo ZeRO-3's partitioning);
fprop_fast_accum, backend, cuda_graphs: coat_kernels.act.ActivationConfig (cuda_graphs: each decoder layer's forward
and backward replayed as CUDA graphs, for ZeRO-0/1/2; under ZeRO-3 the layers run eagerly; cuda_graph_pad_multiple: the
sequence padded inside each graphed layer to a multiple of this; cuda_graph_shapes: for how many length buckets);
chunked_loss: the LM head + cross-entropy in chunks.
Unknown keys and wrong types are errors naming the valid ones. DeepSpeed ignores top-level keys it does not know, so
a top-level key that looks like a misspelt "coat" ("COAT", "Coat", "coat_fp8", "coat-config", "caot") is an error
too: without it the model would train in BF16 without a word.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

from coat_kernels.act import ActivationConfig
from coat_kernels.options import check_bool, check_int, from_mapping

SECTION = "coat"
WHERE = f'ds_config "{SECTION}": '


@dataclass(frozen=True)
class CoatSection:
    fp8_activations: bool = False
    cache_weights: bool | str = "auto"
    fprop_fast_accum: bool = False
    chunked_loss: bool = True
    backend: str = "auto"
    cuda_graphs: bool = False
    cuda_graph_pad_multiple: int = 128
    cuda_graph_shapes: int = 32

    def __post_init__(self):
        for name in ("fp8_activations", "fprop_fast_accum", "chunked_loss", "cuda_graphs"):
            check_bool(name, getattr(self, name), WHERE, spelled="true or false")
        check_int("cuda_graph_pad_multiple", self.cuda_graph_pad_multiple, WHERE, minimum=1)
        check_int("cuda_graph_shapes", self.cuda_graph_shapes, WHERE, minimum=1)
        if self.cache_weights != "auto" and not isinstance(self.cache_weights, bool):
            raise TypeError(f'ds_config "coat": cache_weights must be "auto", true or false, got '
                            f"{self.cache_weights!r}")
        ActivationConfig(backend=self.backend)  # validates the backend

    def activation_config(self, zero_stage: int, gradient_accumulation_steps: int) -> ActivationConfig:
        cache = self.cache_weights
        if cache == "auto":
            cache = gradient_accumulation_steps > 1 and zero_stage < 3
        return ActivationConfig(backend=self.backend, fprop_fast_accum=self.fprop_fast_accum, cache_weights=cache,
                                cuda_graphs=self.cuda_graphs, cuda_graph_pad_multiple=self.cuda_graph_pad_multiple,
                                cuda_graph_shapes=self.cuda_graph_shapes)


def looks_like_section_name(key) -> bool:
    """Whether a top-level key other than "coat" reads like a misspelling of it (case, separators, a suffix, a
    swapped or missing letter)."""
    if not isinstance(key, str) or key == SECTION:
        return False
    folded = "".join(c for c in key.lower() if c.isalnum())
    return folded.startswith(SECTION) or difflib.SequenceMatcher(None, folded, SECTION).ratio() >= 0.75


def check_section_name(ds_config: dict) -> None:
    """ValueError for top-level keys that look like a misspelt "coat" (DeepSpeed would ignore them silently)."""
    near = [key for key in ds_config if looks_like_section_name(key)]
    if near:
        raise ValueError(f"ds_config has top-level key(s) {near}, which DeepSpeed ignores; did you mean '{SECTION}'? "
                         f'coat-fp8 reads only "{SECTION}" (lower case), e.g. "{SECTION}": {{"fp8_activations": true}}')


def parse_section(ds_config: dict | None) -> CoatSection | None:
    """The ds_config's "coat" section, validated (None when there is none); a near miss of the name is an error."""
    if not isinstance(ds_config, dict):
        return None
    check_section_name(ds_config)
    if SECTION not in ds_config:
        return None
    section = ds_config[SECTION]
    if not isinstance(section, dict):
        raise TypeError(f'ds_config "coat" must be an object like {{"fp8_activations": true}}, got {section!r}')
    return from_mapping(CoatSection, section, f'ds_config "{SECTION}" key(s)')
