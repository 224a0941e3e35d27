"""`--activation-func-fp8-input-store`: the launcher's flag for TransformerConfig.activation_func_fp8_input_store,
which megatron.training lists among the config fields it gives no flag. It reaches the config because
megatron.training copies every argument named like a TransformerConfig field; it is refused where Megatron's
MLP would ignore it."""
import argparse
import dataclasses

import pytest

from coat_megatron.arguments import add_coat_args, validate_coat_args


def parser_like_megatron():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--transformer-impl", default="transformer_engine",
                        choices=("local", "transformer_engine"))
    parser.add_argument("--swiglu", action="store_true")
    parser.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion")
    parser.add_argument("--use-te-activation-func", action="store_true")
    return add_coat_args(parser)


def test_the_flag_is_named_after_a_transformer_config_field():
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = parser_like_megatron().parse_args(["--swiglu", "--activation-func-fp8-input-store"])
    assert args.activation_func_fp8_input_store is True
    assert "activation_func_fp8_input_store" in {f.name for f in dataclasses.fields(TransformerConfig)}
    assert parser_like_megatron().parse_args([]).activation_func_fp8_input_store is False
    validate_coat_args(args)  # TE spec, SwiGLU, Megatron's fused SwiGLU: accepted


@pytest.mark.parametrize("argv, message", [
    (["--transformer-impl", "coat", "--swiglu"], "COAT spec saves its MLP activations in FP8"),
    ([], "for SwiGLU MLPs"),
    (["--swiglu", "--no-bias-swiglu-fusion"], "drop --no-bias-swiglu-fusion"),
])
def test_the_flag_is_refused_where_megatron_would_ignore_it(argv, message):
    args = parser_like_megatron().parse_args(argv + ["--activation-func-fp8-input-store"])
    with pytest.raises(SystemExit, match=message):
        validate_coat_args(args)
    without = parser_like_megatron().parse_args(argv)
    if "coat" not in argv:
        validate_coat_args(without)


def test_te_activation_op_honours_the_flag_without_the_fused_swiglu():
    args = parser_like_megatron().parse_args(["--swiglu", "--no-bias-swiglu-fusion", "--use-te-activation-func",
                                              "--activation-func-fp8-input-store"])
    validate_coat_args(args)
