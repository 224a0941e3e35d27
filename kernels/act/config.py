"""The activation half's options: one frozen, validated object given to every FP8 block and module.

backend (coat_kernels.options.BACKENDS): "auto" runs the Triton kernels on CUDA tensors and the torch references
(same math, same FP8 rounding) on CPU tensors; "triton" forces the kernels (CPU tensors then need the Triton
interpreter, TRITON_INTERPRET=1: the tests run them so); "torch" forces the references (on the GPU too: separates a
kernel bug from FP8 rounding).
fprop_fast_accum: forward FP8 GEMMs with Hopper's fast accumulation (partial sums kept in the tensor core's reduced
precision, as TransformerEngine's fprop and torchao's tensorwise recipe do). Off: COAT's fp32 accumulation.
Gradient GEMMs always accumulate in fp32.
cache_weights: quantize each weight once per optimizer step (the runtime's step clock says when a step happened)
and share the FP8 copies between micro-batches and between forward and backward; off: every forward quantizes its
weights and backward re-casts the transposed copy.
transposed_weights: when a weight cache makes the transposed FP8 copy (the dgrad operand). "forward": together with
the forward copy, from one read of the weight, so backward needs no BF16 weight (for engines that release gathered
weights after forward: ZeRO-3). "backward": at the first backward that needs it, from the weight itself, which then
stays referenced by the graph (no copy); the copy does not occupy memory through the forward, where activation memory
peaks (for engines whose weights stay in memory: Megatron, ZeRO-1/2).
cuda_graphs: layers that support it (coat_hf's decoder layers) capture their forward and backward as CUDA graphs per
length bucket and replay them (coat_kernels.act.layer_graphs): no host cost per layer step, for CUDA tensors, training
steps whose forward is followed by its backward; parameters must stay where they are (ZeRO-1/2, plain PyTorch; not
ZeRO-3). Inside a graph the weights are quantized at every forward (cache_weights does not apply).
cuda_graph_pad_multiple: a graphed layer pads the sequence, inside the layer, to the next multiple of this (its
bucket), so batches of varying length replay the graphs of a few buckets; 1: a bucket per length.
cuda_graph_shapes: how many buckets (padded shapes) a model keeps graphs for; all buckets share one memory pool the
size of the largest; a call in another bucket runs eagerly, with one warning per model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..options import BACKENDS, check_bool, check_choice, check_int, from_mapping
from ..triton_fp8 import require_triton_device

TRANSPOSED_WEIGHTS = ("forward", "backward")


@dataclass(frozen=True)
class ActivationConfig:
    backend: str = "auto"
    fprop_fast_accum: bool = False
    cache_weights: bool = True
    transposed_weights: str = "forward"
    cuda_graphs: bool = False
    cuda_graph_pad_multiple: int = 128
    cuda_graph_shapes: int = 32

    def __post_init__(self):
        check_choice("backend", self.backend, BACKENDS)
        check_choice("transposed_weights", self.transposed_weights, TRANSPOSED_WEIGHTS)
        for name in ("fprop_fast_accum", "cache_weights", "cuda_graphs"):
            check_bool(name, getattr(self, name))
        check_int("cuda_graph_pad_multiple", self.cuda_graph_pad_multiple, minimum=1)
        check_int("cuda_graph_shapes", self.cuda_graph_shapes, minimum=1)

    def use_triton(self, t: torch.Tensor) -> bool:
        """Whether ops on `t` run the Triton kernels (backend="triton" on a tensor no Triton backend can run on is an
        error that says what to use instead)."""
        if self.backend == "triton":
            require_triton_device(t, "ActivationConfig")
            return True
        return self.backend == "auto" and t.is_cuda

    def replace(self, **changes) -> "ActivationConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_options(cls, options=None, **overrides) -> "ActivationConfig":
        """From a mapping of option names (unknown names are an error that lists the valid ones)."""
        return from_mapping(cls, options, "FP8 activation option(s)", **overrides)
