"""The one exception type for bad user input (flags, configs, checkpoints, data files), and the check
every entry point shares: can a path the run will write be written.

Raised before any process group or file is touched; the driver prints its message as a single line
and exits non-zero, so the message itself must name the problem and the fix.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class UsageError(ValueError):
    """Bad input from the user; the message says what is wrong and how to fix it."""


class AgreedStop(Exception):
    """Every rank stops here together, after agreeing on why (no collective is left in flight): the
    launch prints the message once and exits with `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def _existing_ancestor(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(".")


def _probe_directory(folder: Path) -> str | None:
    """Why no file can be created in `folder`, or None. Permission bits and read-only mounts are read
    first; a temporary directory made and removed at once settles the rest (root ignores the bits,
    /proc refuses anyway)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return "is not writable"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".megazero-probe-", dir=folder))
    except OSError as err:
        return f"refuses new files ({err.strerror})"
    return None


def check_writable_dir(path, what: str, fix: str) -> None:
    """Raises UsageError unless directory `path` exists and is writable, or can be created. Creates
    nothing: the probe leaves the file system as it found it. `what` names the flag or variable
    (e.g. "--run-dir runs/x"), `fix` says what to do instead."""
    path = Path(path)
    found = _existing_ancestor(path)
    if found == path and not path.is_dir():
        raise UsageError(f"{what} is a file, not a directory; {fix}")
    if found != path and not found.is_dir():
        raise UsageError(f"{what} cannot be created: {found} is a file; {fix}")
    problem = _probe_directory(found)
    if problem and found == path:
        raise UsageError(f"{what} {problem}; {fix}")
    if problem:
        raise UsageError(f"{what} cannot be created: {found} {problem}; {fix}")


def check_writable_file(path, what: str, fix: str) -> None:
    """Raises UsageError unless file `path` can be appended to, or created (with its folders)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{what} is a directory, not a file; {fix}")
    if not os.path.lexists(path):
        check_writable_dir(path.parent, f"{what}: its folder {path.parent}", fix)
        return
    try:
        with open(path, "a"):  # append mode without a write leaves content and mtime alone
            pass
    except OSError as err:
        raise UsageError(f"{what} cannot be written ({err.strerror}); {fix}") from None
