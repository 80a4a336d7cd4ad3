"""One writer per --save folder and per run folder (megazero.run.run_folder, megazero.core.writer_lock):
a second job refuses in one line naming the first and changes none of its files; a killed job's lock
blocks nobody and what its save left goes with a line; every metrics record carries the run id; two
jobs never draw the same default run folder.

One 2-rank torchrun job runs throughout; the second jobs (in-process, and a 2-rank torchrun) and the
resume after the first is killed check against it. Timeouts only catch hangs."""

import fcntl
import hashlib
import json
import os
import signal
import time

from tests.driver import TINY
from tests.driver import run_main as _main
from tests.launching import Torchrun
from tests.metrics_reading import metrics_records
from tests.run.test_operations import TORCHRUN_FLAGS
from megazero.checkpoint import CheckpointReader
from megazero.config.train_flags import config_from_args, parse_args


def _sha256(folder):
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _kill(job):
    """SIGKILL to the job's ranks (each in its own session under torchrun) and to torchrun."""
    ranks = []
    for rank in (0, 1):
        try:
            ranks.append(job.rank_pid(rank))
        except AssertionError:  # already ended
            pass
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    os.killpg(job.proc.pid, signal.SIGKILL)
    job.proc.communicate()


def _wait_until_unlocked(path):
    """Until the killed holder's threads are all gone and the kernel has dropped its lock (a zombie
    group leader may show while its other threads still hold the open file)."""
    deadline = time.monotonic() + 60
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "a killed rank holds its lock on"
                time.sleep(0.1)
    finally:
        os.close(fd)  # lets the probe's lock go, the file (A's) stays


def test_a_second_job_on_a_folder_refuses_in_one_line_and_changes_nothing(tmp_path, capsys, monkeypatch):
    """Job A (2 ranks) trains with --save ck. As it starts (its lock taken, nothing saved yet), a 1-rank
    job on --save ck and a job on A's --run-dir end with exit code 2 and one line naming A's run id and
    pid; once A saved, so does a 2-rank job on --save ck, and A's checkpoints keep their sha256 and A
    goes on. A killed with SIGKILL leaves its lock file: the resume takes the folder anyway, removes a
    leftover `.tmp-*` save with a line and logs records carrying A's run id, as A's did. (Planted:
    configure() taking no lock: the 1-rank job starts training into ck, or, when A saved first, is
    refused by the start-up check without a word of A; the metrics logger without run_id fails the
    last check.)"""
    monkeypatch.chdir(tmp_path)
    argv = TORCHRUN_FLAGS + ["--train-iters", "100000", "--save", "ck", "--save-interval", "2", "--run-dir", "ra"]
    job_a = Torchrun(tmp_path, argv)
    try:
        lock = tmp_path / "ck" / ".lock"
        written = lambda: lock.exists() and lock.stat().st_size > 0  # noqa: E731
        job_a.wait_for(lambda: written() or (tmp_path / "ra" / "metrics.jsonl").exists())  # A is starting
        run_a = json.loads(lock.read_text())["run_id"] if written() else "(no lock taken)"
        holder = f"another job writes there (run {run_a}, pid {job_a.rank_pid(0)} on host "
        started = time.monotonic()
        code, out = _main(TINY + ["--train-iters", "4", "--save", "ck"], capsys)
        one_rank = time.monotonic() - started
        assert code == 2 and out.err.count("\n") == 1 and out.err.startswith(f"error: --save ck: {holder}"), out.err
        code, out = _main(TINY + ["--train-iters", "4", "--run-dir", "ra"], capsys)
        assert code == 2 and out.err.startswith(f"error: --run-dir ra: {holder}"), out.err
        job_a.wait_for(lambda: (tmp_path / "ck" / "latest").exists())
        before = _sha256(tmp_path / "ck" / "iter_0000002")
        job_b = Torchrun(tmp_path, TORCHRUN_FLAGS + ["--train-iters", "4", "--save", "ck", "--run-dir", "rb"])
        code, err = job_b.finish()
        assert code != 0 and "exitcode  : 2" in err, err[-2000:]
        first, second = job_b.log(0, 0), job_b.log(0, 1)
        assert first.count("\n") == 1 and first.startswith(f"error: --save ck: {holder}"), first
        assert second == "" and "megazero:" not in job_b.log(0, 0, "stdout")
        assert job_a.proc.poll() is None, "job A stopped"
        saved = sorted(p.name for p in (tmp_path / "ck").glob("iter_*"))
        print(f"the 1-rank job refused in {one_rank:.1f} s; job A had saved {saved}")
    finally:
        _kill(job_a)
    assert _sha256(tmp_path / "ck" / "iter_0000002") == before
    assert {CheckpointReader(tmp_path / "ck" / name).run_id for name in saved} == {run_a}
    assert (tmp_path / "ck" / ".lock").exists()  # A's, left by the kill
    _wait_until_unlocked(tmp_path / "ck" / ".lock")
    leftover = tmp_path / "ck" / ".tmp-0123-iter_0999999"
    leftover.mkdir(exist_ok=True)
    (leftover / "rank_00000.safetensors").write_bytes(b"x" * 2**20)
    code, out = _main(
        TINY
        + [
            "--train-iters",
            "100000",
            "--num-attention-heads",
            "4",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--save",
            "ck",
            "--load",
            "ck",
            "--exit-interval",
            "1",
            "--run-dir",
            "rc",
        ],
        capsys,
    )
    assert code == 0, out.err
    assert " --save ck: removed what interrupted saves left there: " in out.out and ".tmp-0123-iter_0999999" in out.out
    assert not list((tmp_path / "ck").glob(".tmp-*")) and not (tmp_path / "ck" / ".lock").exists()
    assert {r.get("run_id") for r in metrics_records(tmp_path / "ra" / "metrics.jsonl")} == {run_a}
    assert {r.get("run_id") for r in metrics_records(tmp_path / "rc" / "metrics.jsonl")} == {run_a}


def test_default_run_folders_differ_within_a_second():
    folders = {config_from_args(parse_args([])).run_dir for _ in range(20)}
    assert len(folders) == 20 and all(f.startswith("runs/gpt-") for f in folders), folders
