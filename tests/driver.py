"""Running pretrain_gpt.py in-process, as the tests of its flags do: cheaper than a subprocess (no
interpreter and torch start-up), the same code path as `python pretrain_gpt.py`."""

from pathlib import Path

from megazero.run import launch

REPO = Path(__file__).resolve().parent.parent

# A model small enough for a few iterations in about a second on one CPU.
TINY = ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "64", "--eval-iters", "0", "--log-interval", "1"]


def run_main(argv, capsys):
    """megazero.run.launch.main(argv) -> (exit code, captured stdout/stderr)."""
    code = launch.main(argv)
    return code, capsys.readouterr()
