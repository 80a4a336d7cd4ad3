"""The checkpoint directory on disk: names, atomic writes, checksums, `latest`.

    SAVE_DIR/
      .lock                        while a job writes here: its lock (megazero.core.writer_lock)
      latest                       the newest complete iteration directory's name, one line
      iter_0000100/
        metadata.json              run, model, layout, iteration, consumed samples, lr schedule, and
                                   every tensor of every rank: parameter, piece, TP split, CRC
        rank_00003.safetensors     rank 3's tensors (no pickle anywhere); its header names run and rank
        tokenizer/                 the files that rebuild the run's tokenizer (metadata.json says which)

A save writes into a hidden temporary directory beside the final one (`.tmp-<run id>-iter_...`),
fsyncs every file and the directory, then renames it into place and replaces `latest` the same way:
a process killed at any moment leaves the previous checkpoint loadable and `latest` pointing at it,
and at most `.tmp-*` leftovers, which the next job that holds the folder's lock removes
(retention.py). Every file gets the mode
the user's umask gives a new file (0644 by default), whatever the library that wrote it chose.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from megazero.core.errors import UsageError

FORMAT_VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"
LOCK = ".lock"
TMP_PREFIX = ".tmp-"
TOKENIZER_DIR = "tokenizer"


class CheckpointError(UsageError):
    """A checkpoint that cannot be used as asked: the message names the file and what is wrong."""


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def temporary_name(run_id: str, name: str) -> str:
    """The hidden name `name` is written under before it is committed: it carries the run id, so
    that no two runs ever share one, and the next owner of the folder knows it for a leftover."""
    return f"{TMP_PREFIX}{run_id}-{name}"


def rank_file_names(rank: int) -> tuple[str, str]:
    return f"rank_{rank:05d}.safetensors", f"rank_{rank:05d}.json"


def new_file_mode() -> int:
    """The mode open() gives a new file under this process's umask (0o644 for the usual 022). Read from
    /proc where it can be (os.umask sets it to read it, which another thread could race)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def apply_umask(path) -> None:
    """Gives `path` the mode of a file created under the umask: safetensors writes 0600 files, which
    the rest of a team on a shared filesystem could not read."""
    os.chmod(path, new_file_mode())


def fsync_path(path: Path) -> None:
    """Flushes a file or directory entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Writes `path` whole or not at all (temporary file, fsync, rename, fsync of the directory)."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_json_atomic(path: Path, value) -> None:
    write_file_atomic(path, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err}); the file is corrupted") from None


def latest_iteration_dir(save_dir: Path) -> Path | None:
    """The directory `latest` names, or None when there is no `latest` (no checkpoint yet)."""
    latest = save_dir / LATEST
    if not latest.is_file():
        return None
    name = latest_iteration_name(save_dir)
    target = save_dir / name if name else None
    # an iter_N folder of a run, or a tag of engine.save_checkpoint (megazero.initialize's engine)
    named = bool(name) and name.isprintable() and (name.startswith("iter_") or (target / METADATA).is_file())
    if not named or not target.is_dir():
        what = f"names {name!r}" if name and name.isprintable() else "holds no directory name (damaged)"
        newest = sorted(p.name for p in save_dir.glob("iter_*") if p.is_dir())
        fix = f"echo {newest[-1]} > {latest}" if newest else "point it at an existing iter_* directory"
        raise CheckpointError(
            f"{latest} {what}, which is not a checkpoint directory in {save_dir}; "
            f"write the one to resume from into it ({fix})"
        )
    return target


def latest_iteration_name(save_dir: Path) -> str | None:
    """What `latest` says, unchecked (None when there is none or it cannot be read; bytes that are
    not UTF-8, as a damaged file holds, read as U+FFFD, so that the name is never a directory)."""
    try:
        with open(Path(save_dir) / LATEST, "rb") as handle:
            return handle.read(256).decode("utf-8", "replace").strip()  # a name is ~15 bytes
    except OSError:
        return None


def copy_tokenizer(files: dict[str, str], folder: Path) -> None:
    """Copies the tokenizer's files ({name in the checkpoint: source path}) into `folder`."""
    folder.mkdir(exist_ok=True)
    for name, source in files.items():
        shutil.copyfile(source, folder / name)


def complete_iteration_dirs(save_dir: Path) -> list[Path]:
    """Complete checkpoints (with metadata) in iteration order."""
    dirs = [p for p in save_dir.glob("iter_*") if (p / METADATA).is_file()]
    return sorted(dirs, key=lambda p: p.name)


def commit_directory(tmp: Path, final: Path, run_id: str) -> str | None:
    """Renames a fully written temporary directory into place (replacing an older one of the same
    iteration only after the new one is complete), then points `latest` at it. Returns why the
    replaced directory could not be removed (it stays as a `.tmp-*` leftover), else None."""
    fsync_path(tmp)
    trash = None
    if final.exists():
        trash = final.with_name(temporary_name(run_id, f"old-{final.name}"))
        remove_tree(trash)
        os.replace(final, trash)
    os.replace(tmp, final)
    fsync_path(final.parent)
    write_file_atomic(final.parent / LATEST, (final.name + "\n").encode())
    return remove_tree(trash) if trash is not None else None


def remove_tree(path: Path) -> str | None:
    """Removes a file or directory tree (gone already is fine); returns why a part of it could not be
    removed ("Permission denied: <file>"), else None."""
    failures = []

    def failed(function, name, info):
        failures.append(f"{info[1].strerror or info[1]}: {name}")

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, onerror=failed)
    else:
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            failures.append(f"{err.strerror}: {path}")
    return failures[0] if failures else None
