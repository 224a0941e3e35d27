"""`python -m launch.main --help` shows the whole description: both arms, what the run prints, how to call it."""
import pytest


def test_help_shows_the_whole_description(capsys):
    from launch import main as M

    with pytest.raises(SystemExit):
        M.main(["--help"])
    out = capsys.readouterr().out
    for part in ("(launch/corpus.py):", "BF16: bf16 autocast", "COAT: the same model", "At the end: one table",
                 "python -m launch.main [--steps N]", "--threads THREADS"):
        assert part in out, part
