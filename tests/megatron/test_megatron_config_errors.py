"""Settings the COAT spec cannot honour are refused where a user meets them: TransformerEngine's FP8 (`fp8=` in the
TransformerConfig) at the spec and at every COAT layer, as the launcher refuses --fp8-format; and coat_megatron
without megatron-core names the extra to install."""
import os
import subprocess
import sys

import pytest


def config(**changes):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm")
    return TransformerConfig(**{**base, **changes})


@pytest.mark.parametrize("fp8", ["hybrid", "e4m3"])
def test_te_fp8_in_the_transformer_config_is_refused_by_the_spec(fp8):
    from coat_megatron import get_gpt_decoder_block_coat_spec
    from coat_megatron.layers import check_no_te_fp8

    cfg = config()
    cfg.fp8 = fp8  # TransformerConfig's own checks of fp8 need TransformerEngine; the spec sees the value
    with pytest.raises(ValueError, match=rf"fp8={fp8!r}.*TransformerEngine.*COAT quantizes.*fp8=None"):
        get_gpt_decoder_block_coat_spec(cfg)
    with pytest.raises(ValueError, match="fp8=None"):
        check_no_te_fp8(cfg)  # what every COAT layer runs at construction
    check_no_te_fp8(config())


def test_import_without_megatron_core_names_the_extra():
    blocker = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name == 'megatron' or name.startswith('megatron.'):\n"
               "            raise ModuleNotFoundError(f\"No module named '{name}'\", name=name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "try:\n"
               "    import coat_megatron\n"
               "except ImportError as exc:\n"
               "    print(type(exc).__name__, exc)\n")
    proc = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COAT_FP8_NO_AUTOREGISTER": "1"})
    assert "pip install 'coat-fp8[megatron]'" in proc.stdout, proc.stdout + proc.stderr[-2000:]
