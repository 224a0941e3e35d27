"""COAT for Hugging Face decoder models: `coat_hf.convert_to_coat(model, config)`.

Converts, in place, the decoder layers of a Llama-family `transformers` model to COAT's FP8 activation blocks
(`coat_kernels.act`) and, for causal LMs in training, the LM head + cross-entropy to the chunked loss. Parameters,
names and checkpoints are unchanged. Works with any training loop (plain PyTorch, the Trainer, accelerate,
DeepSpeed); it imports neither DeepSpeed nor Megatron. DeepSpeed users get the same conversion from the ds_config's
`"coat"` section (coat_ds).

Modules: `convert` (convert_to_coat, the model-family table), `decoder` (the one decoder-layer composition that
users and the benchmarks run), `families` (what differs between model families: one module each), `causal_lm`
(chunked loss, KV cache).
"""
from coat_kernels.act import ActivationConfig, CoatRuntime

from .convert import coat_runtime, convert_to_coat

__all__ = ["ActivationConfig", "CoatRuntime", "coat_runtime", "convert_to_coat"]
