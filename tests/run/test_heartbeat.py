"""megazero.run.heartbeat's watch, in one process on a HashStore (the torchrun case, a SIGSTOPped rank
under a backend timeout longer than the heartbeat's, is in test_operations.py): a rank whose count
stops moving for the timeout is named with both ranks' last collectives; a rank not started yet, one
that said it is done, and one that keeps beating are not; a line another rank posted is taken up;
a store that stops answering is named after the timeout, not at its first error."""

import json
import re
import time

import torch.distributed as dist

from megazero.core import comm
from megazero.run.heartbeat import Heartbeat, describe_activity


def _pair(store, timeout=0.3):
    ended = []

    def end(line, code):
        ended.append(line)
        return True, line, code

    beats = [
        Heartbeat(store, r, 2, timeout, lambda r=r: f"all_gather #{r}", end, lambda: {}, None, interval_s=0.05)
        for r in range(2)
    ]
    return beats, ended


def test_a_rank_whose_beats_stop_is_named_after_the_timeout():
    store = dist.HashStore()
    (watcher, watched), ended = _pair(store)
    assert watcher.watched == 1 and watched.watched == 0
    assert watcher._check() is None  # rank 1 has not started: not silent
    watched._beat()
    assert watcher._check() is None  # first seen now
    time.sleep(0.15)
    watched._beat()
    assert watcher._check() is None  # it moved
    time.sleep(0.4)
    line, code, first = watcher._check()
    assert first and code == 1 and ended == [line]
    assert line.startswith(
        "rank 0: rank 1 went silent (on another host): no heartbeat for 0 s; rank 0 waited "
        "for it in all_gather #0; rank 1's last collective: all_gather #1"
    ), line
    watched.stop()  # a clean end is never silence
    time.sleep(0.4)
    assert watcher._check() is None


def test_a_line_posted_by_another_rank_is_taken_up():
    store = dist.HashStore()
    (watcher, watched), _ = _pair(store)
    watched._beat()
    store.set("ending/line", json.dumps(["rank 1: lost rank 3", 1]))
    assert watcher._check() == ("rank 1: lost rank 3", 1, False)


def test_a_store_that_stops_answering_is_named_after_the_timeout():
    (watcher, _), _ = _pair(dist.HashStore())
    err = RuntimeError("Connection reset by peer\nmore")
    assert watcher._store_silent(err) is None
    time.sleep(0.35)
    line, code, first = watcher._store_silent(err)
    assert (
        first
        and code == 1
        and line.startswith("rank 0: the launch's store stopped answering for 0 s")
        and line.endswith(": Connection reset by peer")
    ), line


def test_the_comm_log_says_what_was_issued_last():
    log = comm.CommLog()
    assert describe_activity(log) is None
    group = comm.Group("dp", (0, 1), 0, None, True, log)
    log.record("all_reduce", group, 8)
    log.record("all_gather", group, 8)
    assert describe_activity(log) == "all_gather over the dp group (ranks [0, 1]), its collective #2"
    log.record("all_gather", comm.Group("mics_shard", tuple(range(64)), 0, None, False, log), 8)
    assert describe_activity(log).startswith("all_gather over the mics_shard group (64 ranks from 0 to 63)")


class _StuckStore:
    """A store whose requests never come back after the first `answers` (a cut link: no error, no reply)."""

    def __init__(self, answers: int):
        self.inner, self.answers, self.release = dist.HashStore(), answers, __import__("threading").Event()

    def __getattr__(self, name):
        def call(*args):
            if self.answers <= 0:
                self.release.wait()
                raise RuntimeError("released")
            self.answers -= 1
            return getattr(self.inner, name)(*args)

        return call


def test_a_beat_blocked_in_a_request_is_named_by_the_guard():
    store = _StuckStore(answers=3)
    beat = Heartbeat(
        store, 0, 2, 0.3, lambda: None, lambda line, code: (True, line, code), lambda: {}, None, interval_s=0.05
    )
    beat._beat()
    beat._answered = time.monotonic()
    beat._thread.start()  # the beating thread only: its second beat blocks for good
    time.sleep(0.2)
    assert beat._stuck_line(time.monotonic()) is None
    time.sleep(0.3)
    line = beat._stuck_line(time.monotonic())
    assert re.fullmatch(
        r"rank 0: the launch's store has not answered for \d+ s: the host running torchrun's "
        r"rendezvous is lost or this host is cut off from it",
        line,
    ), line
    store.release.set()
    beat._stop.set()


def test_a_silent_rank_on_another_host_is_named_with_its_host_and_ranks():
    store = dist.HashStore()
    peers = {
        1: json.dumps({"host": "node7", "ns": "pid:[1]", "pid": 11, "address": "10.0.0.7"}),
        2: json.dumps({"host": "node7", "ns": "pid:[1]", "pid": 12, "address": "10.0.0.7"}),
        3: json.dumps({"host": "node8", "ns": "pid:[2]", "pid": 13, "address": "10.0.0.8"}),
    }
    beat = Heartbeat(store, 0, 4, 0.1, lambda: None, lambda line, code: (True, line, code), lambda: peers, None)
    line, _, _ = beat._silent_line({"n": 3, "last": None}, 0.2)
    assert line.startswith("rank 0: rank 1 went silent (on host node7 (ranks 1, 2): that host is lost or cut off)")
