"""torchrun from a test: the one command line every torchrun launch of the tests is built with, the
environment its workers get, a blocking run, and `Torchrun`, a 2-rank launch a test can watch, stop,
kill and read rank by rank (tests/run/test_operations.py's lost, stopped and interrupted ranks).

Owns how the tests spell torchrun's flags; it does not pick what the launched script is asked to do
(each test's argv) nor check anything about the run (the tests assert).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megazero.testing import free_port

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = REPO / "pretrain_gpt.py"


def torchrun_command(
    nproc: int,
    script: list[str],
    *,
    launch: list[str] | None = None,
    log_dir: Path | None = None,
    extra: tuple[str, ...] | list[str] = (),
) -> list[str]:
    """`python -m torch.distributed.run --nproc-per-node N <launch> [--log-dir D --redirects 3] <extra>
    <script...>`. `launch`: the rendezvous flags (default: one node, a free --master-port); `log_dir`:
    each rank's output in its own file under it, per attempt; `extra`: more of torchrun's flags;
    `script`: the script's path and its arguments."""
    if launch is None:
        launch = ["--master-port", str(free_port())]
    logs = ["--log-dir", str(log_dir), "--redirects", "3"] if log_dir is not None else []
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        *launch,
        *logs,
        *extra,
        *script,
    ]


def worker_env(**extra: str) -> dict:
    """This process's environment with one thread per worker (the ranks share the machine's cores)."""
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


def run_torchrun(
    nproc: int, script: list[str], cwd: Path, *, timeout: float = 900, env: dict | None = None, **command
) -> subprocess.CompletedProcess:
    """torchrun_command(nproc, script, **command) run to its end in `cwd`, output captured as text;
    `env`: extra variables over worker_env()."""
    return subprocess.run(
        torchrun_command(nproc, script, **command),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=worker_env(**(env or {})),
    )


class Torchrun:
    """A 2-rank torchrun launch of pretrain_gpt.py in its own session (so Ctrl-C can reach the whole
    group), each rank's output in its own log file (--redirects 3), per restart attempt."""

    def __init__(self, cwd: Path, argv: list[str], *launcher: str):
        port = free_port()
        self.cwd, self.logs = cwd, cwd / f"logs-{port}"  # one folder per launch
        cmd = torchrun_command(
            2, [str(PRETRAIN), *argv], launch=["--master-port", str(port)], log_dir=self.logs, extra=launcher
        )
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=worker_env(),
            start_new_session=True,
        )

    def rank_pid(self, rank: int) -> int:
        """The worker process of `rank` (a child of torchrun whose environment says RANK=rank)."""
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            for child in Path(f"/proc/{self.proc.pid}/task/{task}/children").read_text().split():
                try:
                    environ = Path(f"/proc/{child}/environ").read_bytes()
                except OSError:  # a worker that has just ended
                    continue
                if f"RANK={rank}".encode() in environ.split(b"\0"):
                    return int(child)
        raise AssertionError(f"no worker of rank {rank}")

    def wait_for(self, what, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert self.proc.poll() is None, self.proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "hang"
            time.sleep(0.1)

    def finish(self, timeout: float = 900) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        return self.proc.returncode, err

    def wait_until_blocked(self, rank: int, quiet: float = 1.0) -> None:
        """Until `rank` has used no CPU for `quiet` seconds: blocked in a collective (a stopped peer
        leaves it nothing else to wait for), not writing a shard or computing."""

        def cpu_time():
            fields = Path(f"/proc/{self.rank_pid(rank)}/stat").read_text().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])  # utime + stime

        last, since = cpu_time(), time.monotonic()
        while time.monotonic() - since < quiet:
            assert self.proc.poll() is None, "the launch ended"
            time.sleep(0.1)
            now = cpu_time()
            if now != last:
                last, since = now, time.monotonic()

    def log(self, attempt: int, rank: int, stream: str = "stderr") -> str:
        return next(self.logs.rglob(f"attempt_{attempt}/{rank}/{stream}.log")).read_text()

    def stop_rank_until_said(self, rank: int, started, timeout: float) -> tuple[float, int, str]:
        """Once `started()`, SIGSTOP of `rank`, then waits (up to `timeout` s) for rank 0's first
        "error:" line, SIGKILLs the stopped rank (torchrun would only after its 30 s grace) and lets the
        launch end. Returns (seconds from the stop to the line, torchrun's exit code, its stderr); the
        whole launch is killed if anything fails on the way."""
        try:
            self.wait_for(started)
            os.kill(self.rank_pid(rank), signal.SIGSTOP)
            stopped = time.monotonic()
            self.wait_for(lambda: "error:" in self.log(0, 0), timeout=timeout)
            waited = time.monotonic() - stopped
            os.kill(self.rank_pid(rank), signal.SIGKILL)
            code, err = self.finish(timeout=300)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return waited, code, err
