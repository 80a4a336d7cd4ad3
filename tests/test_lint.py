"""ruff over the whole tree, as pyproject.toml's [tool.ruff] configures it: the lint (pyflakes and the
syntax and statement rules) and the formatter's check, so the README's test command (which CI runs)
is also the lint and the format check: an unused import, an undefined name or a redefinition fails
here with its file and line, and so does a file `ruff format .` would change. Skips when ruff is not
installed (it is in the dev extra)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    pytest.importorskip("ruff", reason="ruff is not installed (pip install -e '.[dev]' brings it)")
    return subprocess.run([sys.executable, "-m", "ruff", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_ruff_finds_nothing():
    out = _ruff("check", "--output-format", "concise", "--no-cache", str(ROOT))
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_file_is_formatted():
    out = _ruff("format", "--check", "--no-cache", str(ROOT))
    assert out.returncode == 0, out.stdout + out.stderr + "\nrun `ruff format .` in the checkout"


def test_the_format_check_catches_an_unformatted_file(tmp_path):
    """The check above can fail: with the project's settings, a call written past the line's end and a
    single-quoted string are reformatted (and a formatted file is left alone)."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "loose.py").write_text("x = f('a',\n      'b')\n")
    (tmp_path / "tidy.py").write_text('x = f("a", "b")\n')
    out = _ruff("format", "--check", "--no-cache", ".", cwd=tmp_path)
    assert out.returncode == 1 and "loose.py" in out.stdout and "tidy.py" not in out.stdout, out.stdout + out.stderr
