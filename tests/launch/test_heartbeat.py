"""megazero.heartbeat's watch, in one process on a HashStore (the torchrun case, a SIGSTOPped rank
under a backend timeout longer than the heartbeat's, is in test_operations.py): a rank whose count
stops moving for the timeout is named with both ranks' last collectives; a rank not started yet, one
that said it is done, and one that keeps beating are not; a line another rank posted is taken up;
a store that stops answering is named after the timeout, not at its first error."""
import json
import time

import torch.distributed as dist

from megazero.core import comm
from megazero.heartbeat import Heartbeat, describe_activity


def _pair(store, timeout=0.3):
    ended = []

    def end(line, code):
        ended.append(line)
        return True, line, code
    beats = [Heartbeat(store, r, 2, timeout, lambda r=r: f"all_gather #{r}", end, lambda: {}, None,
                       interval_s=0.05) for r in range(2)]
    return beats, ended


def test_a_rank_whose_beats_stop_is_named_after_the_timeout():
    store = dist.HashStore()
    (watcher, watched), ended = _pair(store)
    assert watcher.watched == 1 and watched.watched == 0
    assert watcher._check() is None                     # rank 1 has not started: not silent
    watched._beat()
    assert watcher._check() is None                     # first seen now
    time.sleep(0.15)
    watched._beat()
    assert watcher._check() is None                     # it moved
    time.sleep(0.4)
    line, code, first = watcher._check()
    assert first and code == 1 and ended == [line]
    assert line.startswith("rank 0: rank 1 went silent (on another host): no heartbeat for 0 s; rank 0 waited "
                           "for it in all_gather #0; rank 1's last collective: all_gather #1"), line
    watched.stop()                                      # a clean end is never silence
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
    assert first and code == 1 and line.startswith("rank 0: the launch's store stopped answering for 0 s") and \
        line.endswith(": Connection reset by peer"), line


def test_the_comm_log_says_what_was_issued_last():
    log = comm.CommLog()
    assert describe_activity(log) is None
    group = comm.Group("dp", (0, 1), 0, None, True, log)
    log.record("all_reduce", group, 8)
    log.record("all_gather", group, 8)
    assert describe_activity(log) == "all_gather over the dp group (ranks [0, 1]), its collective #2"
    log.record("all_gather", comm.Group("mics_shard", tuple(range(64)), 0, None, False, log), 8)
    assert describe_activity(log).startswith("all_gather over the mics_shard group (64 ranks from 0 to 63)")
