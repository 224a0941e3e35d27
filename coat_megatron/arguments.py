"""Command-line options for `--transformer-impl coat`, as a megatron.training `extra_args_provider`.

Megatron generates `--transformer-impl` from TransformerConfig's Literal, with closed argparse choices; this adds
"coat" to them (the value then flows into TransformerConfig unchanged, which does not enforce the Literal) and
adds the `--coat-*` options: the spec's (`--coat-attention`) and the FP8 optimizer's (`--coat-optimizer`, usable
with every --transformer-impl), and `--activation-func-fp8-input-store`, a TransformerConfig field that
megatron.training lists but gives no flag (the TransformerEngine arms of launch/megatron_compare.sh use it).
"""
from __future__ import annotations

import argparse
import functools

from coat_kernels.formats import FORMATS
from coat_kernels.optim.config import DEFAULTS

from .attention import ATTENTION_BACKENDS

COAT_IMPL = "coat"
FP8_FORMATS = tuple(FORMATS)


def add_coat_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    if "--coat-attention" in parser._option_string_actions:
        return parser
    action = parser._option_string_actions.get("--transformer-impl")  # argparse-internal, stable for years
    if action is None:
        raise RuntimeError("this megatron.training has no --transformer-impl option to extend with 'coat'")
    if action.choices is not None and COAT_IMPL not in action.choices:
        action.choices = tuple(action.choices) + (COAT_IMPL,)
    group = parser.add_argument_group("COAT (--transformer-impl coat)")
    group.add_argument("--coat-attention", choices=ATTENTION_BACKENDS, default="auto",
                       help="attention core of the COAT spec (BF16): auto = sdpa = torch SDPA (flash / cuDNN kernels "
                            "on CUDA); te = TransformerEngine's (context parallelism); megatron = Megatron's unfused "
                            "DotProductAttention")
    group.add_argument("--coat-fprop-fast-accum", action="store_true",
                       help="forward FP8 GEMMs with Hopper's fast accumulation (no periodic fp32 promotion), as "
                            "TransformerEngine's fprop does; gradient GEMMs keep fp32 promotion. Off: COAT's fp32 "
                            "accumulation")
    opt = parser.add_argument_group("COAT FP8 optimizer (--coat-optimizer; any --transformer-impl)")
    opt.add_argument("--coat-optimizer", action="store_true",
                     help="replace Megatron's Adam (inside the distributed or mixed-precision optimizer) by "
                          "CoatFP8AdamW: both moments in FP8 with per-group dynamic range expansion; with "
                          "--optimizer muon, also Megatron's Muon momentum in FP8 (coat_megatron.muon)")
    for option, (flag, kwargs) in OPTIMIZER_FLAGS.items():
        opt.add_argument(flag, dest=f"coat_{option}", **kwargs)
    te = parser.add_argument_group("Megatron TransformerConfig fields that megatron.training has no flag for")
    # megatron.training copies every argument named like a TransformerConfig field into the config
    te.add_argument("--activation-func-fp8-input-store", action="store_true",
                    help="TransformerConfig.activation_func_fp8_input_store: the SwiGLU input saved for backward in "
                         "FP8 (Megatron's MLP; needs its fused SwiGLU, i.e. no --no-bias-swiglu-fusion)")
    return parser


# CoatFP8AdamW's per-group options (coat_kernels.optim.config.GROUP_OPTION_NAMES) as Megatron flags: option name ->
# (flag, argparse arguments). The one place the flag names live; `coat_optimizer_options` reads them back.
OPTIMIZER_FLAGS = {
    "exp_avg_format": ("--coat-exp-avg-format", dict(choices=FP8_FORMATS, default=DEFAULTS.exp_avg_format,
                                                     help="FP8 format of exp_avg")),
    "exp_avg_sq_format": ("--coat-exp-avg-sq-format", dict(choices=FP8_FORMATS, default=DEFAULTS.exp_avg_sq_format,
                                                           help="FP8 format of exp_avg_sq")),
    "expand_exp_avg": ("--coat-no-expand-exp-avg", dict(action="store_false",
                                                        help="no dynamic range expansion for exp_avg")),
    "expand_exp_avg_sq": ("--coat-no-expand-exp-avg-sq", dict(action="store_false",
                                                              help="no dynamic range expansion for exp_avg_sq")),
    "group_size": ("--coat-group-size", dict(type=int, default=DEFAULTS.group_size,
                                             help="elements per quantization group")),
    "expand_min": ("--coat-expand-min", dict(type=int, default=DEFAULTS.expand_min,
                                             help="the expansion exponent k is a multiple of 1/N")),
    "k_max": ("--coat-k-max", dict(type=float, default=DEFAULTS.k_max, help="cap on the expansion exponent k")),
}


