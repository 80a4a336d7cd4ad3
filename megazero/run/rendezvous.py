"""How the ranks of a launch find each other, before any process group exists: the launcher's
variables checked against each other, then the rendezvous, bounded by --distributed-timeout-minutes.

`environment_problem` (torch-free: it runs before torch loads, within a second of the start) refuses
what cannot be one rank of one job: a RANK at or above WORLD_SIZE (`WORLD_SIZE=2 RANK=3`), a RANK
without a WORLD_SIZE, a LOCAL_RANK outside LOCAL_WORLD_SIZE, a world without MASTER_ADDR. Such a rank
would otherwise wait for peers that cannot come, or fail far from its cause.

`open_store` and `wait_for_ranks` are the rendezvous: the store at MASTER_ADDR:MASTER_PORT (torchrun's
agent's, or, where ranks were started by hand or by the deepspeed launcher, one rank 0 serves), then
the wait until every rank has registered in it. A rank that waits says so every 30 s, naming whom it
waits for; at the deadline it ends with one line naming the ranks that never came (`NeverJoined`).

Why not torch's env:// rendezvous: rank 0's store waits for its workers inside its constructor and a
client retries inside its own, silently up to the timeout and without knowing who is missing; and a
store wait that times out, like a client that cannot connect, logs C++ warnings and stack dumps on
stderr. So rank 0's store starts without waiting for workers, a client first finds the store's port
open with a plain socket, and arrivals are counted by polling one counter of the store.

The driver (megazero.run.launch) reads the environment and hands it in; this module knows one flag's
name, for its lines.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket
import time
from typing import Callable, Mapping

WAITING_LINE_EVERY_S = 30.0  # how often a waiting rank says whom it waits for
POLL_S = 0.5  # how often it looks (one request to the store)


class NeverJoined(Exception):
    """The rendezvous's deadline passed; str() is the line naming whom this rank waited for."""


def environment_problem(env: Mapping[str, str]) -> str | None:
    """The line refusing launcher variables that cannot describe one rank of one job, or None."""
    numbers = {}
    for name, least in (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1)):
        text = env.get(name)
        if text is None:
            continue
        if not text.strip().isdigit() or int(text) < least:
            return (
                f"{name}={text!r} is not a whole number >= {least}; start the ranks with torchrun, which "
                f"sets it, or give each process its own"
            )
        numbers[name] = int(text)
    world, rank = numbers.get("WORLD_SIZE"), numbers.get("RANK")
    if world is None and rank:
        return (
            f"RANK={rank} is set but WORLD_SIZE is not, so this process is a run of its own whose only "
            f"rank is 0; start the ranks with torchrun, or give every one WORLD_SIZE, RANK, MASTER_ADDR "
            f"and MASTER_PORT"
        )
    world = world or 1
    if world > 1 and rank is None:
        return (
            f"WORLD_SIZE={world} is set but RANK is not; start the ranks with torchrun (or give each of "
            f"the {world} processes its own RANK from 0 to {world - 1})"
        )
    if rank is not None and rank >= world:
        return (
            f"RANK={rank} is not below WORLD_SIZE={world} (ranks count from 0); give each of the {world} "
            f"processes its own RANK from 0 to {world - 1}, or start them with torchrun"
        )
    local_world = numbers.get("LOCAL_WORLD_SIZE")
    if local_world is not None and local_world > world:
        return (
            f"LOCAL_WORLD_SIZE={local_world} (ranks on this host) exceeds WORLD_SIZE={world}; start the "
            f"ranks with torchrun, or set LOCAL_WORLD_SIZE to this host's ranks"
        )
    local_rank, here = numbers.get("LOCAL_RANK"), local_world or world
    if local_rank is not None and local_rank >= here:
        return (
            f"LOCAL_RANK={local_rank} is not below {'LOCAL_WORLD_SIZE' if local_world else 'WORLD_SIZE'}="
            f"{here} (this host's ranks, counted from 0); give each rank on the host its own LOCAL_RANK"
        )
    if world > 1:
        if not env.get("MASTER_ADDR"):
            return (
                f"WORLD_SIZE={world} is set but MASTER_ADDR is not; start the ranks with torchrun (or set "
                f"MASTER_ADDR and MASTER_PORT)"
            )
        port = env.get("MASTER_PORT", "")
        if not port.strip().isdigit() or not 0 < int(port) < 65536:
            return (
                f"MASTER_PORT={port!r} is not a port number (1-65535); start the ranks with torchrun (or "
                f"give every rank the same MASTER_ADDR and MASTER_PORT)"
            )
    return None


@dataclasses.dataclass(frozen=True)
class Place:
    """This process's place in the launch as its variables give it; `problem`: the line refusing them
    (the numbers then hold what could be read, a value that is no number reading as unset)."""

    numbers: tuple[int, int, int, int]  # world, rank, local rank, local world
    problem: str | None


def place_of(env: Mapping[str, str], local_rank_flag: str | None = None) -> Place:
    """WORLD_SIZE, RANK, LOCAL_RANK (else the older launchers' --local_rank) and LOCAL_WORLD_SIZE."""

    def number(text, default: int) -> int:
        return int(text) if text is not None and text.strip().isdigit() else default

    world = number(env.get("WORLD_SIZE"), 1)
    local = number(env.get("LOCAL_RANK", local_rank_flag), 0)
    return Place(
        (world, number(env.get("RANK"), 0), local, number(env.get("LOCAL_WORLD_SIZE"), world)), environment_problem(env)
    )


