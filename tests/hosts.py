"""Hosts of the tests' own: network namespaces on this machine, each a host with its own address,
host name, /etc/hosts and PID namespace, joined by one bridge (a switch in a namespace of its own),
so that torchrun on each host reaches the others over a real link, not loopback.

    with Hosts(2) as hosts:       # skips the test, with the reason, where it cannot be made
        jobs = [hosts.torchrun(k, ...) for k in range(2)]

Each host's processes run in a fresh PID namespace whose first process is held by `unshare
--kill-child`: killing that one process (`kill(k)`, SIGKILL) takes the host's whole torchrun tree with
it, as a host that loses power would; a peer's /proc cannot see them (as on another machine). `cut(k)`
sets the host's port on the bridge down: no process ends and no socket closes, packets are lost.
The filesystem is shared: a path under tmp_path is "a path both hosts see" (a cluster's shared disk).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.launching import torchrun_command

SUBNET = "10.77.0"
REPO = Path(__file__).resolve().parents[1]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why hosts cannot be made here, or None."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2's ip and util-linux's unshare"
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    return None


class Hosts:
    """`count` hosts, host k at 10.77.0.(k+1) named mzh<k> (see the module docstring)."""

    def __init__(self, count: int, loopback_names: bool = False):
        self.count = count
        self.tag = f"mzt{os.getpid() % 100000}"
        self.bridge = f"{self.tag}b"
        self.spaces = [f"{self.tag}h{k}" for k in range(count)]
        self.names = [f"mzh{k}" for k in range(count)]
        self.loopback_names = loopback_names  # each host's name resolves to 127.0.1.1 (Debian's habit)
        self.jobs: list[subprocess.Popen] = []

    def address(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    # --- making and removing -------------------------------------------------------------------
    def __enter__(self) -> "Hosts":
        why = unavailable()
        if why is None:
            try:
                self._make()
            except (subprocess.CalledProcessError, OSError) as err:
                self.close()
                why = f"network namespaces cannot be made here: {getattr(err, 'stderr', '') or err}".strip()
        if why is not None:
            pytest.skip(why)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        _ip("netns", "add", self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        for k, space in enumerate(self.spaces):
            _ip("netns", "add", space)
            outside, inside = f"{self.tag}p{k}", f"{self.tag}e{k}"
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", outside, "netns", self.bridge)
            _ip("link", "set", inside, "netns", space)
            _ip("-n", space, "link", "set", inside, "name", "eth0")
            _ip("-n", self.bridge, "link", "set", outside, "master", "br0")
            _ip("-n", self.bridge, "link", "set", outside, "up")
            _ip("-n", space, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
            _ip("-n", space, "link", "set", "eth0", "up")
            _ip("-n", space, "link", "set", "lo", "up")
        self.set_names(self.loopback_names)

    def set_names(self, loopback: bool) -> None:
        """Each host's /etc/hosts: every host's name at its address, or (loopback) its own at 127.0.1.1."""
        self.loopback_names = loopback
        for k, space in enumerate(self.spaces):
            etc = Path("/etc/netns") / space  # `ip netns exec` mounts these over /etc
            etc.mkdir(parents=True, exist_ok=True)
            lines = ["127.0.0.1 localhost"]
            for j, name in enumerate(self.names):
                lines.append(f"{'127.0.1.1' if j == k and loopback else self.address(j)} {name}")
            (etc / "hosts").write_text("\n".join(lines) + "\n")

    def offer_unreachable(self, k: int, to: int) -> str:
        """Host k gets a second interface, side0 at 10.66.0.(k+1) (one end of a veth pair of its own, as a
        link to another network), which host `to` routes to a gateway nobody holds: its packets there
        are lost (no host answers, nothing refuses). Returns the interface's name (for
        GLOO_SOCKET_IFNAME on host k)."""
        _ip("-n", self.spaces[k], "link", "add", "side0", "type", "veth", "peer", "name", "side1")
        _ip("-n", self.spaces[k], "addr", "add", f"10.66.0.{k + 1}/24", "dev", "side0")
        for end in ("side0", "side1"):
            _ip("-n", self.spaces[k], "link", "set", end, "up")
        _ip("-n", self.spaces[to], "route", "add", "10.66.0.0/24", "via", f"{SUBNET}.99")
        return "side0"

    def reset(self) -> None:
        """Between tests: every job ended, every link up, every name at its address."""
        self._end_jobs()
        for space in self.spaces:
            _ip("-n", space, "link", "del", "side0", check=False)  # and its peer
            _ip("-n", space, "route", "del", "10.66.0.0/24", check=False)
        for k in range(self.count):
            _ip("-n", self.bridge, "link", "set", f"{self.tag}p{k}", "up")
        self.set_names(False)

    def _end_jobs(self) -> None:
        for job in self.jobs:
            if job.poll() is None:
                job.kill()
        for job in self.jobs:
            try:
                job.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.jobs = []

    def close(self) -> None:
        self._end_jobs()
        for space in self.spaces:
            _ip("netns", "del", space, check=False)
            shutil.rmtree(Path("/etc/netns") / space, ignore_errors=True)
        _ip("netns", "del", self.bridge, check=False)  # takes the bridge's ends of the veths

    # --- running -------------------------------------------------------------------------------
    def run_on(self, k: int, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        """Starts `argv` on host k (its own network, host name and PID namespace), output to `log`."""
        environment = {**os.environ, **(env or {})}
        command = [
            "ip",
            "netns",
            "exec",
            self.spaces[k],
            "unshare",
            "--uts",
            "--pid",
            "--mount-proc",
            "--kill-child",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.names[k],
            *argv,
        ]
        with open(log, "wb") as out:
            job = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment, cwd=REPO)
        self.jobs.append(job)
        return job

    def torchrun(
        self,
        k: int,
        nnodes,
        nproc: int,
        flags: list[str],
        log: Path,
        rdzv: str = "static",
        port: int = 29511,
        env: dict | None = None,
        extra: list[str] = (),
    ) -> subprocess.Popen:
        """torchrun of pretrain_gpt.py on host k with host 0 as the master (static: --master-addr;
        c10d: --rdzv-endpoint)."""
        if rdzv == "static":
            launch = [
                "--nnodes",
                str(nnodes),
                "--node-rank",
                str(k),
                "--master-addr",
                self.address(0),
                "--master-port",
                str(port),
            ]
        else:
            launch = [
                "--nnodes",
                str(nnodes),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"{self.address(0)}:{port}",
                "--rdzv-id",
                self.tag,
            ]
        return self.run_on(
            k, torchrun_command(nproc, ["pretrain_gpt.py", *flags], launch=launch, extra=extra), log, env
        )

    def kill(self, k: int) -> None:
        """SIGKILL of host k's whole process tree (its PID namespace's first process)."""
        for job in self.jobs:
            if job.args[3] == self.spaces[k] and job.poll() is None:
                os.kill(job.pid, signal.SIGKILL)

    def cut(self, k: int) -> None:
        """Host k's link goes down at the bridge: its packets are lost, nothing on it notices."""
        _ip("-n", self.bridge, "link", "set", f"{self.tag}p{k}", "down")


