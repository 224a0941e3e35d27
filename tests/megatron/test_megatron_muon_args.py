"""`--coat-optimizer` at argument time: it keeps the state of Adam and of Megatron's Muon in FP8, and refuses every
other `--optimizer` (and a Muon whose non-matrix parameters go to an optimizer other than Adam) with the reason.
Needs neither emerging_optimizers nor megatron.training: validate_coat_args reads the parsed arguments."""
import argparse

import pytest

from coat_megatron.arguments import validate_coat_args


def args(**changes):
    base = dict(transformer_impl="local", coat_optimizer=True, optimizer="adam", muon_scalar_optimizer="adam")
    return argparse.Namespace(**{**base, **changes})


@pytest.mark.parametrize("optimizer", ["adam", "muon", "dist_muon"])
def test_adam_and_megatrons_muon_are_accepted(optimizer):
    validate_coat_args(args(optimizer=optimizer))


@pytest.mark.parametrize("optimizer", ["sgd", "adaptive_muon", "lion", "soap"])
def test_other_optimizers_are_refused_naming_the_choice(optimizer):
    with pytest.raises(SystemExit, match=rf"--optimizer {optimizer} is neither: drop --coat-optimizer"):
        validate_coat_args(args(optimizer=optimizer))
    validate_coat_args(args(optimizer=optimizer, coat_optimizer=False))  # without --coat-optimizer: not ours


def test_muon_with_another_scalar_optimizer_is_refused():
    with pytest.raises(SystemExit, match="not lion: use --muon-scalar-optimizer adam"):
        validate_coat_args(args(optimizer="muon", muon_scalar_optimizer="lion"))
    validate_coat_args(args(optimizer="adam", muon_scalar_optimizer="lion"))  # Adam runs ignore the Muon flag


def test_megatron_16_and_17_arguments_without_the_scalar_optimizer_flag():
    namespace = args(optimizer="muon")
    del namespace.muon_scalar_optimizer  # added in megatron-core 0.18
    validate_coat_args(namespace)
