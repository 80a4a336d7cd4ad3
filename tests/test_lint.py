"""ruff's lint (pyproject.toml's [tool.ruff]: pyflakes and the syntax and statement rules) over the whole
tree, so the README's test command is also the lint: an unused import, an undefined name or a
redefinition fails here with its file and line. Skips when ruff is not installed (it is in the dev extra)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    pytest.importorskip("ruff", reason="ruff is not installed (pip install -e '.[dev]' brings it)")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "--no-cache", str(ROOT)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
