"""The `"coat"` section of a ds_config: COAT's FP8 activations switched on by configuration alone.

    "coat": {"fp8_activations": true}
    "coat": {"fp8_activations": true, "cache_weights": "auto", "chunked_loss": true, "fprop_fast_accum": false,
             "backend": "auto", "cuda_graphs": false, "cuda_graph_pad_multiple": 128, "cuda_graph_shapes": 32}

The section's own keys:
fp8_activations: convert the model (a Hugging Face Llama-family decoder, coat_hf) before DeepSpeed wraps it.
cache_weights: keep both FP8 copies of each weight between optimizer steps ("auto": when gradient accumulation has
more than one micro-batch per step and ZeRO is below stage 3, where the copies would undo ZeRO-3's partitioning).
chunked_loss: the LM head + cross-entropy in chunks.
Every other key is an option of coat_kernels.act.ActivationConfig (backend, fprop_fast_accum, cuda_graphs, ...: the
dataclass's fields, so a new option is accepted here as it is added there) and is handed to it unchanged.
Unknown keys and wrong types are errors naming the valid keys. DeepSpeed ignores top-level keys it does not know, so
a top-level key that looks like a misspelt "coat" ("COAT", "Coat", "coat_fp8", "coat-config", "caot") is an error
too: without it the model would train in BF16 without a word.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field

from coat_kernels.act import ActivationConfig
from coat_kernels.options import check_bool, check_names

SECTION = "coat"
WHERE = f'ds_config "{SECTION}": '
OWN_KEYS = ("fp8_activations", "cache_weights", "chunked_loss")
# ActivationConfig's options, less cache_weights, which the section owns (it adds "auto")
ACTIVATION_KEYS = tuple(f.name for f in dataclasses.fields(ActivationConfig) if f.name not in OWN_KEYS)


@dataclass(frozen=True)
class CoatSection:
    fp8_activations: bool = False
    cache_weights: bool | str = "auto"
    chunked_loss: bool = True
    activation: ActivationConfig = field(default_factory=ActivationConfig)  # from the section's other keys

    def __post_init__(self):
        for name in ("fp8_activations", "chunked_loss"):
            check_bool(name, getattr(self, name), WHERE, spelled="true or false")
        if self.cache_weights != "auto" and not isinstance(self.cache_weights, bool):
            raise TypeError(f'{WHERE}cache_weights must be "auto", true or false, got {self.cache_weights!r}')

    @classmethod
    def from_dict(cls, section: dict) -> "CoatSection":
        """The section's own keys kept, every other valid key handed to ActivationConfig (validated there)."""
        check_names(section, OWN_KEYS + ACTIVATION_KEYS, f'ds_config "{SECTION}" key(s)')
        own = {k: v for k, v in section.items() if k in OWN_KEYS}
        options = {k: v for k, v in section.items() if k not in OWN_KEYS}
        try:
            activation = ActivationConfig.from_options(options)
        except (TypeError, ValueError) as exc:  # name the section: the message is ActivationConfig's
            raise type(exc)(f"{WHERE}{exc}") from exc
        return cls(**own, activation=activation)

    def activation_config(self, zero_stage: int, gradient_accumulation_steps: int) -> ActivationConfig:
        cache = self.cache_weights
        if cache == "auto":
            cache = gradient_accumulation_steps > 1 and zero_stage < 3
        return self.activation.replace(cache_weights=cache)


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
    return CoatSection.from_dict(section)
