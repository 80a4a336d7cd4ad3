"""How reports name a source file: relative to the repository root, which is found from this
package's own location (megazero/core/ is two folders below it), never by looking for a folder's
name in a path. A checkout cloned into a folder named `megazero` (what `git clone` makes) then names
`tests/run/test_x.py` as `tests/run/test_x.py`, not `megazero/tests/run/test_x.py`.

Every call site a report shows (the comm log's, the host reads', the stream sanitizer's, the dry
run's) goes through `shown`. Code that needs to know which module a frame belongs to asks the
frame's module name (`frame.f_globals["__name__"]`), not its path.

Owns the naming only; reads no file, imports nothing of megazero's.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=None)
def repository_path(filename: str) -> str | None:
    """`filename` (absolute) relative to the repository root, with forward slashes; None for a file
    outside it, or a name that is not an absolute path ("<string>", a path relative to a cwd long
    gone). Cached: resolving a path per op was 40% of a dry-run rank's time."""
    if not os.path.isabs(filename):
        return None
    try:
        return Path(filename).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None


def shown(filename: str) -> str:
    """`filename` as a report shows it: from the repository root where it lies inside it, else as
    given (another project's file keeps its full path)."""
    inside = repository_path(filename)
    return filename if inside is None else inside
