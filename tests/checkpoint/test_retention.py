"""What stays in a --save folder (megazero.checkpoint.retention): --ckpt-keep-last keeps the newest
healthy checkpoint; leftovers of interrupted saves go with a line; nothing that cannot be removed is
passed over in silence. Plain files standing in for checkpoints: no training."""

import json
import os

from megazero.checkpoint.files import commit_directory
from megazero.checkpoint.retention import apply_keep_last, remove_leftovers


def _checkpoint(folder, iteration, finite=True):
    path = folder / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    (path / "metadata.json").write_text(json.dumps({"iteration": iteration, "loss_finite": finite}))
    (path / "rank_00000.safetensors").write_bytes(b"x" * 1000)
    return path


def _failing_unlink(monkeypatch, name):
    """os.unlink refuses `name` as a read-only directory would (root ignores permission bits)."""
    real = os.unlink

    def unlink(path, *args, **kwargs):
        if os.fspath(path).endswith(name):
            raise PermissionError(13, "Permission denied")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)


def test_keep_last_keeps_the_newest_healthy_checkpoint_and_names_what_it_could_not_remove(tmp_path, monkeypatch):
    """keep-last 1 over iterations 1-3 whose newest two recorded a non-finite loss keeps 1 (the newest
    healthy) and 3; a shard that cannot be removed is named in the line and retried, and goes once it
    can. (Planted: keeping only the newest K deletes iteration 1; removing with ignore_errors, as
    before, returns no line.)"""
    for it, finite in ((1, True), (2, False), (3, False)):
        _checkpoint(tmp_path, it, finite)
    assert apply_keep_last(tmp_path, 1, "run", "--ckpt-keep-last 1") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "iter_0000003"]
    _checkpoint(tmp_path, 4)
    _failing_unlink(monkeypatch, "rank_00000.safetensors")
    line = apply_keep_last(tmp_path, 1, "run", "--ckpt-keep-last 1")
    assert line.startswith("--ckpt-keep-last 1: could not remove ") and "(and 1 more)" in line, line
    assert "Permission denied" in line and line.endswith("; retried at the next save") and "\n" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".tmp-run-old-iter_0000001",
        ".tmp-run-old-iter_0000003",
        "iter_0000004",
    ]
    monkeypatch.undo()
    assert apply_keep_last(tmp_path, 1, "run", "--ckpt-keep-last 1") is None
    assert [p.name for p in tmp_path.iterdir()] == ["iter_0000004"]


def test_leftovers_of_interrupted_saves_go_with_a_line(tmp_path, monkeypatch):
    """A killed save's `.tmp-<run>-iter_*` folder goes at the next start, said with its size; one that
    cannot be removed is named. A replaced iteration whose old copy cannot be removed is returned by
    commit_directory, not dropped. (Planted: remove_leftovers returning None leaves the folder.)"""
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path / "x", 4).rename(tmp_path / ".tmp-abc-iter_0000004")
    (tmp_path / ".tmp-abc-latest").write_text("iter_0000004\n")
    line = remove_leftovers(tmp_path, "--save ck")
    assert line == (
        "--save ck: removed what interrupted saves left there: .tmp-abc-iter_0000004, .tmp-abc-latest (0.0 MiB)"
    ), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "x"]
    assert remove_leftovers(tmp_path, "--save ck") is None
    new = _checkpoint(tmp_path, 9).rename(tmp_path / ".tmp-run-iter_0000002")
    _failing_unlink(monkeypatch, "rank_00000.safetensors")
    why = commit_directory(new, tmp_path / "iter_0000002", "run")
    assert why.startswith("Permission denied: ") and why.endswith("rank_00000.safetensors"), why
    assert (tmp_path / "latest").read_text() == "iter_0000002\n"
    line = remove_leftovers(tmp_path, "--save ck")
    assert line.startswith("--save ck: could not remove ") and ".tmp-run-old-iter_0000002" in line, line
