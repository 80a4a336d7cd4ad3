"""How a launch ends once its ranks run: the one line a user reads, the exit code, and the copy of that
line torchrun's failure summary shows.

Owns: telling a collective that failed because a peer went away (its process ended: kill -9, a crash)
or stopped answering (SIGSTOP, a hang; gloo's op timeout is --distributed-timeout-minutes) from other
errors, and naming that peer and the collective waited on; Ctrl-C without --exit-signal-handler; and
torchrun's error file (torch.distributed.elastic's mechanism: the worker writes
TORCHELASTIC_ERROR_FILE, torchrun prints it as the failure's "traceback"), so that the root cause is
the last thing a user reads. The driver (megazero.run.launch) hands in the paths and the store; this
module reads no environment variable and knows no flag.

Peers are named from facts, not guesses: each rank registers its host, PID namespace and PID in the
launch's store at start-up, so a rank whose collective failed looks its peers up in /proc (ended or
zombie: the process is gone; state T: stopped). Peers on other hosts cannot be looked at; the line
then names the group's ranks there.

Exit codes: 0 done (a signal handled by --exit-signal-handler included), 1 a failure while running
(a lost or silent rank, a failed last save, a bug), 2 bad input (flags, configs, data, checkpoints),
130 interrupted by Ctrl-C. Under torchrun the launcher itself exits 1 whenever a worker failed; the
workers' codes are in its summary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import time
import traceback
from pathlib import Path

EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class Interrupts:
    """SIGINT when --exit-signal-handler is off: the first raises KeyboardInterrupt (as Python's own
    handler does); later ones, and any that arrive while the run is ending, are only counted, so the
    line that ends the run is written whole. torchrun forwards the terminal's Ctrl-C, so a worker
    often receives two."""

    def __init__(self):
        self.received = 0
        self.ending = False

    def __call__(self, signum, frame) -> None:
        self.received += 1
        if self.received == 1 and not self.ending:
            raise KeyboardInterrupt


def process_identity(address: str | None = None) -> str:
    """This process as a peer can look it up: host, PID namespace, PID, and the address its process
    group offers (to name the rank behind an address in a connection's error)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return json.dumps({"host": socket.gethostname(), "ns": namespace, "pid": os.getpid(), "address": address})


def peer_state(identity: str | None) -> str | None:
    """What /proc says of a peer registered as `identity`: "its process ended", "its process is
    stopped (SIGSTOP?)", "its process is running", or None when it lives elsewhere (or is unknown)."""
    if identity is None:
        return None
    peer, mine = json.loads(identity), json.loads(process_identity())
    if (peer["host"], peer["ns"]) != (mine["host"], mine["ns"]) or not peer["ns"]:
        return None
    try:
        stat = Path(f"/proc/{peer['pid']}/stat").read_text()
    except OSError:
        return "its process ended"
    state = stat.rsplit(")", 1)[1].split()[0]
    if state in ("Z", "X"):
        return "its process ended"
    if state in ("T", "t"):
        return "its process is stopped (SIGSTOP, or a debugger)"
    return "its process is running"


@dataclasses.dataclass
class Collective:
    """The collective a rank was waiting on when it failed."""

    op: str  # all_reduce, broadcast, ...; "an asynchronous collective"
    group: str | None = None  # the comm layer's group name
    ranks: tuple[int, ...] | None = None

    def describe(self) -> str:
        where = f" over the {self.group} group (ranks {list(self.ranks)})" if self.group else ""
        return f"{self.op}{where}"


def collective_in(tb) -> Collective | None:
    """The comm layer's innermost frame in a traceback (its function and group), else the outermost
    torch.distributed function (init_process_group, new_group, ...); None when neither is there."""
    comm_frame, torch_name = None, None
    while tb is not None:
        frame = tb.tb_frame
        module = frame.f_globals.get("__name__", "")  # the module, not its path (source_paths)
        if module == "megazero.core.comm" and frame.f_code.co_name not in ("<lambda>", "_issue"):
            comm_frame = frame  # the comm layer's collective, not the helper issuing it
        elif f"{module}.".startswith("torch.distributed.") and torch_name is None and frame.f_code.co_name != "wrapper":
            torch_name = frame.f_code.co_name
        tb = tb.tb_next
    if comm_frame is not None:
        name, group = comm_frame.f_code.co_name, comm_frame.f_locals.get("group")
        if name in ("wait", "_finish") or group is None:
            return Collective("an asynchronous collective" if name == "wait" else name)
        return Collective(name, getattr(group, "name", None), tuple(getattr(group, "ranks", ())))
    return None if torch_name is None else Collective(torch_name)


def _first_line(err: BaseException) -> str:
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's "[.../pair.cc:537] " source prefix


_REMOTE = re.compile(r"remote=\[([^\]]+)\]:(\d+)|peer \[([^\]]+)\]:(\d+)")
_CONNECT = re.compile(r"SO_ERROR: ([^,]+), remote=\[([^\]]+)\]:(\d+)")


def host_ranks(peers: dict[int, str | None], host: str) -> list[int]:
    """The ranks registered on `host` (this rank's own not among `peers`)."""
    return sorted(r for r, identity in peers.items() if identity and json.loads(identity)["host"] == host)


def describe_host(peers: dict[int, str | None], rank: int) -> str | None:
    """ "host H (ranks a, b)" for the host `rank` registered from, None when unknown."""
    identity = peers.get(rank)
    if identity is None:
        return None
    host = json.loads(identity)["host"]
    return f"host {host} (ranks {', '.join(map(str, host_ranks(peers, host)))})"


def _at_address(peers: dict[int, str | None], address: str) -> list[int]:
    return sorted(r for r, identity in peers.items() if identity and json.loads(identity).get("address") == address)


def _connect_line(err, rank: int, peers, collective: "Collective") -> str | None:
    """A connection that could not be made (refused, unreachable): which rank, which address."""
    found = _CONNECT.search(str(err))
    if found is None:
        return None
    reason, address, port = found.groups()
    ranks = _at_address(peers, address)
    who = (
        f"rank {ranks[0]}" if len(ranks) == 1 else f"a rank of {describe_host(peers, ranks[0])}" if ranks else "a peer"
    )
    return (
        f"rank {rank}: cannot connect to {who} at {address}:{port} ({reason.strip().lower()}) during "
        f"{collective.describe()}"
    )


def _lost_host(err, peers, elsewhere: list[int]) -> str | None:
    """The host a failed connection was with: the remote address the error names, else the one other
    host among `elsewhere`."""
    for found in _REMOTE.finditer(str(err)):
        address = found.group(1) or found.group(3)
        ranks = _at_address(peers, address)
        if ranks:
            return describe_host(peers, ranks[0])
    hosts = {json.loads(peers[r])["host"] for r in elsewhere if peers.get(r)}
    return (
        describe_host(peers, elsewhere[0])
        if len(hosts) == 1 and len(elsewhere) == sum(1 for r in elsewhere if peers.get(r))
        else None
    )


def peer_failure_line(
    err: BaseException, rank: int, peers: dict[int, str | None], timeout_minutes: float
) -> str | None:
    """The line for an error raised by a collective (None for any other error). `peers` maps every
    other rank to its registered identity (None when unknown)."""
    collective = collective_in(err.__traceback__)
    if collective is None or not isinstance(err, RuntimeError):
        return None
    connect = _connect_line(err, rank, peers, collective)
    if connect is not None:  # gloo says "timed out connecting" for a refused connection too
        return connect
    considered = [r for r in (collective.ranks or peers) if r != rank]
    states = {r: peer_state(peers.get(r)) for r in considered}
    timed_out = "timed out" in str(err).lower() or "timeout" in str(err).lower()
    culprits = [r for r, s in states.items() if s and "running" not in s]
    if timed_out:
        named = culprits or [r for r, s in states.items() if s is None] or considered
        what = "; ".join(f"rank {r}: {states[r] or 'on another host'}" for r in named)
        return (
            f"rank {rank}: no answer within --distributed-timeout-minutes {timeout_minutes:g} during "
            f"{collective.describe()} ({what})"
        )
    if culprits:
        lost = ", ".join(f"rank {r} ({states[r]})" for r in culprits)
        return f"rank {rank}: lost {lost} during {collective.describe()}"
    elsewhere = [r for r, s in states.items() if s is None]
    host = _lost_host(err, peers, elsewhere) if elsewhere else None
    if host is not None:
        return f"rank {rank}: lost {host}: {collective.describe()} failed ({_first_line(err)})"
    who = f"a peer among ranks {elsewhere} (on other hosts)" if elsewhere else "a peer"
    return f"rank {rank}: {collective.describe()} failed, {who} went away ({_first_line(err)})"


def write_error_file(path: str | None, line: str) -> None:
    """torchrun's error file with megazero's line as the failure's message (shown as its traceback)."""
    if path:
        _write(path, {"message": line, "timestamp": int(time.time())})


def write_traceback_error_file(path: str | None, err: BaseException) -> None:
    """torchrun's error file for an unexpected exception, as torch's own @record writes it."""
    if path:
        stack = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        _write(
            path,
            {
                "message": {
                    "message": f"{type(err).__name__}: {err}",
                    "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))},
                }
            },
        )


def _write(path: str, data: dict) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data))
    except OSError:
        pass  # the summary falls back to torchrun's own wording
