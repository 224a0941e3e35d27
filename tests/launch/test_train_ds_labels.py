"""launch/train_ds.py's start line names the model size in units that show it (a tiny model is not "0.000 B")."""
from launch.train_ds import params_label


def test_parameter_counts_are_printed_in_readable_units():
    assert params_label(53_184) == "53.2 K params"
    assert params_label(12_345_678) == "12.3 M params"
    assert params_label(1_100_048_384) == "1.10 B params"
