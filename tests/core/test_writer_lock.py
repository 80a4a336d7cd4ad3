"""The one-writer lock (megazero.core.writer_lock): a second holder is refused in one line naming the
first (run id, pid, host); the lock belongs to the live process, so a killed holder's lock file blocks
nobody. Runs in-process and in one forked child (no interpreter start-up)."""

import os
import signal
import socket

import pytest

from megazero.core.errors import UsageError
from megazero.core.writer_lock import FolderLock


def test_a_second_writer_is_refused_naming_the_first_and_a_killed_ones_lock_blocks_nobody(tmp_path):
    """A forked child holds the lock: taking it here is refused at once, naming the child's run and
    pid; the child killed with SIGKILL (its lock file left behind) blocks nobody, and a lock released
    at a clean end removes its file. (Planted: take() without the flock call lets the second
    writer in.)"""
    path = tmp_path / "ck" / ".lock"
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # the first job: lock, say so, wait to be killed
        try:
            FolderLock.take(path, "run-a", "--save ck")
            os.write(ready_w, b"1")
            signal.pause()
        finally:
            os._exit(1)
    try:
        assert os.read(ready_r, 1) == b"1"
        with pytest.raises(UsageError) as err:
            FolderLock.take(path, "run-b", "--save ck")
        line = str(err.value)
        assert "\n" not in line and line.startswith(
            f"--save ck: another job writes there (run run-a, pid {child} on host {socket.gethostname()}, since "
        ), line
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert path.exists()  # left by the killed job: it blocks nobody
    lock = FolderLock.take(path, "run-b", "--save ck")
    assert '"run_id": "run-b"' in path.read_text() and lock.fd is not None
    with pytest.raises(UsageError, match="run run-b, pid"):  # another open file of this process too
        FolderLock.take(path, "run-c", "--save ck")
    lock.release()
    lock.release()  # idempotent
    assert not path.exists()
    FolderLock.take(path, "run-c", "--save ck").release()
