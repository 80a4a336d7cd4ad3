"""megazero/core/source_paths.py: reports name a file from the repository root found from the package's
own location, whatever the checkout's folder is called (`megazero`, what `git clone` makes, included),
and every call site a report shows goes through it: the comm log's (core/comm.py), the host reads'
(core/host_read.py), the stream sanitizer's (core/stream_check.py) and the dry run's
(dry_run/cross_rank_checks.py).

Planted: the four sites' earlier rule (the path after the last "/megazero/", "/parallel/", "/models/"
or "/tests/" in it) fails every site test below, in a checkout named megazero."""

from pathlib import Path

import pytest
import torch

from megazero.core import comm, host_read, source_paths, stream_check
from megazero.dry_run import cross_rank_checks

HERE = Path(__file__).resolve()


def test_the_root_is_this_checkout():
    """The tests and the package they import are one checkout (else every site in a test is shown
    whole): a clone needs its own `pip install -e .`, as .ci/run does."""
    assert source_paths.ROOT == HERE.parents[2], (
        f"megazero is imported from {source_paths.ROOT}, the tests run from {HERE.parents[2]}: install "
        f"this checkout (pip install -e .)"
    )
    assert source_paths.shown(str(HERE)) == "tests/core/test_source_paths.py"
    assert source_paths.shown(comm.__file__) == "megazero/core/comm.py"
    assert source_paths.shown(torch.__file__) == torch.__file__  # another project's file: whole
    assert source_paths.shown("<string>") == "<string>"


@pytest.fixture
def clone(tmp_path, monkeypatch):
    """A checkout in a folder named megazero, inside folders named like the repository's own (the
    cases a rule searching a path for those names gets wrong)."""
    root = tmp_path / "models" / "tests" / "megazero"
    (root / "tests").mkdir(parents=True)
    monkeypatch.setattr(source_paths, "ROOT", root.resolve())
    source_paths.repository_path.cache_clear()
    yield root
    source_paths.repository_path.cache_clear()


def _run_in(clone: Path, code: str, names: dict) -> dict:
    """Runs `code` as if it were the file tests/site.py of the checkout `clone`; returns its names."""
    names = dict(names)
    exec(compile(code, str(clone / "tests" / "site.py"), "exec"), names)
    return names


def test_a_checkout_named_megazero_is_named_from_its_root(clone):
    assert source_paths.repository_path(str(clone / "tests" / "dry_run" / "test_x.py")) == "tests/dry_run/test_x.py"
    assert source_paths.repository_path(str(clone / "models" / "gpt.py")) == "models/gpt.py"
    elsewhere = str(clone.parent / "other" / "megazero" / "models" / "gpt.py")
    assert source_paths.repository_path(elsewhere) is None and source_paths.shown(elsewhere) == elsewhere


def test_the_comm_logs_site_is_named_from_the_root(clone):
    found = _run_in(clone, "def asks():\n    return comm._call_site()\nsite = asks()\n", {"comm": comm})
    assert found["site"] == "tests/site.py:3"


def test_a_host_reads_site_is_named_from_the_root(clone):
    with host_read.recording() as reads:
        _run_in(clone, "host_read.read(torch.ones(2), 'a probe')\n", {"host_read": host_read, "torch": torch})
    assert [(r.what, r.site) for r in reads] == [("a probe", "tests/site.py:1")]


def test_the_stream_sanitizers_site_is_named_from_the_root(clone):
    found = _run_in(clone, "site = stream_check._call_site()\n", {"stream_check": stream_check})
    assert found["site"] == "tests/site.py:1 (<module>)"


def test_the_dry_runs_site_is_named_from_the_root(clone):
    frames = [
        (clone / "tests" / "dry_run" / "test_x.py", 12),
        (clone / "megazero" / "training" / "loop.py", 40),
        (clone / "megazero" / "core" / "comm.py", 300),
        (clone / "megazero" / "dry_run" / "job.py", 7),
        (Path(torch.__file__), 9),
    ]
    detail = "Traceback (most recent call last):\n" + "".join(
        f'  File "{path}", line {line}, in f\n' for path, line in frames
    )
    # the last frame of the repository's, the comm wrapper and the simulator (dry_run/) skipped
    assert cross_rank_checks._site_of(detail) == "megazero/training/loop.py:40"
