"""What stays in a --save folder besides the checkpoints a run wants: `--ckpt-keep-last K` (delete all
but the newest K complete checkpoints, never the newest healthy one) and the `.tmp-*` leftovers of
saves that did not finish (a killed or interrupted job, a directory that could not be removed).

Runs on the rank that holds the folder's lock (megazero.core.writer_lock), so that whatever `.tmp-*`
entry it finds belongs to no live save: at the start of a job (`remove_leftovers`) and after every
committed save (`apply_keep_last`, which also retries what could not be removed before). Nothing is
removed silently: each call returns the one line to say, or None. Must not touch `latest` or the
checkpoint it names.

Healthy: a checkpoint whose metadata records a finite training loss (`loss_finite`; one written
before that field existed, or from full tensors, counts as healthy). Retention keeps the newest
healthy checkpoint even beyond K, so that a run that diverged after it can still go back to it.
"""

from __future__ import annotations

import json
from pathlib import Path

from .files import METADATA, TMP_PREFIX, complete_iteration_dirs, remove_tree, temporary_name


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _leftovers(save_dir: Path) -> list[Path]:
    return sorted(p for p in save_dir.glob(f"{TMP_PREFIX}*"))


def remove_leftovers(save_dir: Path, flag: str) -> str | None:
    """Removes every `.tmp-*` entry of `save_dir` (the lock's owner calls this before it writes);
    the line saying what was removed and what could not be, or None when there was nothing."""
    found = _leftovers(Path(save_dir))
    if not found:
        return None
    sizes = {path: _size(path) for path in found}
    failed = {path: why for path in found if (why := remove_tree(path)) is not None}
    removed = [path for path in found if path not in failed]
    line = ""
    if removed:
        line = (
            f"{flag}: removed what interrupted saves left there: "
            + ", ".join(p.name for p in removed)
            + f" ({sum(sizes[p] for p in removed) / 2**20:.1f} MiB)"
        )
    if failed:
        line += ("; " if line else f"{flag}: ") + _could_not(failed) + "; retried at the next save"
    return line


def _could_not(failed: dict[Path, str]) -> str:
    first, why = next(iter(failed.items()))
    others = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    return f"could not remove {first}{others} ({why})"


def healthy(directory: Path) -> bool:
    """Whether the checkpoint in `directory` recorded a finite loss (unknown counts as finite)."""
    try:
        return json.loads((directory / METADATA).read_text()).get("loss_finite") is not False
    except (OSError, ValueError):
        return False


def apply_keep_last(save_dir: Path, keep_last: int, run_id: str, flag: str) -> str | None:
    """Deletes complete checkpoints beyond the newest `keep_last` (0 keeps all), except the newest
    healthy one, and retries earlier leftovers; the line naming what could not be removed, or None.
    Each old checkpoint is first renamed to a `.tmp-*` name, so that a removal cut short leaves a
    leftover the next save (or job) retries, never a damaged checkpoint that still looks complete."""
    save_dir = Path(save_dir)
    old = []
    if keep_last > 0:
        complete = complete_iteration_dirs(save_dir)
        keep = next((d for d in reversed(complete) if healthy(d)), None)
        old = [d for d in complete[:-keep_last] if d != keep]
    failed = {}
    for directory in old:
        trash = directory.with_name(temporary_name(run_id, f"old-{directory.name}"))
        try:
            directory.rename(trash)
        except OSError as err:
            failed[directory] = f"{err.strerror}: {directory}"
    for path in _leftovers(save_dir):
        why = remove_tree(path)
        if why is not None:
            failed[path] = why
    if not failed:
        return None
    return f"{flag}: {_could_not(failed)}; retried at the next save"