def join(
    env: Mapping[str, str], rank: int, world: int, minutes: float, identity: str, say: Callable[[str], None] | None
):
    """This rank's rendezvous: (the launch's store, this attempt's prefix of it), once every rank has
    registered its `identity` there (megazero.run.failures.process_identity). Restarts (torchrun
    --max-restarts) keep one store for every attempt; each attempt's keys, the process group's
    included, live under its own prefix, numbered by the ranks' joins (each rank adds one to a
    counter, so attempt = (joins - 1) // world), which agree across hosts where torchrun's restart
    counts do not (a host whose torchrun joined later counts its restarts from 0)."""
    import torch.distributed as dist

    serves = rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"  # else torchrun's agent's
    # Waits among ranks that have joined are longer: the heartbeat names one that dies or stops, and
    # rank 0's first build of the data may take long.
    meeting = Rendezvous(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        rank,
        world,
        minutes,
        serves,
        say,
        store_wait=datetime.timedelta(minutes=max(30.0, minutes)),
    )
    store = meeting.open_store()
    attempt = (store.add("megazero/joined", 1) - 1) // world
    mine = dist.PrefixStore(f"megazero/attempt{attempt}", store)
    mine.set(f"process/{rank}", identity)
    mine.add("arrived", 1)
    meeting.wait_for_ranks(mine)
    return store, mine


def ranks_text(ranks: list[int]) -> str:
    """[1, 2, 3, 7] -> "ranks 1-3, 7"; [4] -> "rank 4"."""
    runs, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(f"{start}-{r}" if r > start else f"{r}")
            start = None
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(runs)}"


class Rendezvous:
    """One rank's rendezvous at `host`:`port` for `world` ranks, within `minutes` (the flag's value).
    `serves`: this process hosts the store (rank 0 without torchrun's agent); `say`: where its waiting
    lines go (None: it waits quietly; one rank per host speaks)."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world: int,
        minutes: float,
        serves: bool,
        say: Callable[[str], None] | None,
        store_wait: datetime.timedelta,
    ):
        self.host, self.port, self.rank, self.world = host, port, rank, world
        self.minutes, self.serves, self.say, self.store_wait = minutes, serves, say, store_wait
        self.started = time.monotonic()
        self.deadline = self.started + 60 * minutes
        self.flag = f"--distributed-timeout-minutes {minutes:g}"
        self._next_line = self.started + WAITING_LINE_EVERY_S

    def open_store(self):
        """The launch's store, once its port answers (a client) or once it listens (rank 0)."""
        import torch.distributed as dist

        if not self.serves:
            self._wait_until_open()
        return dist.TCPStore(
            self.host,
            self.port,
            self.world,
            self.serves,
            timeout=self.store_wait,
            wait_for_workers=False,
            multi_tenant=True,
        )

    def _wait_until_open(self) -> None:
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=min(5.0, POLL_S * 4)):
                    return
            except OSError as err:
                reason = err.strerror or type(err).__name__
            where = f"the rendezvous store at {self.host}:{self.port}"
            if time.monotonic() >= self.deadline:
                raise NeverJoined(
                    f"rank {self.rank}: {where} did not open within {self.flag} ({reason}): rank 0 "
                    f"never started, or listens elsewhere; start rank 0 with the same MASTER_ADDR "
                    f"and MASTER_PORT (rank 0's address as this host sees it)"
                )
            self._waiting(f"{where} to open (rank 0's, or torchrun's; {reason})")
            time.sleep(POLL_S)

    def wait_for_ranks(self, store) -> None:
        """Returns once every rank has registered `process/<rank>` in `store` (this attempt's) and counted
        itself in its "arrived"; raises NeverJoined at the deadline, naming the ranks still missing."""
        # rank 0 started first: its deadline, and the end of its store, may come a little before ours
        near = self.deadline - max(5.0, 0.1 * 60 * self.minutes)
        known, arrived = None, 0  # the missing ranks as last read near the deadline
        while True:
            try:
                arrived = store.add("arrived", 0)
                if arrived >= self.world:
                    return
                now = time.monotonic()
                late = now >= self.deadline
                missing = self._missing(store) if late or now >= near or self._line_due() else None
                known = missing if now >= near and missing is not None else known
            except RuntimeError as err:  # rank 0 ended (its store with it), or the network went
                if known is not None:  # at its deadline: the same line as rank 0's
                    raise NeverJoined(self._never_joined(known)) from None
                raise NeverJoined(
                    f"rank {self.rank}: the rendezvous store at {self.host}:{self.port} stopped "
                    f"answering while {self.world - arrived} of {self.world} ranks had not joined "
                    f"({str(err).splitlines()[0]}); see rank 0's line"
                ) from None
            if late:
                raise NeverJoined(self._never_joined(missing))
            if missing is not None:
                self._waiting(
                    f"{ranks_text(missing)} to join the rendezvous at {self.host}:{self.port} "
                    f"({self.world - len(missing)} of {self.world} here)"
                )
            time.sleep(POLL_S)

    def _never_joined(self, missing: list[int]) -> str:
        return (
            f"rank {self.rank}: {ranks_text(missing)} never joined the rendezvous at {self.host}:{self.port} "
            f"within {self.flag} ({self.world - len(missing)} of {self.world} joined); start them with "
            f"WORLD_SIZE={self.world} and the same MASTER_ADDR and MASTER_PORT, or give every rank a "
            f"WORLD_SIZE of the ranks you start"
        )

    def _missing(self, store) -> list[int]:
        return [r for r in range(self.world) if not store.check([f"process/{r}"])]

    def _line_due(self) -> bool:
        return self.say is not None and time.monotonic() >= self._next_line

    def _waiting(self, what: str) -> None:
        if not self._line_due():
            return
        now = time.monotonic()
        self._next_line = now + WAITING_LINE_EVERY_S
        self.say(
            f"rank {self.rank}: waiting {now - self.started:.0f} s for {what}; {self.flag} ends the wait "
            f"in {max(0.0, self.deadline - now):.0f} s"
        )
