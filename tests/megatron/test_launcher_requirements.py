"""What `python -m coat_megatron.pretrain_gpt` says when megatron.training is missing: the install that can work on
this Python (every megatron-core that ships megatron.training requires Python >= 3.12), and the way out without it.
The launcher's exit with this message: tests/megatron/test_megatron.py."""
from coat_megatron.pretrain_gpt import missing_megatron_training_message


def test_python_311_is_told_that_megatron_training_needs_python_312():
    message = missing_megatron_training_message("No module named 'megatron.training'", "0.16.1", (3, 11))
    assert "requires Python >= 3.12 (this is Python 3.11)" in message
    assert "use Python 3.12 with pip install 'megatron-core>=0.17'" in message
    assert "core_v0.16.1" in message and "own training loop" in message


def test_python_312_is_told_to_install_megatron_core_017():
    message = missing_megatron_training_message("No module named 'megatron.training'", "0.16.1", (3, 12))
    assert "pip install 'megatron-core>=0.17'" in message and "this is Python" not in message
