"""Heartbeats through the launch's store, and the watch that names a rank gone silent.

Owns: one daemon thread per rank that, every `interval` seconds, writes this rank's beat (a count,
the last collective it issued) under `heartbeat/<rank>` of the launch's store and reads the beat of
the rank it watches: the next one, in a ring, so each rank is watched by exactly one and the store
serves three small requests per rank and beat whatever the world size. A watched rank whose count
has not moved for `timeout` seconds (measured on the watcher's own clock, so hosts' clocks may
disagree) is silent: its process is stopped or gone, or its host is. The watcher then ends the job
with one line naming that rank, what /proc says of it where it can look, the collective this rank
last issued (where it waits for the silent one) and the silent rank's last. Every other rank sees
the line in the store at its next beat and leaves with it, so the job ends everywhere within a beat.

Why not the backend: NCCL's watchdog aborts the process at its own timeout with no Python exception,
and a rank blocked in a stream synchronisation sees no error at all; gloo raises, but only after its
op timeout. The store is independent of the backend, and this thread runs while the main thread is
blocked in C++ (collectives and synchronisations release the GIL). So the timeout here is set below
the backend's (--heartbeat-timeout-minutes, by default half of --distributed-timeout-minutes).

The line and the exit go through the launch's own agreement (`end_first`: the first rank to end
prints, the others copy its line into torchrun's error file); the thread ends the process itself
(os._exit), since the main thread cannot be interrupted inside a collective. Must not touch: the
process group, tensors, files other than torchrun's error file.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from megazero.run import failures

_ENDING = "ending/line"  # megazero.run.launch.Launch.end_first's key


class Heartbeat:
    """Beats for `rank` of `world` in `store` and watches the next rank (see the module docstring).
    `activity()` says what this rank last issued ("all_gather over the dp group (ranks [0, 1])");
    `end(line, code)` is the launch's agreement: (first?, line to show, exit code)."""

    def __init__(
        self,
        store,
        rank: int,
        world: int,
        timeout_s: float,
        activity,
        end,
        peers,
        error_file: str | None,
        interval_s: float | None = None,
        timeout_flag: str = "",
        host_speaker: bool = True,
    ):
        self.store, self.rank, self.world, self.timeout = store, rank, world, timeout_s
        self.activity, self.end, self.peers, self.error_file = activity, end, peers, error_file
        self.interval = interval_s if interval_s is not None else min(10.0, max(0.5, timeout_s / 5))
        self.timeout_flag = timeout_flag
        self.host_speaker = host_speaker  # prints the line when this host lost the store (local rank 0)
        self.watched = (rank + 1) % world
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megazero-heartbeat", daemon=True)
        self._seen = (None, time.monotonic())  # the watched rank's last count, and when it changed
        self._store_down_since = None
        self._answered = time.monotonic()  # when the store last answered this thread
        self._guard = threading.Thread(target=self._guard_run, name="megazero-heartbeat-guard", daemon=True)
        self._leaving = threading.Lock()

    def start(self) -> "Heartbeat":
        self._beat()
        self._answered = time.monotonic()
        self._thread.start()
        self._guard.start()
        return self

    def stop(self) -> None:
        """A clean end: the watcher of this rank is told not to wait for beats any more."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5 * self.interval)
        try:
            self.store.set(f"heartbeat/{self.rank}", json.dumps({"done": True}))
        except (RuntimeError, ValueError):
            pass

    # --- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                line = self._check()
                self._store_down_since = None
                self._answered = time.monotonic()
            except (RuntimeError, ValueError) as err:  # the store did not answer
                line = self._store_silent(err)
            if line is not None and not self._stop.is_set():
                self._leave(*line)

    def _beat(self) -> None:
        self.count += 1
        self.store.set(f"heartbeat/{self.rank}", json.dumps({"n": self.count, "last": self.activity()}))

    def _check(self):
        """(line, code, first?) when the job must end now, else None."""
        if self.store.check([_ENDING]):
            shown, code = json.loads(self.store.get(_ENDING))
            return shown, code, False
        key = f"heartbeat/{self.watched}"
        if not self.store.check([key]):
            return None  # not started yet: its launch is still coming up
        beat = json.loads(self.store.get(key))
        if beat.get("done"):
            return None
        count, since = self._seen
        now = time.monotonic()
        if beat["n"] != count:
            self._seen = (beat["n"], now)
            return None
        if now - since < self.timeout:
            return None
        return self._silent_line(beat, now - since)

    def _silent_line(self, beat: dict, age: float):
        peers = self.peers()
        state = failures.peer_state(peers.get(self.watched))
        host = failures.describe_host(peers, self.watched) if state is None else None
        mine, theirs = self.activity(), beat.get("last")
        where = f"on {host}: that host is lost or cut off" if host is not None else state or "on another host"
        line = (
            f"rank {self.rank}: rank {self.watched} went silent ({where}): no heartbeat for {age:.0f} s"
            f"{self.timeout_flag}; rank {self.rank} waited for it in {mine or 'no collective yet'}; rank "
            f"{self.watched}'s last collective: {theirs or 'none yet'}"
        )
        first, shown, code = self.end(line, failures.EXIT_FAILURE)
        return shown, code, first

    def _store_silent(self, err: BaseException):
        now = time.monotonic()
        if self._store_down_since is None:
            self._store_down_since = now
            return None
        if now - self._store_down_since < self.timeout:
            return None
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        line = (
            f"rank {self.rank}: the launch's store stopped answering for {now - self._store_down_since:.0f} s "
            f"(the host running torchrun's rendezvous is lost?): {first_line}"
        )
        return line, failures.EXIT_FAILURE, True

    def _guard_run(self) -> None:
        """Watches the beating thread itself: on a cut link no socket closes and a store request can
        wait for good (the store's client timeout bounds waits for keys, not a reply that never
        comes), so a thread blocked in one is noticed here, from its last answer."""
        while not self._stop.wait(self.interval):
            line = self._stuck_line(time.monotonic())
            if line is not None and not self._stop.is_set():
                if not self.host_speaker:  # this host's ranks are cut off together: one says it
                    self._stop.wait(2 * self.interval)
                self._leave(line, failures.EXIT_FAILURE, self.host_speaker)

    def _stuck_line(self, now: float) -> str | None:
        waited = now - self._answered
        if waited < self.timeout + self.interval:
            return None
        return (
            f"rank {self.rank}: the launch's store has not answered for {waited:.0f} s{self.timeout_flag}: the host "
            f"running torchrun's rendezvous is lost or this host is cut off from it"
        )

    def _leave(self, line: str, code: int, first: bool) -> None:
        if not self._leaving.acquire(blocking=False):
            return  # the other thread is already ending the process
        if first:
            print(f"error: {line}", file=sys.stderr, flush=True)
        failures.write_error_file(self.error_file, line)
        sys.stdout.flush()
        os._exit(code)


def describe_activity(log) -> str | None:
    """What a CommLog (None: none yet) says this rank last issued, for a heartbeat."""
    last = log.last_issued if log is not None else None
    if last is None:
        return None
    op, group, ranks, count = last
    shown = f"ranks {list(ranks)}" if len(ranks) <= 16 else f"{len(ranks)} ranks from {ranks[0]} to {ranks[-1]}"
    return f"{op} over the {group} group ({shown}), its collective #{count}"
