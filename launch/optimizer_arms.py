"""The optimizers launch/optimizer_parity.py compares, one entry each in ARMS (name -> OptimizerArm), and what each
holds per parameter.

Every arm trains the same model under bf16 autocast; only the optimizer (and, where its recipe says so, the dtype of
the weights it steps) differs:
  fp32          torch.optim.AdamW, fp32 moments (8 B/param), fp32 master weights (the model's parameters)
  bf16_moments  BF16MomentAdamW (launch/bf16_moment_adamw.py): bf16 moments (4 B/param) as DeepSpeed's FusedAdam on
                bf16 states and Megatron's precision-aware optimizer store them, fp32 master weights
  coat          CoatFP8AdamW: FP8 moments with per-group Dynamic Range Expansion, fp32 master weights
  coat_noexp    CoatFP8AdamW(expand_exp_avg=False, expand_exp_avg_sq=False): per-group FP8 alone
  torchao_fp8   torchao.optim.AdamWFp8: FP8 E4M3 moments in blocks of 256 with one absmax scale each, tensors under
                4,096 elements (or not a multiple of 256) in fp32; its step one torch.compile'd function per tensor
  flashoptim    flashoptim.FlashAdamW: 8-bit companded moments in groups of 32 (fp16 scales), weights in bf16
                (flashoptim.cast_model) with int8 error-correction bits: 24-bit master weights (its default)
  muon_fp32 / muon_bf16 / coat_muon   CoatFP8Muon with its momentum in fp32 (torch.optim.Muon's step), bf16 or
                FP8: Muon on the hidden matrices, AdamW (same storage) on embeddings, LM head and norms
  lion_fp32 / coat_lion   CoatFP8Lion with its momentum in fp32 (lion-pytorch's step) or FP8; lr x0.1, wd x10
An arm that cannot run on a device or is not installed says why (OptimizerArm.unavailable), and the run records
that reason instead of a curve. A new optimizer is one more entry: a label, how it stores its moments, a builder.
"""
from __future__ import annotations

import importlib.util
import unittest.mock
from dataclasses import dataclass
from typing import Callable

import torch

from coat_kernels.optim.state import tensor_bytes

# state keys that extend the master weight rather than hold moments
MASTER_KEYS = ("error_bits", "master_remainder")


@dataclass(frozen=True)
class Hyper:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    def adamw_kwargs(self) -> dict:
        return dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


@dataclass(frozen=True)
class ArmContext:
    device: torch.device
    hyper: Hyper
    compile_steps: bool  # the arms whose recipe compiles their step (torchao, BF16 moments) do so


@dataclass(frozen=True)
class OptimizerArm:
    label: str
    moments: str  # how the moments are stored
    build: Callable[[torch.nn.Module, ArmContext], torch.optim.Optimizer]  # may change the model's dtype in place
    unavailable: Callable[[torch.device], str | None] = lambda device: None
    lr_scale: float = 1.0  # the arm's learning rate as a multiple of the schedule's (Lion's is smaller)


def _fp32(model, ctx):
    fused = {"fused": True} if ctx.device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(model.parameters(), **ctx.hyper.adamw_kwargs(), **fused)


def _bf16_moments(model, ctx):
    from launch.bf16_moment_adamw import BF16MomentAdamW

    return BF16MomentAdamW(model.parameters(), **ctx.hyper.adamw_kwargs(), compile_step=ctx.compile_steps)


def _coat(expand: bool):
    def build(model, ctx):
        from coat_kernels.optim import CoatFP8AdamW

        return CoatFP8AdamW(model.parameters(), **ctx.hyper.adamw_kwargs(), expand_exp_avg=expand,
                            expand_exp_avg_sq=expand)
    return build


def _no_compile(function, **options):
    return function


def eager_steps(optimizer_class):
    """A subclass of `optimizer_class` whose step runs the functions it would torch.compile eagerly: torch.compile
    is the identity while it steps (the same operations; on a CPU the compilation takes longer than a test run)."""
    class Eager(optimizer_class):
        def step(self, closure=None):
            with unittest.mock.patch("torch.compile", _no_compile):
                return super().step(closure)

    Eager.__name__ = Eager.__qualname__ = f"{optimizer_class.__name__}Eager"
    return Eager


def _torchao_fp8(model, ctx):
    from torchao.optim import AdamWFp8

    cls = AdamWFp8 if ctx.compile_steps else eager_steps(AdamWFp8)
    return cls(model.parameters(), **ctx.hyper.adamw_kwargs())


def _flashoptim(model, ctx):
    from flashoptim import FlashAdamW, cast_model

    cast_model(model, torch.bfloat16)
    return FlashAdamW(model.parameters(), **ctx.hyper.adamw_kwargs(), master_weight_bits=24)


# Lion takes a learning rate 3-10x smaller than AdamW's and a weight decay as much larger, so that lr * wd stays
# AdamW's (Chen et al. 2023, section 5)
LION_LR_SCALE = 0.1