def coat_optimizer_options(args) -> dict:
    """CoatFP8AdamW's COAT options from the --coat-* flags."""
    return {option: getattr(args, f"coat_{option}") for option in OPTIMIZER_FLAGS}


class AddMegatronAndCoatArguments:
    """What install_coat_args puts in place of megatron.training's `add_megatron_arguments`: Megatron's
    (`original`), then the COAT options."""

    def __init__(self, original):
        self.original = original
        functools.update_wrapper(self, original)

    def __call__(self, parser):
        return add_coat_args(self.original(parser))


def install_coat_args() -> None:
    """Make every parser megatron.training builds accept the COAT options (idempotent).

    megatron.training re-parses sys.argv with its own parser outside `extra_args_provider` (0.19:
    ft_integration.setup and inprocess_restart call `parse_args(ignore_unknown_args=True)`, and an unknown
    *choice* is still an error), so the options are added where that parser is built: `add_megatron_arguments`.
    """
    from megatron.training import arguments

    if not isinstance(arguments.add_megatron_arguments, AddMegatronAndCoatArguments):
        arguments.add_megatron_arguments = AddMegatronAndCoatArguments(arguments.add_megatron_arguments)


# --optimizer values --coat-optimizer takes: Adam, and Megatron's Muon (its Adam part too; "dist_muon" is the
# layer-wise distributed spelling of 0.16-0.18, which 0.19 still accepts)
COAT_OPTIMIZER_BASES = ("adam", "muon", "dist_muon")


def validate_coat_args(args) -> None:
    """Reject settings the COAT spec or the COAT optimizer cannot honour, with the option to change."""
    _validate_fp8_input_store(args)
    _validate_coat_optimizer(args)
    if args.transformer_impl != COAT_IMPL:
        return
    problems = []
    if getattr(args, "fp8", None):
        problems.append("--fp8-format selects TransformerEngine's FP8; COAT quantizes by itself: drop it")
    if getattr(args, "num_experts", None):
        problems.append("MoE (--num-experts) is not covered by the COAT spec")
    if getattr(args, "normalization", "LayerNorm") not in ("LayerNorm", "RMSNorm"):
        problems.append(f"--normalization {args.normalization} is not supported (LayerNorm, RMSNorm)")
    if getattr(args, "context_parallel_size", 1) > 1 and args.coat_attention in ("auto", "sdpa"):
        problems.append(f"--coat-attention {args.coat_attention} (torch SDPA) does not support context parallelism: "
                        "use --coat-attention te")
    if problems:
        raise SystemExit("--transformer-impl coat: " + "; ".join(problems))


def _validate_fp8_input_store(args) -> None:
    """--activation-func-fp8-input-store acts only where Megatron's MLP applies a SwiGLU that honours it."""
    if not getattr(args, "activation_func_fp8_input_store", False):
        return
    if args.transformer_impl == COAT_IMPL:
        raise SystemExit("--activation-func-fp8-input-store: the COAT spec saves its MLP activations in FP8 by "
                         "itself: drop it")
    if not getattr(args, "swiglu", False):
        raise SystemExit("--activation-func-fp8-input-store is for SwiGLU MLPs: add --swiglu")
    if not (getattr(args, "bias_swiglu_fusion", True) or getattr(args, "use_te_activation_func", False)):
        raise SystemExit("--activation-func-fp8-input-store is ignored by Megatron's unfused SwiGLU: drop "
                         "--no-bias-swiglu-fusion (or use --use-te-activation-func)")


def _validate_coat_optimizer(args) -> None:
    """--coat-optimizer stores the state of Adam and of Megatron's Muon (momentum) in FP8; no other optimizer."""
    if not getattr(args, "coat_optimizer", False):
        return
    optimizer = getattr(args, "optimizer", "adam")
    if optimizer not in COAT_OPTIMIZER_BASES:
        raise SystemExit(f"--coat-optimizer keeps the state of Adam (--optimizer adam) and of Megatron's Muon "
                         f"(--optimizer muon) in FP8; --optimizer {optimizer} is neither: drop --coat-optimizer or "
                         "choose one of them")
    scalar = getattr(args, "muon_scalar_optimizer", "adam")
    if "muon" in optimizer and scalar != "adam":
        raise SystemExit(f"--coat-optimizer with --optimizer {optimizer}: the non-matrix parameters are stepped by "
                         f"CoatFP8AdamW, which replaces Adam, not {scalar}: use --muon-scalar-optimizer adam")
