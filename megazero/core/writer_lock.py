"""One writer per folder: the advisory lock a job holds while it writes a checkpoint folder (--save) or
a run's metrics, so that a second job started on the same place refuses in one line naming the
first, instead of replacing its files.

The lock is flock(2) on a lock file, taken without waiting. The kernel holds it for the open file
and drops it when the process ends, however it ends (kill -9 included): a killed job's lock never
blocks the next job, and the file existing means nothing by itself. Its content (host, pid, run id,
since when) only names the holder in the refusal. Linux emulates flock on NFS with POSIX byte-range
locks, which the server arbitrates between hosts; a filesystem that refuses locks altogether
(Lustre mounted without `flock`) is said in one line and the job goes on unlocked.

A lock released at a clean end removes its file. A job that locked a file in the moment another
removed it sees that the path no longer names its file and takes the new one: two holders are
impossible. Owns only the lock; which folders are locked, and by which rank, is the caller's.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from .errors import UsageError

# flock's answers on a filesystem without locks: the job runs unlocked, with a line
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class FolderLock:
    """A held lock (`take`), or the note that this filesystem has none (`fd` None)."""

    def __init__(self, path: Path, fd: int | None, note: str | None = None):
        self.path, self.fd, self.note = path, fd, note

    @classmethod
    def take(cls, path, run_id: str, what: str) -> "FolderLock":
        """Locks `path` (created with its folder) for this process; a UsageError naming the holder
        (`what` first, e.g. "--save ck") when another job holds it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(10):  # only a lock file removed between open and flock repeats this
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise UsageError(
                    f"{what}: another job writes there ({describe_holder(path)}); let it "
                    f"finish, or choose another folder"
                ) from None
            except OSError as err:
                os.close(fd)
                if err.errno not in _NO_LOCKS:
                    raise
                return cls(
                    path,
                    None,
                    f"{what}: this filesystem refuses file locks ({err.strerror}); "
                    f"nothing keeps a second job from writing there too",
                )
            if _names(path, fd):
                os.ftruncate(fd, 0)
                os.pwrite(
                    fd,
                    (
                        json.dumps(
                            {
                                "host": socket.gethostname(),
                                "pid": os.getpid(),
                                "run_id": run_id,
                                "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                            }
                        )
                        + "\n"
                    ).encode(),
                    0,
                )
                return cls(path, fd)
            os.close(fd)  # the holder before us removed this file as we opened it
        raise UsageError(f"{what}: its lock file {path} keeps being replaced; is another program removing it?")

    def release(self) -> None:
        """Removes the lock file and lets the lock go (idempotent)."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            if _names(self.path, fd):
                os.unlink(self.path)
        finally:
            os.close(fd)


def _names(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def describe_holder(path: Path) -> str:
    """The holder as its lock file names it: "run R, pid P on host H, since T". A holder that has
    locked but not yet written gets a moment to do so."""
    for _ in range(20):
        try:
            holder = json.loads(Path(path).read_text() or "null")
        except (OSError, ValueError):
            holder = None
        if isinstance(holder, dict):
            return (
                f"run {holder.get('run_id')}, pid {holder.get('pid')} on host {holder.get('host')}, "
                f"since {holder.get('since')}"
            )
        time.sleep(0.05)
    return f"its lock file {path} names no one yet"