def _lion(state_dtype: str):
    def build(model, ctx):
        from coat_kernels.optim import CoatFP8Lion

        hyper = ctx.hyper
        return CoatFP8Lion(model.parameters(), lr=hyper.lr * LION_LR_SCALE, betas=(0.9, 0.99),
                           weight_decay=hyper.weight_decay / LION_LR_SCALE, state_dtype=state_dtype)
    return build


def _muon(state_dtype: str):
    """Muon on the hidden 2-D matrices (torch.optim.Muon's step; lr scaled per matrix to AdamW's update RMS,
    adjust_lr_fn="match_rms_adamw", so one learning rate serves both kinds of group), AdamW on the rest."""
    def build(model, ctx):
        from coat_kernels.optim import CoatFP8Muon, muon_param_groups

        hyper = ctx.hyper
        return CoatFP8Muon(muon_param_groups(model), lr=hyper.lr, weight_decay=hyper.weight_decay,
                           adjust_lr_fn="match_rms_adamw", betas=hyper.betas, adamw_eps=hyper.eps,
                           state_dtype=state_dtype)
    return build


def _missing(module: str, install: str):
    def reason(device):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed here ({install})"
        return None
    return reason


def _flashoptim_unavailable(device):
    missing = _missing("flashoptim", "pip install flashoptim==0.1.4")(device)
    if missing or device.type == "cuda":
        return missing
    return ("FlashOptim quantizes its moments, keeps its error-correction bits and fuses its step only on CUDA "
            "(FlashOptimizer raises NotImplementedError without a CUDA device)")


ARMS = {
    "fp32": OptimizerArm("torch AdamW, fp32 moments", "fp32", _fp32),
    "bf16_moments": OptimizerArm("AdamW, bf16 moments (DeepSpeed FusedAdam / Megatron precision-aware storage)",
                                 "bf16, round to nearest", _bf16_moments),
    "coat": OptimizerArm("CoatFP8AdamW", "FP8 E4M3, groups of 128, Dynamic Range Expansion", _coat(True)),
    "coat_noexp": OptimizerArm("CoatFP8AdamW, expansion off", "FP8 E4M3, groups of 128, scale only", _coat(False)),
    "torchao_fp8": OptimizerArm("torchao AdamWFp8", "FP8 E4M3, blocks of 256, absmax scale", _torchao_fp8,
                                _missing("torchao", "pip install torchao==0.18.0")),
    "flashoptim": OptimizerArm("FlashOptim FlashAdamW (24-bit masters)",
                               "8-bit companded, groups of 32, fp16 scales", _flashoptim, _flashoptim_unavailable),
    "muon_fp32": OptimizerArm("Muon, fp32 momentum (torch.optim.Muon's step; AdamW groups fp32)", "fp32",
                              _muon("fp32")),
    "muon_bf16": OptimizerArm("Muon, bf16 momentum (AdamW groups bf16)", "bf16, round to nearest", _muon("bf16")),
    "coat_muon": OptimizerArm("CoatFP8Muon (AdamW groups: CoatFP8AdamW)",
                              "FP8 E4M3, groups of 128, Dynamic Range Expansion", _muon("fp8")),
    "lion_fp32": OptimizerArm("Lion, fp32 momentum (lion-pytorch's step)", "fp32", _lion("fp32"),
                              lr_scale=LION_LR_SCALE),
    "coat_lion": OptimizerArm("CoatFP8Lion", "FP8 E4M3, groups of 128, Dynamic Range Expansion", _lion("fp8"),
                              lr_scale=LION_LR_SCALE),
}


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every param group's learning rate (torchao keeps it as a tensor, to be filled in place)."""
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def value_bytes(value) -> int:
    """Bytes a state value holds: tensors, tensor subclasses by the tensors inside them (torchao's OptimStateFp8:
    codes and scales), FlashOptim's quantized-state wrapper by its codes and scales; anything else 0."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            return sum(value_bytes(getattr(value, name)) for name in names)
        return tensor_bytes(value)
    if callable(getattr(value, "is_quantized", None)) and hasattr(value, "kernel_tensor"):
        inner = (value.quantized, value.scales) if value.is_quantized() else (value.data,)
        return sum(value_bytes(t) for t in inner)
    return 0


def optimizer_side_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, gradient_bytes: int) -> dict:
    """Bytes of the optimizer side, measured on the tensors: master weights (the parameters as stepped, plus the
    state that extends them: FlashOptim's error bits, COAT's master remainders), optimizer state (moments and their
    scales, metadata, step counters) and gradients (as measured after a backward), and their sum."""
    params = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    master = sum(p.numel() * p.element_size() for p in params.values())
    state = 0
    for entry in optimizer.state.values():
        for key, value in entry.items():
            if key in MASTER_KEYS:
                master += value_bytes(value)
            else:
                state += value_bytes(value)
    return dict(master=master, state=state, gradients=gradient_bytes, total=master + state + gradient_bytes)
