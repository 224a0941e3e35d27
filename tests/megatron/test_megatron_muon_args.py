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


def test_enable_coat_wraps_the_muon_factory_of_megatron_training_017(monkeypatch):
    """megatron.training 0.17 builds --optimizer muon with get_megatron_muon_optimizer instead of
    get_megatron_optimizer: enable_coat wraps both (one handle), where they exist. A stand-in megatron.training."""
    import sys
    import types

    from coat_megatron.enable import GetMegatronOptimizerWithCoat, enable_coat

    training = types.SimpleNamespace(get_megatron_optimizer=lambda *a, **k: "adam optimizer",
                                     get_megatron_muon_optimizer=lambda *a, **k: "muon optimizer")
    package = types.ModuleType("megatron.training")
    package.training = training
    package.arguments = types.SimpleNamespace(add_megatron_arguments=lambda parser: parser)
    package.get_args = lambda: argparse.Namespace(coat_optimizer=False)
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    handle = enable_coat()
    assert enable_coat() is handle
    for name in ("get_megatron_optimizer", "get_megatron_muon_optimizer"):
        assert isinstance(getattr(training, name), GetMegatronOptimizerWithCoat)
        assert getattr(training, name).handle is handle
    assert training.get_megatron_muon_optimizer("config", ["model"]) == "muon optimizer"
    assert handle.optimizers == ["muon optimizer"]
    del training.get_megatron_muon_optimizer  # 0.18 on: Megatron's factory alone
    training.get_megatron_optimizer = training.get_megatron_optimizer.original
    assert enable_coat() is not handle and not hasattr(training, "get_megatron_muon_optimizer")
