"""One call that enables COAT in a megatron.training job: `handle = coat_megatron.enable_coat()`.

It is idempotent (a second call returns the same handle) and does four things:
1. `--transformer-impl coat` and the `--coat-*` flags in every parser megatron.training builds;
2. `megatron.training.training.get_megatron_optimizer` (and 0.17's `get_megatron_muon_optimizer`) replaced by
   GetMegatronOptimizerWithCoat (Megatron's function, then the swap; it holds the handle): with `--coat-optimizer` the
   inner Adam of the distributed / mixed-precision optimizer becomes CoatFP8AdamW and Megatron's Muon keeps its
   momentum in FP8 (coat_megatron.optimizer, coat_megatron.muon), and every inner optimizer
   ticks the step clock of the COAT weight caches, so each FP8 weight is quantized once per optimizer step (Megatron
   writes weights through `.data` and parameter all-gathers, which no tensor version counter sees);
3. the handle: a model provider builds the COAT layers with `handle.decoder_block_spec(config, args)` for
   `--transformer-impl coat` (the layers then share the handle's CoatRuntime, whose clock the optimizer ticks);
4. with `--cuda-graph-impl full_iteration`, the eager warm-up's cached memory is released before the capture
   (coat_megatron.cuda_graphs), so the captured iteration fits where the eager ones did.
Call it before megatron.training's `pretrain` (coat_megatron.pretrain_gpt does).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from coat_kernels.act import ActivationConfig, CoatRuntime

from .arguments import coat_optimizer_options, install_coat_args
from .cuda_graphs import release_memory_before_capture
from .layers import MEGATRON_ACTIVATION_CONFIG
from .spec import get_gpt_decoder_block_coat_spec


@dataclass
class CoatMegatron:
    runtime: CoatRuntime = field(default_factory=CoatRuntime)
    optimizers: list = field(default_factory=list)  # every optimizer megatron.training built, for the report

    @staticmethod
    def activation_config(args) -> ActivationConfig:
        return MEGATRON_ACTIVATION_CONFIG.replace(fprop_fast_accum=bool(getattr(args, "coat_fprop_fast_accum", False)))

    def decoder_block_spec(self, config, args, vp_stage=None, pp_rank=None):
        """This pipeline stage's COAT decoder-block spec, bound to the handle's runtime and the args' options."""
        return get_gpt_decoder_block_coat_spec(config, vp_stage=vp_stage, pp_rank=pp_rank,
                                               attention=getattr(args, "coat_attention", "auto"),
                                               coat_config=self.activation_config(args), coat_runtime=self.runtime)

    def attach(self, megatron_optimizer) -> None:
        """Tick the weight caches' clock after every step of this Megatron optimizer's inner optimizers."""
        for wrapper in getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer]):
            inner = getattr(wrapper, "optimizer", None)
            if inner is not None and hasattr(inner, "register_step_post_hook"):
                self.runtime.attach_optimizer(inner)


class GetMegatronOptimizerWithCoat:
    """What enable_coat puts in place of megatron.training's `get_megatron_optimizer`: Megatron's function (`original`),
    then the COAT optimizer swap (with `--coat-optimizer`) and the handle's clock on every inner optimizer."""

    def __init__(self, original, handle: CoatMegatron):
        self.original = original
        self.handle = handle
        functools.update_wrapper(self, original)

    def __call__(self, *args, **kwargs):
        from megatron.training import get_args

        from .optimizer import use_coat_optimizer

        optimizer = self.original(*args, **kwargs)
        if get_args().coat_optimizer:
            optimizer = use_coat_optimizer(optimizer, **coat_optimizer_options(get_args()))
        self.handle.attach(optimizer)
        self.handle.optimizers.append(optimizer)
        return optimizer


# The optimizer factories megatron.training.training calls: Megatron's, and (megatron-core 0.17) Muon's, which 0.17
# calls for --optimizer muon / dist_muon instead (0.18 on route Muon through get_megatron_optimizer).
OPTIMIZER_FACTORIES = ("get_megatron_optimizer", "get_megatron_muon_optimizer")


def enable_coat() -> CoatMegatron:
    from megatron.training import training

    install_coat_args()
    release_memory_before_capture()
    installed = training.get_megatron_optimizer
    handle = installed.handle if isinstance(installed, GetMegatronOptimizerWithCoat) else CoatMegatron()
    for name in OPTIMIZER_FACTORIES:
        factory = getattr(training, name, None)
        if factory is not None and not isinstance(factory, GetMegatronOptimizerWithCoat):
            setattr(training, name, GetMegatronOptimizerWithCoat(factory, handle))
    return handle