def wait_all(jobs, timeout: float) -> list[tuple[int | None, float]]:
    """(exit code, seconds from now) of each job; None for one still running after `timeout`."""
    start, ended = time.monotonic(), {}
    while len(ended) < len(jobs) and time.monotonic() - start < timeout:
        for i, job in enumerate(jobs):
            if i not in ended and job.poll() is not None:
                ended[i] = (job.returncode, time.monotonic() - start)
        time.sleep(0.1)
    return [ended.get(i, (None, time.monotonic() - start)) for i in range(len(jobs))]


def wait_said(jobs, logs, timeout: float) -> list[tuple[int | None, float, float | None]]:
    """(exit code, seconds from now to its end, seconds from now to the first "error: " line of its
    log) of each job; None for one still running, or still without a line, after `timeout`. The line
    is the job's verdict as the user reads it; the end adds torchrun's teardown, which a loaded
    machine stretches."""
    start, ended, said, read = time.monotonic(), {}, {}, {i: 0 for i in range(len(jobs))}
    while (len(ended) < len(jobs) or len(said) < len(jobs)) and time.monotonic() - start < timeout:
        for i, (job, log) in enumerate(zip(jobs, logs)):
            if i not in said:
                with open(log, "rb") as handle:
                    handle.seek(max(0, read[i] - 200))  # a line may straddle two reads
                    text = handle.read().decode(errors="replace")
                    read[i] = handle.tell()
                if any(line.startswith("error: ") for line in text.splitlines()):
                    said[i] = time.monotonic() - start
            if i not in ended and job.poll() is not None:
                ended[i] = (job.returncode, time.monotonic() - start)
        time.sleep(0.1)
    return [(*ended.get(i, (None, time.monotonic() - start)), said.get(i)) for i in range(len(jobs))]


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def workers(job: subprocess.Popen) -> list[int]:
    """The pids (as this machine's root namespace sees them) of the workers under a host's torchrun."""
    torchrun = children(job.pid)  # unshare -> its child, torchrun (pid 1 on the host)
    return sorted(p for t in torchrun for p in children(t))
